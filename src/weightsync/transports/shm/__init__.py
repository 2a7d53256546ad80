"""SharedMem: versions packed once into slots of shared memory that every worker reads.
``slots`` owns the control block (targets, bytes packed), the per-worker ack segments and
the slot pool with its ``fcntl`` locks; ``apply`` is a worker's copy (following the pack) or
zero-copy adoption; ``transport`` is ``SharedMemTransport`` (slots in, versions out);
``standalone`` the same transport used on its own; ``endpoints`` hands the ends
``SharedMemWriter`` and ``SharedMemReader``, built on ``transports.local``."""
