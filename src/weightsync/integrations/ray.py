"""Ray actors as weightsync workers: ``RayWeightReceiverMixin`` gives any actor class the
methods the Ray scheme's sender calls (defined beside the scheme, in
``weightsync.schemes.ray_actor``; this is where users import it)."""

from weightsync.schemes.ray_actor import RayWeightReceiverMixin

__all__ = ["RayWeightReceiverMixin"]
