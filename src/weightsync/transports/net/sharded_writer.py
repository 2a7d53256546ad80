"""``NetWeightSyncScheme`` for a sharded trainer: each trainer rank's writer as the send
lifecycle drives it (``core/endpoints.ShardedWeightWriter``).

Rank 0 (:class:`NetRankZeroWriter`) is the listener the workers know (their control
connections, :class:`~.members.NetMembers`) and the rank protocol's lead
(:class:`~.sharded.NetRankLead`); within each round it tells the workers the version and
every rank's address, and waits until their hosts staged it (each host fetches every
rank's part at once, ``NetReader``); once the ranks committed it, the workers are told so,
and only then apply it. Ranks 1..N-1 (:func:`net_rank_writer`) serve their own part from a
listener of their own and never wait for the workers.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import WeightSyncError
from weightsync.core.layout import Layout
from weightsync.core.shards import ShardPiece
from weightsync.core.versions import NO_VERSION
from weightsync.transports.net.members import NetMembers
from weightsync.transports.net.sharded import NetRankLead, NetRankMember
from weightsync.transports.net.wire import join_address, split_address
from weightsync.transports.net.writer import Members, link_figures
from weightsync.transports.ranks.member import MemberWriter
from weightsync.transports.ranks.records import Hello, Plan

logger = logging.getLogger(__name__)


class HostsFailedError(WeightSyncError):
    """Some workers' hosts could not stage a version (no rank was lost): after the commit,
    these workers are the send's losses, as on a single trainer."""

    def __init__(self, version: int, losses: Losses) -> None:
        super().__init__(f"the hosts of worker(s) {sorted(losses)} could not stage version "
                         f"{version}: {losses}")
        self.losses = losses


class NetRankZeroWriter:
    """Trainer rank 0 of ``trainer_ranks``: the workers' listener at ``address`` (they prove
    ``token``, at every rank's listener too) and the lead of the ranks (they prove
    ``rank_key``, which the workers never hold)."""

    needs_acks = False  # a round ends once every worker's host staged it
    sharded = True
    rank = 0
    joined_at = NO_VERSION

    def __init__(self, address: str, token: str, rank_key: str, num_workers: int,
                 trainer_ranks: int, *, timeout: float, dtype: torch.dtype | None,
                 delta: bool, board: str = "", members: Members | None = None) -> None:
        self.address, self.trainer_ranks, self.board = address, trainer_ranks, board
        self._token, self._rank_key = token, rank_key
        self.timeout, self.dtype, self.delta = timeout, dtype, delta
        self.members: Members = NetMembers(num_workers) if members is None else members
        self.lead: NetRankLead | None = None
        self.committed = NO_VERSION
        self._notice: dict[str, Any] = {}  # what the current version's notices carry
        self._wire_layout: dict[str, Any] = {}  # the layout the workers receive
        self._requested: list[int] = []  # the workers the current version is for
        self._after_commit: BaseException | None = None  # raised by ``deliver``

    def start(self, deadline: Deadline) -> None:
        """Listen for the workers and the ranks."""
        self.lead = NetRankLead(self.address, self._rank_key, self.trainer_ranks,
                                dtype=self.dtype, timeout=self.timeout, delta=self.delta,
                                board=self.board, hosts_token=self._token,
                                on_join=self.members.join_handler)
        self.members.started(self.lead.own.publisher)

    def publish(self, flat: Mapping[str, Any], layout: Layout, requested: list[int],
                version: int, deadline: Deadline) -> Losses:
        """The whole round: every rank serves its part; the reachable ``requested`` workers'
        hosts stage it; the ranks commit it. Raises what failed the round on every rank
        (``TrainerRankLostError``, ``SchemaMismatchError``); workers lost or whose host
        could not stage it are returned (the version stands)."""
        assert self.lead is not None
        wire_layout = self._wire_layout = layout.with_dtype(self.dtype).to_dict()
        self._requested = list(requested)
        lost: Losses = {}
        self._after_commit = None

        def deliver(number: int, addresses: list[str]) -> None:
            round_ = secrets.token_hex(8)
            self._notice = {"ranks": addresses, "round": round_, "committed": self.committed}
            with self.members.joining:
                reachable, gone = self.members.reachable(requested)
                self.members.published(number, wire_layout, self._notice)
            lost.update(gone)
            lost.update(self.members.notify(reachable, number))
            failed: Losses = {}
            self.members.wait_staged([w for w in reachable if w not in lost], number, deadline,
                                     failed, round_)
            lost.update(failed)
            connected, _ = self.members.reachable(list(failed))
            if connected:  # alive, but could not fetch: a rank lost meanwhile is blamed
                raise HostsFailedError(number, {w: failed[w] for w in connected})

        try:
            self.lead.send(flat, version, deadline, deliver)
        except Exception as exc:
            if self.lead.committed != version:
                raise  # the round failed on every rank: its number is taken again
            self.committed = version
            if not isinstance(exc, HostsFailedError):
                self._after_commit = exc  # e.g. a host too slow: raised as a single trainer's
            return lost
        self.committed = version
        return lost

    def deliver(self, targets: list[int], version: int, deadline: Deadline) -> Losses:
        """The ranks committed ``version``: the workers may apply it (those that joined
        during the round too: they heard of it as they joined, not of its commit)."""
        self._notice = self._notice | {"committed": version}
        with self.members.joining:
            self.members.published(version, self._wire_layout, self._notice)
            joined, _ = self.members.reachable(self._requested)
        lost = self.members.notify(targets, version)
        self.members.notify([w for w in joined if w not in targets], version)
        failure, self._after_commit = self._after_commit, None
        if failure is not None:
            raise failure
        return lost

    def wait_acked(self, targets: list[int], version: int, deadline: Deadline,
                   lost: Losses) -> None:
        """Nothing to wait for: the round waited until the workers' hosts staged it."""

    def wait_joined(self, version: int, deadline: Deadline) -> None:
        self.members.wait_joined(version, deadline)

    def version_figures(self, version: int) -> dict[str, Any]:
        """What crossed rank 0's own link for ``version`` (its pieces; each rank says its
        own, ``writer.link_figures``)."""
        return link_figures(None if self.lead is None else self.lead.own.publisher, version)

    def held_versions(self) -> dict[int, int]:
        return self.members.held_versions()

    def close(self) -> None:
        self.members.close()
        if self.lead is not None:
            self.lead.close()


class NetMemberPlane:
    """The network's data plane on rank ``rank`` > 0 (a ``MemberPlane``): its own listener,
    serving its pieces of each version rank 0 plans."""

    def __init__(self, member: NetRankMember) -> None:
        self.member = member

    def start(self, deadline: Deadline) -> int:
        self.member.open(deadline)
        return self.member.link.joined_at

    def writer(self, pieces: list[ShardPiece], layout: Layout, deadline: Deadline
               ) -> Callable[[Plan], dict[str, Any]]:
        own = self.member.own
        own.pieces, own.layout = pieces, layout
        return lambda plan: own.publish(plan.version)

    def failed(self, plan: Plan | None) -> None:
        """Nothing to undo: the next attempt publishes its number again."""

    def version_figures(self, version: int) -> dict[str, Any]:
        """What crossed this rank's own link for ``version`` (its pieces)."""
        return link_figures(self.member.own.publisher, version)

    def close(self, hello: Hello | None) -> None:
        self.member.close()


def net_rank_writer(address: str, token: str, rank_key: str, rank: int, *, timeout: float,
                    dtype: torch.dtype | None, delta: bool, board: str = "") -> MemberWriter:
    """Rank ``rank`` > 0: serves its part from a listener on ``address``'s host (a free
    port; its address reaches the workers through rank 0) to hosts proving ``token``;
    ``board``: rank 0's board over TCP at that address (ranks on several hosts)."""
    host, _ = split_address(address)
    member = NetRankMember(join_address(host, 0), rank_key, rank, dtype=dtype,
                           timeout=timeout, delta=delta, board=board, hosts_token=token)
    return MemberWriter(rank, member.link, NetMemberPlane(member))
