"""Schemes: the sender/receiver API on top of a transport (rendezvous, versions, acks)."""

from weightsync.schemes.base import WeightSyncScheme
from weightsync.schemes.double_buffer import (
    VLLMDoubleBufferSyncScheme,
    VLLMDoubleBufferWeightReceiver,
    VLLMDoubleBufferWeightSender,
)
from weightsync.schemes.multiprocess import MultiProcessWeightSyncScheme
from weightsync.schemes.receiver import WeightReceiver
from weightsync.schemes.sender import WeightSender
from weightsync.schemes.shared_mem import SharedMemWeightSyncScheme

__all__ = [
    "MultiProcessWeightSyncScheme",
    "SharedMemWeightSyncScheme",
    "VLLMDoubleBufferSyncScheme",
    "VLLMDoubleBufferWeightReceiver",
    "VLLMDoubleBufferWeightSender",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncScheme",
]
