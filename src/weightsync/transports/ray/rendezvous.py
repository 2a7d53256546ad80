"""The Ray scheme's rendezvous: a named actor on the trainer's node that receivers find by
name. It holds the group's public connection info (never the token) and the handles of
actors that announced themselves; it dies with the trainer's node, which is how receivers
learn that their sender is gone.

With a sharded trainer (``trainer_ranks > 1``) it is also the rank protocol's board
(``transports/ranks/``): ranks 1..N-1 post their hellos and dones, rank 0 its plans and
outcomes, all as the protocol's JSON records (``sharded_lead.py``, ``sharded_rank.py``); no
collective on the user's process group is needed. It is owned by rank 0's process, so it
dies with it, which is how the other ranks learn that rank 0 is gone. The board holds no
secret and Ray calls are not authenticated by weightsync (docs/security.md); what crosses
the group is authenticated by the group itself."""

from __future__ import annotations

from typing import Any

from weightsync.transports.ray.group import current_node_id


class Rendezvous:
    """The named Ray actor's state: connection info, layout, announcements."""

    def __init__(self) -> None:
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
    def post_hello(self, rank: int, hello: dict[str, Any]) -> str:
        """Rank ``rank``'s hello (a record of ``transports/ranks``), unless another live
        process holds the rank: then why it is refused, and nothing changes."""
        from weightsync.core.errors import IntegrityError
        from weightsync.transports.ranks.liveness import claim_refused
        from weightsync.transports.ranks.records import Hello

        try:
            claimant = Hello.from_json(hello, f"trainer rank {rank}'s hello")
            held = None if rank not in self.hellos else Hello.from_json(self.hellos[rank], "")
        except IntegrityError as exc:
            return f"trainer rank {rank}: {exc}"
        why = claim_refused(held, claimant)
        if not why:
            self.hellos[rank] = hello
        return why

    def withdraw_hello(self, rank: int, incarnation: str) -> None:
        """Rank ``rank`` closed: forget its hello if it is still that incarnation's."""
        if self.hellos.get(rank, {}).get("incarnation") == incarnation:
            del self.hellos[rank]

    def get_hellos(self) -> dict[int, dict[str, Any]]:
        return dict(self.hellos)

    def post_joining(self, rank: int, generation: int) -> None:
        self.joining[rank] = generation

    def get_joining(self) -> dict[int, int]:
        return dict(self.joining)

    def post_plan(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        generation = (plan.get("detail") or {}).get("generation")
        if isinstance(generation, int):  # not a plan that failed before it began
            self.planned_generation = generation
        self.dones[plan["attempt"]] = {}
        for old in list(self.dones)[:-4]:
            del self.dones[old]

    def post_done(self, rank: int, attempt: str, record: dict[str, Any]) -> None:
        if attempt in self.dones:
            self.dones[attempt][rank] = record

    def get_dones(self, attempt: str) -> dict[int, dict[str, Any]]:
        return dict(self.dones.get(attempt, {}))

    def post_outcome(self, attempt: str, outcome: dict[str, Any]) -> None:
        self.outcomes[attempt] = outcome
        if outcome.get("committed") is True:
            self.committed = max(self.committed, int(outcome["version"]))
        for old in list(self.outcomes)[:-8]:
            del self.outcomes[old]

    def board(self) -> dict[str, Any]:
        """What a rank 1..N-1 polls: the group, the plan, its outcome, the newest committed."""
        plan = self.plan
        outcome = None if plan is None else self.outcomes.get(plan["attempt"])
        return {"info": self.info, "plan": plan, "outcome": outcome,
                "committed": self.committed, "planned_generation": self.planned_generation}

    def get_outcome(self, attempt: str) -> dict[str, Any] | None:
        return self.outcomes.get(attempt)


def start_rendezvous(name: str, namespace: str | None = None) -> Any:
    """The rendezvous actor ``name``, pinned to this process's node: it answers while that
    node lives and dies with it. ``namespace`` (sharded trainers, whose ranks are separate
    Ray jobs): the Ray namespace it is registered in, so every rank and actor finds it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(current_node_id(), soft=False)
    options: dict[str, Any] = {"name": name, "scheduling_strategy": here}
    if namespace is not None:
        options["namespace"] = namespace
    return ray.remote(num_cpus=0)(Rendezvous).options(**options).remote()
