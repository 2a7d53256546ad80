"""SharedMem's data plane on the rank board (:mod:`weightsync.transports.ranks.socket_board`):
rank 0 hands each new slot to the ranks before sealing it (``rank.slot`` with its fd,
answered ``rank.mapped``) and retires slots a new connection has not mapped
(``rank.retire``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.errors import TrainerRankLostError
from weightsync.transports.local.channel import Message
from weightsync.transports.ranks.socket_board import RankConnection, RankHub, RankLink


class SlotHub:
    """Rank 0's rank hub on the workers' host (``board``), and SharedMem's slots handed out
    over it."""

    def __init__(self, address: str, rank_key: str, uid: int, world: int) -> None:
        self.board = RankHub(address, rank_key, uid, world, heard=self._heard)
        self._requests = itertools.count(1)
        #: connection serial -> the (slot index, request) it answered mapped
        self._mapped: dict[int, set[tuple[int, int]]] = {}

    def _heard(self, connection: RankConnection, kind: Any, header: dict[str, Any]) -> None:
        if kind == "rank.mapped":
            self._mapped.setdefault(connection.serial, set()).add(
                (int(header["index"]), int(header["request"])))

    def hand_out(self, index: int, fd: int, nbytes: int, deadline: Deadline) -> dict[int, int]:
        """Hand slot ``index`` to every rank connected now and wait (until ``deadline``)
        until each mapped it writable; returns rank -> the connection that did."""
        request = next(self._requests)
        board = self.board
        board.tell({"t": "rank.slot", "index": index, "nbytes": nbytes, "request": request},
                   fds=[fd])
        with board.cond:
            while True:
                waiting = {r: c for r, c in board.connections.items()
                           if (index, request) not in self._mapped.get(c.serial, ())}
                for rank, connection in sorted(waiting.items()):
                    if not connection.alive():
                        raise TrainerRankLostError(f"trainer rank {rank} {connection.gone} "
                                                   f"before mapping slot {index}", rank=rank)
                if not waiting:
                    return {r: c.serial for r, c in board.connections.items()}
                if deadline.expired():
                    rank = min(waiting)
                    raise TrainerRankLostError(
                        f"trainer rank {rank} did not map slot {index} within {deadline} "
                        "(stopped, or not in its send)", rank=rank)
                board.cond.wait(deadline.slice(0.1))

    def serials(self) -> dict[int, int]:
        """Rank -> its connection now, for slots mapped by an older one (not writable by
        this one: slots are sealed once handed out)."""
        with self.board.cond:
            return {r: c.serial for r, c in self.board.connections.items() if not c.gone}

    def retire(self, index: int) -> None:
        self.board.tell({"t": "rank.retire", "index": index})


def slot_link(address: str, rank_key: str, uid: int, rank: int,
              on_slot: Callable[[int, int, list[int]], None],
              on_retire: Callable[[int], None]) -> RankLink:
    """Rank ``rank``'s link to rank 0 on the workers' host: slot hand-outs are passed to
    ``on_slot(index, nbytes, fds)`` (then answered mapped) and ``on_retire(index)``."""

    def heard(message: Message) -> None:
        header, kind = message.header, message.header.get("t")
        if kind == "rank.slot":
            on_slot(int(header["index"]), int(header["nbytes"]), message.fds)
            link.send({"t": "rank.mapped", "index": header["index"],
                       "request": header["request"]})
        elif kind == "rank.retire":
            on_retire(int(header["index"]))

    link = RankLink(address, rank_key, uid, rank, heard=heard)
    return link
