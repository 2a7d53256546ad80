"""Transports: how bytes move, one package per family (local, shm, mp, directory, ray, net)
plus the memory primitives they share. None imports a scheme. Each family's ends implement
``core.endpoints``' ``WeightWriter`` / ``WeightReader``; the names exported here are
TorchRL's transport API (``base.TransportBackend``) and its adapters at the edge."""

from weightsync.transports.base import TransportBackend
from weightsync.transports.mp.transport import MPTransport
from weightsync.transports.shm.transport import SharedMemTransport

__all__ = ["MPTransport", "SharedMemTransport", "TransportBackend"]
