"""SharedMemTransport used on its own, TorchRL's way: a worker holding one end of a pipe
(no scheme, no reader thread) reads the sender's segment messages itself, here, whenever
it looks for weights."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.errors import WeightSyncTimeoutError
from weightsync.core.layout import Layout
from weightsync.core.strategy import WeightStrategy, flat_tensors
from weightsync.core.versions import NO_VERSION
from weightsync.transports.local.channel import Channel, ChannelClosed, Message


class StandaloneTransport(Protocol):
    """What the pipe flow uses of ``transports.shm.transport.SharedMemTransport`` (named here
    so that this module does not import the one that imports it)."""

    _receiver_versions: dict[str, int]

    def mark_sender_lost(self) -> None: ...

    def handle_message(self, message: Message) -> bool: ...

    def _pump(self, timeout: float) -> None: ...

    def wait_for_model(self, model_id: str, deadline: Deadline, pump: Any = None) -> Layout: ...

    def published_version(self, worker_idx: int, model_id: str = ...) -> int: ...

    def apply_latest(self, worker_idx: int, dest: Mapping[str, torch.Tensor], held_version: int,
                     deadline: Deadline, model_id: str = ...,
                     pump: Callable[[float], None] | None = None) -> int | None: ...


def pump(transport: StandaloneTransport, channel: Channel | None, timeout: float) -> None:
    """Take every segment message waiting on ``channel`` (for up to ``timeout`` for the first)."""
    if channel is None:
        return
    while channel.readable(timeout):
        try:
            message = channel.recv(timeout=5.0)
        except ChannelClosed:
            transport.mark_sender_lost()
            return
        transport.handle_message(message)
        timeout = 0.0


def first_weights(transport: StandaloneTransport, worker_idx: int, target: Any,
                  strategy: WeightStrategy | None, deadline: Deadline, model_id: str) -> Any:
    """Wait for the segments and the first version, apply it to ``target``, return it."""
    transport.wait_for_model(model_id, deadline, pump=transport._pump)
    while transport.published_version(worker_idx, model_id) < 0:
        if deadline.expired():
            raise WeightSyncTimeoutError(f"worker {worker_idx}: no version within {deadline}")
        transport._pump(deadline.slice(0.01))
    return newest_weights(transport, worker_idx, target, strategy, deadline, model_id)


def newest_weights(transport: StandaloneTransport, worker_idx: int, target: Any,
                   strategy: WeightStrategy | None, deadline: Deadline, model_id: str) -> Any | None:
    """Apply the newest version to ``target`` if newer than the one it holds; the weights
    as ``strategy`` extracts them, or None if there was nothing newer."""
    if target is None:
        raise ValueError("receive_weights needs a model or a weights buffer to write into")
    transport._pump(0.0)
    dest = flat_tensors(target, what="receive_weights destination")
    held = transport._receiver_versions.get(model_id, NO_VERSION)
    applied = transport.apply_latest(worker_idx, dest, held, deadline, model_id,
                                     pump=transport._pump)
    if applied is None:
        return None
    transport._receiver_versions[model_id] = applied
    return (strategy or WeightStrategy()).extract_weights(target)
