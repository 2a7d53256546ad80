"""Ray: actors anywhere in a Ray cluster. Ray calls carry the signals; the bytes go through
shared memory to actors on the trainer's node (``node_local``, fds handed over an
authenticated socket against one-time tickets) and through one checksummed broadcast of
weightsync's own gloo/NCCL ``group`` to one relay per other node. ``members`` holds the
actors, their announcements and the group builds; ``stream`` packs the snapshot into the
broadcast as it goes out; ``rendezvous``, ``answers`` and ``staging`` are small helpers;
``transport`` is ``RayTransport``; ``writer`` and ``reader`` are the ``RayWriter`` and
``RayReader`` the ends are handed. Importing this package does not import Ray."""
