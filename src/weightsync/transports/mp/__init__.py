"""MultiProcess: each version streamed as bytes into every worker's own memory, no shared
segments. ``snapshots`` is the data path's buffers (a sender's ``Snapshot``, a worker's
``Staging`` and ``StagedStream``) and the wire framing; ``streams`` the snapshot pool and
one streamer thread per worker; ``pipe`` the per-worker pipe the snapshot's pages are
mapped into (``vmsplice``); ``endpoints`` hands the ends ``StreamWriter`` and
``StreamReader``, built on ``transports.local``. ``transport`` is ``MPTransport``, an
adapter for TorchRL's transport API over ``snapshots`` (queues or one pipe, no scheme)."""
