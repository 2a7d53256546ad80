"""Transports: how bytes move, one package per family (local, shm, mp, directory, ray) plus
the memory primitives they share. None imports a scheme."""

from weightsync.transports.base import TransportBackend
from weightsync.transports.mp.transport import MPTransport
from weightsync.transports.shm.transport import SharedMemTransport

__all__ = ["MPTransport", "SharedMemTransport", "TransportBackend"]
