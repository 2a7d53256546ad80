"""Memory primitives shared across families: ``memfd`` segments mapped as tensors (sealed
so only their creator writes them), the ``futex`` ring word blocked workers sleep on,
``cuda_ipc`` handles as typed fields (never pickled) with the consumer counts a dead worker
left, and ``pieces``, packing a layout into one buffer piece by piece (and copying out as
the pieces land). No protocol lives here: SharedMem, MultiProcess and Ray's node-local path
use them."""
