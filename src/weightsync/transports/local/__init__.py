"""Same host, shared by SharedMem and MultiProcess: the authenticated Unix-socket channel
between a trainer and its worker processes. ``channel`` frames JSON headers, raw payloads and
file descriptors; ``address`` names abstract sockets, listens and connects; ``auth`` checks
peer credentials and runs the token's challenge-response; ``accept`` is the accept loop
every socket listener shares (local or TCP), which a connection flood cannot kill; ``hub``
is the trainer's hub that admits workers and reads their messages; ``members`` is who is
connected and the waits for their acks; ``link`` is a worker's connection (handshake,
reader thread, rejoin). It hands the ends no writer or reader of its own: ``shm`` and
``mp`` build theirs on it."""
