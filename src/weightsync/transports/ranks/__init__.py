"""The rank protocol of a sharded trainer, written once for every transport that takes
``trainer_ranks``: the records (``records``), rank 0's state machine (``lead``), the
other ranks' (``member``), over a small board interface (``board``) that each transport
implements in its own medium (socket messages, files, a Ray actor) beside its data plane.
The protocol imports no transport; the socket board (``socket_board``, shared by SharedMem
and the network transport) is built on ``transports.local``'s channels."""
