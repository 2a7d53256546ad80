"""Transports: how bytes move. One module per transport; none imports a scheme."""

from weightsync.transports.base import TransportBackend
from weightsync.transports.multiprocess import MPTransport
from weightsync.transports.shared_mem import SharedMemTransport

__all__ = ["MPTransport", "SharedMemTransport", "TransportBackend"]
