"""The Ray scheme's rendezvous: a named actor on the trainer's node that receivers find by
name. It holds the group's public connection info (never the token) and the handles of
actors that announced themselves; it dies with the trainer's node, which is how receivers
learn that their sender is gone.

With a sharded trainer (``trainer_ranks > 1``) it is also the rank protocol's board
(``transports/ranks/``): ranks 1..N-1 post their hellos and dones, rank 0 its plans and
outcomes, all as the protocol's JSON records (``sharded_lead.py``, ``sharded_rank.py``); no
collective on the user's process group is needed. It is owned by rank 0's process, so it
dies with it, which is how the other ranks learn that rank 0 is gone. It never holds the
workers' token; rank 0 creates it with the ranks' key, and it takes only records that prove
it (``transports/ranks/seal.py``): a process without the key (a worker, which holds the
token) cannot post a hello, a done, a plan or an outcome, nor withdraw a rank's hello. Ray
calls themselves are not authenticated by weightsync (docs/security.md); what crosses the
group is authenticated by the group itself."""

from __future__ import annotations

import logging
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.transports.ray.group import current_node_id

logger = logging.getLogger(__name__)

#: how long a rank's call on the board waits outside a round; inside one, what is left of
#: the round's deadline, but at least ``BOARD_CALL_MIN_S`` (a failure is still posted after
#: it): an actor just started on a loaded node may take seconds to answer its first call
BOARD_CALL_S = 10.0
BOARD_CALL_MIN_S = 1.0


def board_call_timeout(deadline: Deadline | None) -> float | None:
    """The timeout of one board call made within ``deadline`` (None: outside a round)."""
    if deadline is None:
        return BOARD_CALL_S
    left = deadline.remaining()
    return None if left is None else max(left, BOARD_CALL_MIN_S)


class Rendezvous:
    """The named Ray actor's state: connection info, layout, announcements."""

    def __init__(self, rank_key: str = "") -> None:
        #: the ranks' key (sharded trainers: every rank record must prove it)
        self._rank_key = rank_key
        self.info: dict[str, Any] | None = None
        self.layout: dict[str, Any] | None = None
        self.announced: dict[int, Any] = {}
        # sharded trainers: rank -> hello, the current plan, attempt -> {rank: done record},
        # attempt -> outcome, rank -> the generation it is joining
        self.hellos: dict[int, dict[str, Any]] = {}
        self.plan: dict[str, Any] | None = None
        self.dones: dict[str, dict[int, dict[str, Any]]] = {}
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.joining: dict[int, int] = {}
        self.committed = -1
        #: the group generation of the newest plan that named one: a newer generation is
        #: being built (ranks join it); this one or an older is in use, or dead
        self.planned_generation = -1

    def set_group(self, info: dict[str, Any], layout: dict[str, Any]) -> None:
        self.info, self.layout = info, layout

    def group_info(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return self.info, self.layout

    def announce(self, worker_idx: int, handle: Any) -> None:
        self.announced[worker_idx] = handle

    def take_announcements(self) -> dict[int, Any]:
        out, self.announced = self.announced, {}
        return out

    def ping(self) -> bool:
        return True

    # ------------------------------------------------ sharded trainers (the rank board)
    def _opened(self, kind: str, record: Any, where: str) -> tuple[dict[str, Any], str]:
        """The content of a rank record that proves the rank key, or ({}, why not)."""
        from weightsync.core.errors import IntegrityError
        from weightsync.transports.ranks.seal import RecordSeal

        try:
            return RecordSeal(self._rank_key).opened(kind, record, where), ""
        except (IntegrityError, ValueError) as exc:
            logger.warning("refused a record: %s", exc)
            return {}, str(exc)

    def post_hello(self, rank: int, hello: dict[str, Any]) -> str:
        """Rank ``rank``'s sealed hello (a record of ``transports/ranks``), unless it does
        not prove the rank key or another live process holds the rank: then why it is
        refused, and nothing changes."""
        from weightsync.core.errors import IntegrityError
        from weightsync.transports.ranks.liveness import claim_refused
        from weightsync.transports.ranks.records import Hello

        where = f"trainer rank {rank}'s hello"
        body, why = self._opened("hello", hello, where)
        if why:
            return why
        try:
            claimant = Hello.from_json(body, where)
            held = None if rank not in self.hellos else Hello.from_json(
                self._opened("hello", self.hellos[rank], where)[0], where)
        except IntegrityError as exc:
            return f"trainer rank {rank}: {exc}"
        if claimant.rank != rank:
            return f"{where} names rank {claimant.rank}"
        why = claim_refused(held, claimant)
        if not why:
            self.hellos[rank] = hello
        return why

    def withdraw_hello(self, rank: int, withdrawal: dict[str, Any]) -> str:
        """Rank ``rank`` closed: forget its hello if it is still the incarnation the sealed
        ``withdrawal`` names."""
        body, why = self._opened("withdraw", withdrawal, f"trainer rank {rank}'s withdrawal")
        if why:
            return why
        if body.get("rank") == rank and \
                self.hellos.get(rank, {}).get("incarnation") == body.get("incarnation"):
            del self.hellos[rank]
        return ""

    def get_hellos(self) -> dict[int, dict[str, Any]]:
        return dict(self.hellos)

    def post_joining(self, rank: int, generation: int) -> None:
        self.joining[rank] = generation

    def get_joining(self) -> dict[int, int]:
        return dict(self.joining)

    def post_plan(self, plan: dict[str, Any]) -> str:
        """Rank 0's sealed plan (or why it is refused)."""
        _, why = self._opened("plan", plan, "rank 0's plan")
        if why:
            return why
        self.plan = plan
        generation = (plan.get("detail") or {}).get("generation")
        if isinstance(generation, int):  # not a plan that failed before it began
            self.planned_generation = generation
        self.dones[plan["attempt"]] = {}
        for old in list(self.dones)[:-4]:
            del self.dones[old]
        return ""

    def post_done(self, rank: int, attempt: str, record: dict[str, Any]) -> str:
        """Rank ``rank``'s sealed done of ``attempt`` (or why it is refused)."""
        body, why = self._opened("done", record, f"trainer rank {rank}'s done")
        if why:
            return why
        if body.get("rank") != rank or body.get("attempt") != attempt:
            return f"trainer rank {rank}'s done names another rank or attempt"
        if attempt in self.dones:
            self.dones[attempt][rank] = record
        return ""

    def get_dones(self, attempt: str) -> dict[int, dict[str, Any]]:
        return dict(self.dones.get(attempt, {}))

    def post_outcome(self, attempt: str, outcome: dict[str, Any]) -> str:
        """Rank 0's sealed outcome of ``attempt`` (or why it is refused)."""
        body, why = self._opened("outcome", outcome, "rank 0's outcome")
        if why:
            return why
        if body.get("attempt") != attempt:
            return f"rank 0's outcome names another attempt than {attempt}"
        self.outcomes[attempt] = outcome
        if outcome.get("committed") is True:
            self.committed = max(self.committed, int(outcome["version"]))
        for old in list(self.outcomes)[:-8]:
            del self.outcomes[old]
        return ""

    def board(self) -> dict[str, Any]:
        """What a rank 1..N-1 polls: the group, the plan, its outcome, the newest committed."""
        plan = self.plan
        outcome = None if plan is None else self.outcomes.get(plan["attempt"])
        return {"info": self.info, "plan": plan, "outcome": outcome,
                "committed": self.committed, "planned_generation": self.planned_generation}

    def get_outcome(self, attempt: str) -> dict[str, Any] | None:
        return self.outcomes.get(attempt)


def start_rendezvous(name: str, namespace: str | None = None, rank_key: str = "") -> Any:
    """The rendezvous actor ``name``, pinned to this process's node: it answers while that
    node lives and dies with it. ``namespace`` (sharded trainers, whose ranks are separate
    Ray jobs): the Ray namespace it is registered in, so every rank and actor finds it;
    ``rank_key``: the key every rank record must prove."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(current_node_id(), soft=False)
    options: dict[str, Any] = {"name": name, "scheduling_strategy": here}
    if namespace is not None:
        options["namespace"] = namespace
    return ray.remote(num_cpus=0)(Rendezvous).options(**options).remote(rank_key)
