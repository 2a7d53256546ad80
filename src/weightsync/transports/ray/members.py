"""Who the Ray scheme's workers are, and the group generation they form.

The trainer knows each worker by its actor handle (handed over, or announced through the
rendezvous actor by actors set up after the sender). Building a generation checks every
actor's layout, offers the node-local path to the actors on the trainer's node, and joins
the others into a new torch.distributed group with the trainer as rank 0. With ``relay``,
only one actor of each other node (its relay) is a member; the node's other actors (its
followers) copy each version out of the relay's shared memory. A worker that
dies is dropped; one that stays silent is left out and tried again at the next build.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from weightsync.core.deadline import Deadline
from weightsync.core.endpoints import Losses
from weightsync.core.errors import (
    IntegrityError,
    SchemaMismatchError,
    WeightSyncError,
    WeightSyncTimeoutError,
    WorkerLostError,
)
from weightsync.core.layout import Layout
from weightsync.transports.ray.answers import Answers, collect_answers
from weightsync.transports.ray.group import GroupInfo, WeightGroup, current_node_id, node_address
from weightsync.transports.ray.node_local import NodeLocalSender
from weightsync.transports.ray.rendezvous import start_rendezvous

logger = logging.getLogger(__name__)

# Shares of the time left that a step may take, so that a silent actor in one step still
# leaves time to collect the others' answers (and blame only the silent one).
CHECK_SHARE = 0.5
BROADCAST_SHARE = 0.8
ANNOUNCE_SHARE = 0.25


def share(deadline: Deadline, fraction: float) -> float | None:
    """``fraction`` of the time ``deadline`` leaves (None: no deadline)."""
    left = deadline.remaining()
    return None if left is None else left * fraction


class RayMembers:
    """The trainer's view of the actors: handles, the current group generation and its
    members, and the workers already reported lost or silent (not raised again)."""

    def __init__(self, *, num_workers: int, backend: str, secret: str, rendezvous_name: str,
                 store_timeout: float, trainer_ranks: int = 1,
                 namespace: str | None = None, rank_key: str = "") -> None:
        import ray

        self._ray = ray
        self.num_workers = num_workers
        self.backend = backend
        self.secret = secret
        self.rendezvous_name = rendezvous_name
        self._store_timeout = store_timeout
        self.handles: dict[int, Any] = {}
        self.nodes: dict[int, str] = {}  # the Ray node id each actor's layout check named
        self.reported: set[int] = set()  # dead or silent, already reported
        self.members: dict[int, Any] = {}  # in the current group generation
        self.followers: dict[int, int] = {}  # member -> the relay it copies from
        self.connected: set[int] = set()  # joined a generation and not lost since
        self.group: WeightGroup | None = None
        self._generation = 0
        self._store: Any = None
        self.address = node_address()
        self._local_handles: dict[int, Any] = {}  # the actor each node-local worker is
        #: group ranks 0..trainer_ranks-1 are the trainer's ranks (sharded), actors follow
        self.trainer_ranks = trainer_ranks
        self.rendezvous: Any = start_rendezvous(rendezvous_name, namespace, rank_key)

    # ------------------------------------------------------------------ handles
    def register(self, worker_idx: int, handle: Any) -> None:
        self.handles[worker_idx] = handle
        self.reported.discard(worker_idx)

    def replace(self, worker_idx: int, handle: Any) -> None:
        """A (new) actor for ``worker_idx``: it joins at the next build."""
        self.register(worker_idx, handle)
        self.members.pop(worker_idx, None)
        self.group = None  # membership changed: rebuild

    def take_announcements(self, deadline: Deadline) -> None:
        try:
            announced: dict[int, Any] = self._ray.get(
                self.rendezvous.take_announcements.remote(),
                timeout=share(deadline, ANNOUNCE_SHARE),
            )
        except self._ray.exceptions.GetTimeoutError:
            return  # the next call looks again
        for idx, handle in announced.items():
            known = self.handles.get(idx)
            if known is not None and same_actor(known, handle):
                # an actor whose constructor announced it after the trainer was handed its
                # handle (or a restarted one): the known handle stays, so the trainer still
                # knows what its node holds (a restarted actor refuses its first delta and
                # gets that version whole); the group is rebuilt in case it restarted
                logger.info("worker %d announced its actor again (%s, known already); the "
                            "group is rebuilt at the next send", idx, actor_id(handle))
                handle = known
            else:
                logger.info("worker %d announced a (new) actor; it joins at the next send", idx)
            self.replace(idx, handle)

    def wait_for_handles(self, deadline: Deadline) -> None:
        """Until every worker's actor is known: handed over, or announced by actors set up
        after the sender; raise naming the missing workers at ``deadline``."""
        while True:
            self.take_announcements(deadline)
            missing = [w for w in range(self.num_workers) if w not in self.handles]
            if not missing:
                return
            if deadline.expired():
                raise WeightSyncTimeoutError(
                    f"no actor for worker(s) {missing} within {deadline}: pass the "
                    "handles to create_sender(workers) or register_workers(), or create the "
                    "actors (weightsync_setup) after the sender", worker_ids=missing,
                )
            time.sleep(deadline.slice(0.05))

    def where(self, worker_idx: int) -> str:
        """Where worker ``worker_idx``'s actor runs, for messages."""
        node = self.nodes.get(worker_idx)
        return "node unknown" if node is None else f"node {node[:12]}"

    def answers(self, refs: Mapping[int, Any], timeout: float | None) -> Answers:
        return collect_answers(self._ray, refs, timeout)

    def drop(self, worker_idx: int, local: NodeLocalSender | None) -> None:
        """The actor of ``worker_idx`` died: forget it (a replacement announces itself)."""
        if local is not None:
            local.detach(worker_idx)
        self.members.pop(worker_idx, None)
        self.handles.pop(worker_idx, None)
        self.followers.pop(worker_idx, None)
        self.connected.discard(worker_idx)

    # ------------------------------------------------------------------ group
    def relays_of(self, worker_idx: int) -> list[int]:
        """The followers that copy from ``worker_idx`` (none: it relays to nobody)."""
        return [f for f, r in self.followers.items() if r == worker_idx]

    def build(self, layout: Layout, local: NodeLocalSender | None, timeout_s: float,
              deadline: Deadline, relay: bool = False) -> tuple[Losses, Losses]:
        """A new group generation with every live worker that answers in time (a worker
        silent before is tried again); returns the (dead, silent) workers left out."""
        candidates = dict(sorted(self.handles.items()))
        layout_dict = layout.to_dict()
        checked = self.answers({w: h._weightsync_check.remote(layout_dict)
                                for w, h in candidates.items()}, share(deadline, CHECK_SHARE))
        for w, err in checked.errors.items():
            if isinstance(err, SchemaMismatchError):
                raise SchemaMismatchError(f"worker {w}: {err}", key=err.key,
                                          expected=err.expected, got=err.got) from err
            raise WeightSyncError(f"worker {w} failed its layout check: {err}") from err
        dead, silent = dict(checked.dead), dict(checked.silent)
        self.nodes.update({w: n for w, n in checked.values.items() if isinstance(n, str)})
        candidates = {w: h for w, h in candidates.items() if w in checked.values}
        on_node = self._attach_local(local, candidates, dead, silent, deadline)
        candidates = {w: h for w, h in candidates.items() if w not in dead and w not in silent}
        remote = [w for w in candidates if w not in on_node]
        followers = _followers(remote, checked.values) if relay else {}
        remote = [w for w in remote if w not in followers]
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(
                self.address, 0, None, True,
                timeout=datetime.timedelta(seconds=self._store_timeout),
                wait_for_workers=False,
            )
        self._generation += 1
        info = GroupInfo(
            address=self.address, port=int(self._store.port),
            world_size=len(remote) + self.trainer_ranks,
            generation=self._generation, backend=self.backend,
            ranks={w: r + self.trainer_ranks for r, w in enumerate(remote)}, timeout_s=timeout_s,
            secret=self.secret, nonce=secrets.token_hex(16),
        )
        public = asdict(info) | {"secret": ""}  # the rendezvous actor never holds the token
        self._ray.get(self.rendezvous.set_group.remote(public, layout_dict),
                      timeout=deadline.remaining())
        refs = {w: (h._weightsync_join.remote(asdict(info), layout_dict, {"followers": fs})
                    if (fs := [f for f, r in followers.items() if r == w])
                    else h._weightsync_join.remote(asdict(info), layout_dict))
                for w, h in candidates.items() if w not in followers}
        try:
            self.group = WeightGroup(info, 0, store=self._store, host=self.address)
        except (RuntimeError, IntegrityError) as exc:  # someone never joined: who?
            self.group = None
            joined = self.answers(refs, deadline.remaining())
            failed = {w: f"could not join the group: {e}" for w, e in joined.errors.items()}
            failed |= joined.dead | joined.silent
            raise WorkerLostError(
                f"group generation {info.generation} could not be built ({exc}); "
                + "; ".join(f"worker {w}: {why}" for w, why in sorted(failed.items())),
                worker_ids=list(failed) or remote,
            ) from exc
        joined = self.answers(refs, deadline.remaining())
        if followers:
            joined = self._join_followers(candidates, followers, joined, asdict(info),
                                          layout_dict, deadline)
        dead |= joined.dead
        silent |= joined.silent
        silent |= {w: f"failed to join: {e}" for w, e in joined.errors.items()}
        self.members = {w: h for w, h in candidates.items() if w in joined.values}
        self.followers = {f: r for f, r in followers.items() if f in self.members}
        self.connected.update(self.members)
        self.reported.difference_update(self.members)
        return dead, silent

    def _join_followers(self, handles: Mapping[int, Any], followers: Mapping[int, int],
                        joined: Answers, info: dict[str, Any], layout: dict[str, Any],
                        deadline: Deadline) -> Answers:
        """Point each follower at its relay's shared memory (once the relay joined), then
        let it learn the layout; adds the outcomes to ``joined``."""
        offers = {f: handles[f]._weightsync_attach.remote(joined.values[r] | {"relay": True})
                  for f, r in followers.items() if isinstance(joined.values.get(r), dict)}
        for f, r in followers.items():
            if f not in offers:
                joined.silent[f] = f"its node's relay, worker {r}, did not join"
        attached = self.answers(offers, share(deadline, CHECK_SHARE))
        joined.dead |= attached.dead
        joined.silent |= attached.silent
        for f, ok in attached.values.items():
            if not ok:
                joined.silent[f] = f"cannot open the shared memory of worker {followers[f]}"
        refs = {f: handles[f]._weightsync_join.remote(info, layout)
                for f, ok in attached.values.items() if ok}
        learned = self.answers(refs, deadline.remaining())
        joined.values |= learned.values
        joined.dead |= learned.dead
        joined.silent |= learned.silent
        joined.errors |= {f: e for f, e in (attached.errors | learned.errors).items()}
        return joined

    def _attach_local(self, local: NodeLocalSender | None, handles: Mapping[int, Any],
                      dead: Losses, silent: Losses, deadline: Deadline) -> set[int]:
        """Offer the node-local path to every actor; returns those on this node that can open
        the shared segments, which take versions from there instead of the broadcast."""
        if local is None:
            return set()
        info = asdict(local.info)
        answers = self.answers({w: h._weightsync_attach.remote(info) for w, h in handles.items()},
                               share(deadline, CHECK_SHARE))
        dead |= answers.dead
        silent |= answers.silent | {w: f"attach failed: {e}" for w, e in answers.errors.items()}
        on_node = set()
        for w, handle in handles.items():
            if answers.values.get(w):
                on_node.add(w)
                if self._local_handles.get(w) is not handle:  # a new actor
                    local.detach(w)
                local.attach(w)
                self._local_handles[w] = handle
            else:
                local.detach(w)
        if on_node:
            logger.info("worker(s) %s share this node: they copy from shared memory",
                        sorted(on_node))
        return on_node

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._store = None
        try:
            self._ray.kill(self.rendezvous)
        except Exception as exc:  # Ray already shut down: nothing left to kill
            logger.debug("rendezvous actor not killed: %s", exc)


def actor_id(handle: Any) -> str | None:
    """The Ray actor id behind ``handle`` (an actor handle, or a wrapper that holds one as
    ``actor``, as TorchRL's collectors), or None if it names none."""
    ident = getattr(handle, "_actor_id", None)
    if ident is None:
        ident = getattr(getattr(handle, "actor", None), "_actor_id", None)
    if ident is None:
        return None
    return str(ident.hex()) if hasattr(ident, "hex") else str(ident)


def same_actor(a: Any, b: Any) -> bool:
    """Whether two handles name the same Ray actor (the rendezvous hands back a copy of a
    handle, never the object the trainer was given)."""
    if a is b:
        return True
    ident = actor_id(a)
    return ident is not None and ident == actor_id(b)


def _followers(remote: list[int], nodes: Mapping[int, Any]) -> dict[int, int]:
    """On every node other than the trainer's that holds several of ``remote`` (by the node
    id each actor's layout check returned), the first one relays to the others:
    ``{follower: relay}``."""
    here = current_node_id()
    by_node: dict[str, list[int]] = {}
    for w in remote:
        node = nodes.get(w)
        if isinstance(node, str) and node != here:
            by_node.setdefault(node, []).append(w)
    return {f: group[0] for group in by_node.values() for f in group[1:]}
