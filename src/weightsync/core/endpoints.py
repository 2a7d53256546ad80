"""The two small interfaces a transport implements: the trainer's :class:`WeightWriter` and
a worker's :class:`WeightReader`.

The public :class:`~weightsync.schemes.base.WeightSender` and
:class:`~weightsync.schemes.base.WeightReceiver` are written once and are *handed* one of
each; they own the lifecycle (one deadline per public call, the pending send, stats, lost
workers, the apply lock, close). A transport owns its whole protocol behind these methods:
how a version is published, how workers learn of it, how they confirm it. Each docstring
says when the method is called and what it may do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.layout import Layout

#: {worker index: why it did not get a version}, for ``WorkerLostError`` messages
Losses = dict[int, str]


class WeightWriter(Protocol):
    """The trainer's end of a transport."""

    #: True: a version is delivered once each worker confirmed it (``wait_acked`` blocks);
    #: False: publishing is delivery (the worker's next ``poll()`` takes it)
    needs_acks: bool

    def start(self, deadline: Deadline) -> None:
        """Called once, by the first ``connect()`` or ``send()``, before anything is
        published: bind, start threads, meet the workers. May block until ``deadline``."""

    def publish(
        self, flat: Mapping[str, torch.Tensor], layout: Layout, requested: list[int],
        version: int, deadline: Deadline,
    ) -> Losses:
        """Take the snapshot of ``flat`` as ``version`` for the ``requested`` workers that
        can be reached now; returns why each other one cannot (it is not written to).
        Once it returns, the caller may change ``flat``. Never called concurrently."""

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        """Right after ``publish``: let ``targets`` know (a notice, a stream, a broadcast).
        ``send_async`` returns after it; returns the targets lost on the way."""

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Called by ``send()``/``wait_async()`` when ``needs_acks``: block until every
        target not in ``lost`` confirmed ``version``, adding to ``lost`` those that went
        away; raise :class:`~weightsync.core.errors.WeightSyncTimeoutError` naming the
        silent ones at ``deadline``."""

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        """Called by ``connect()`` after ``version`` is published: block until every worker
        holds it or a newer one; raise naming who refused it, was lost, or stayed away."""

    def held_versions(self) -> dict[int, int]:
        """Every worker connected now, with the version it holds as far as known (-1 if
        not yet): for ``stats()``, and a worker listed here is no longer reported lost."""

    def close(self) -> None:
        """Release everything; the workers learn that the sender left."""


class ShardedWeightWriter(WeightWriter, Protocol):
    """One rank's end of a sharded trainer (``trainer_ranks > 1``): a :class:`WeightWriter`
    whose ``publish`` writes this rank's shards of the version the ranks commit together
    (the rank protocol, ``transports/ranks/``)."""

    #: always True: the sender takes DTensors / LocalShards and registers the global layout
    sharded: bool
    #: the newest version committed when this rank joined (read once, after ``start``):
    #: a rank that joins late continues from there, its ``connect()`` is the next version
    joined_at: int
    #: after ``publish`` (which owns the whole round: a failed one raises there): the
    #: version this rank's round committed (the one asked for, or the one rank 0 was at if
    #: this rank fell behind)
    committed: int


def as_sharded(writer: WeightWriter) -> ShardedWeightWriter | None:
    """``writer`` as a sharded rank's writer, or None for a single trainer's."""
    if getattr(writer, "sharded", False) is True:
        return writer  # type: ignore[return-value]
    return None


class WeightReader(Protocol):
    """A worker's end of a transport."""

    #: True: ``apply_newest`` points the destination's tensors at shared memory
    #: (zero-copy) instead of copying, so it needs the model's own Parameter objects
    views_model: bool
    #: what ``connect()`` waits for, named in its timeout error ("committed weights in DIR")
    expecting: str

    def open(self, local: Layout | None, deadline: Deadline) -> None:
        """Called once by ``connect()``: join the sender and check its layout against
        ``local`` (None: the worker applies through a loader), raising
        :class:`~weightsync.core.errors.SchemaMismatchError` (after telling the sender) if
        they differ."""

    def newer_available(self, version: int) -> bool:
        """A cheap look, called by every ``poll()``: may a version newer than ``version``
        be ready to apply? False lets ``poll()`` return at once."""

    def apply_newest(self, dest: dict[str, torch.Tensor], version: int,
                     deadline: Deadline) -> int | None:
        """Apply the newest version delivered to this worker, if newer than ``version``,
        to ``dest`` as a whole; returns it, or None. Called under the receiver's apply lock,
        so ``close()`` never runs meanwhile. ``deadline`` bounds waiting for a busy slot."""

    def wait(self, version: int, deadline: Deadline) -> None:
        """Block a short while (at most until ``deadline``) for something newer than
        ``version`` to arrive; raise :class:`~weightsync.core.errors.SenderLostError` if
        the sender is gone."""

    def check_sender(self, version: int) -> None:
        """Called when ``poll()`` found nothing new: raise ``SenderLostError`` (naming
        ``version``, which the worker keeps) if the sender is gone; never blocks."""

    def ack(self, version: int) -> None:
        """The worker now holds ``version``: tell the sender, if it wants to know."""

    def close(self, dest: dict[str, torch.Tensor] | None) -> None:
        """Leave (a clean goodbye, not a loss) and release everything; ``dest`` is the
        model's tensors, so views into shared memory can be turned into copies first."""
