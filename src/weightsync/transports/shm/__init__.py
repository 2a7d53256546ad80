"""SharedMem: versions packed once into slots of shared memory that every worker reads.
``slots`` owns the control block (targets, bytes packed), the per-worker ack segments and
the slot pool with its ``fcntl`` locks; ``publisher`` is the sender's ``SlotPublisher``
(slots in, versions out) and ``reader`` a worker's ``SlotReader``, with ``apply`` its copy
(following the pack) or zero-copy adoption; ``endpoints`` hands the ends
``SharedMemWriter`` and ``SharedMemReader``, built on ``transports.local``. ``transport``
is ``SharedMemTransport``, an adapter for TorchRL's transport API over the publisher and
the reader (pipes registered by the caller, no scheme)."""
