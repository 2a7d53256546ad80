"""Ray: actors anywhere in a Ray cluster. Ray calls carry the signals; the bytes go through
shared memory to actors on the trainer's node (``node_local``, fds handed over a ``local``
channel listener, checked by peer credentials, against one-time tickets) and through one
checksummed broadcast of weightsync's own gloo/NCCL ``group`` to one relay per other node.
``members`` holds the actors, their announcements and the group builds; ``stream`` packs
the snapshot into the broadcast as it goes out; ``delivery`` is what each take call tells
an actor, typed; ``link`` is an actor's membership; ``rendezvous``, ``answers`` and
``staging`` are small helpers; ``writer`` and ``reader`` are the ``RayWriter`` and
``RayReader`` the ends are handed; ``transport`` is ``RayTransport``, TorchRL's per-actor
class by its signature only. Importing this package does not import Ray."""
