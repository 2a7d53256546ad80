"""MultiProcess: each version streamed as bytes into every worker's own memory, no shared
segments. ``transport`` is ``MPTransport`` (snapshots, staging, framing); ``streams`` the
snapshot pool and one streamer thread per worker; ``pipe`` the per-worker pipe the
snapshot's pages are mapped into (``vmsplice``); ``endpoints`` hands the ends
``StreamWriter`` and ``StreamReader``, built on ``transports.local``."""
