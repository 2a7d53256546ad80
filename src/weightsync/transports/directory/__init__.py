"""The double-buffered directory: safetensors slots, an atomically replaced manifest, acks
and a sender lock, for inference engines and readers on any host that sees the directory.
``manifest`` is the on-disk format (manifest, acks, names, liveness by the lock);
``files`` opens and writes files safely (no symlinks, owner and mode checked); ``slots``
the safetensors slot files and their checksums; ``writer`` and ``reader`` are the
``DirectoryWriter`` and ``DirectoryReader`` the ends are handed."""
