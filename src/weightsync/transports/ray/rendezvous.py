"""The Ray scheme's rendezvous: a named actor on the trainer's node that receivers find by
name. It holds the group's public connection info (never the token) and the handles of
actors that announced themselves; it dies with the trainer's node, which is how receivers
learn that their sender is gone."""

from __future__ import annotations

from typing import Any

from weightsync.transports.ray.group import current_node_id


class Rendezvous:
    """The named Ray actor's state: connection info, layout, announcements."""

    def __init__(self) -> None:
        self.info: dict[str, Any] | None = None
        self.layout: dict[str, Any] | None = None
        self.announced: dict[int, Any] = {}

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


def start_rendezvous(name: str) -> Any:
    """The rendezvous actor ``name``, pinned to this process's node: it answers while that
    node lives and dies with it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(current_node_id(), soft=False)
    return ray.remote(num_cpus=0)(Rendezvous).options(
        name=name, scheduling_strategy=here,
    ).remote()
