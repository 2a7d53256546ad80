"""Delta updates across hosts, timed: an fp32 model sent as bf16 after one AdamW step to
actors on another host of a two-host Ray cluster (two network namespaces, see
``multihost``), the full broadcast against ``delta=True``, beside one memcpy of the bf16
version measured in the same run. Reports the fraction of bf16 words the step left
unchanged and the bytes that crossed the network."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync.bench.floors import memcpy_floor
from weightsync.bench.local import make_model
from weightsync.bench.rows import BenchRow, make_row, percentile
from weightsync.units import format_duration

BF16 = torch.bfloat16
#: the "realistic" RL step (AdamW at lr 1e-6..1e-5) and one that changes every word
SMALL_LR, LARGE_LR = 2e-6, 1e-2


@dataclass
class DeltaCase:
    """One configuration's outcome: seconds until every remote actor held each version,
    and what crossed the network for it."""

    mode: str  # "full" or "delta"
    update: str  # "AdamW lr=..." or "everything changed"
    actors: int
    times: list[float] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    delta_chunks: int = 0
    chunks: int = 0
    unchanged: list[float] = field(default_factory=list)


def _actor_class() -> Any:
    import ray

    from weightsync.integrations.ray import RayWeightReceiverMixin

    @ray.remote(num_cpus=0)
    class DeltaBenchActor(RayWeightReceiverMixin):
        def __init__(self, scheme: Any, idx: int, nbytes: int) -> None:
            torch.set_num_threads(1)
            self.weightsync_setup(scheme, idx, make_model(nbytes).to(BF16), announce=False)

        def apply(self) -> int:
            self.weightsync_receiver.poll()
            return self.weightsync_receiver.version

    return DeltaBenchActor


def _trainer_model(nbytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """fp32 masters initialised as a transformer's (N(0, 0.02)) and their AdamW."""
    torch.manual_seed(0)
    model = make_model(nbytes)
    for p in model.parameters():
        p.requires_grad_(True)
        with torch.no_grad():
            p.normal_(0.0, 0.02)
    return model, torch.optim.AdamW(model.parameters(), lr=SMALL_LR, weight_decay=0.0)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float) -> None:
    """One AdamW step on gradient noise (what Adam makes of any gradient: ~lr per weight)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _unchanged(before: list[torch.Tensor], model: torch.nn.Module) -> float:
    same = total = 0
    for old, p in zip(before, model.parameters(), strict=True):
        same += int((old.view(torch.int16) == p.detach().to(BF16).view(torch.int16)).sum())
        total += old.numel()
    return same / max(total, 1)


def _run_case(cluster: Any, case: DeltaCase, nbytes: int, repeats: int, lr: float) -> None:
    import ray

    from weightsync.schemes.ray import RayWeightSyncScheme

    scheme = RayWeightSyncScheme(num_workers=case.actors, timeout=300, dtype=BF16,
                                 delta=case.mode == "delta")
    actor_cls = _actor_class()
    actors = [actor_cls.options(**cluster.on("b")).remote(scheme, i, nbytes)
              for i in range(case.actors)]
    model, optimizer = _trainer_model(nbytes)
    try:
        with scheme.create_sender(actors) as sender:
            sender.register_model(model)
            sender.connect(timeout=300)
            ray.get([a.apply.remote() for a in actors], timeout=300)
            for i in range(repeats + 1):
                before = [p.detach().to(BF16) for p in model.parameters()]
                _step(model, optimizer, lr)
                unchanged = _unchanged(before, model)
                del before
                t0 = time.perf_counter()
                sender.send(timeout=300)
                ray.get([a.apply.remote() for a in actors], timeout=300)
                elapsed = time.perf_counter() - t0
                if i:  # the first warms buffers and connections
                    last = sender.stats()["last"]
                    case.times.append(elapsed)
                    case.wire_bytes.append(int(last["wire_bytes"]))
                    case.delta_chunks += int(last["delta_chunks"])
                    case.chunks += int(last["chunks"])
                    case.unchanged.append(unchanged)
    finally:
        for actor in actors:
            ray.kill(actor)


def run_delta_bench(
    size: str, nbytes: int, actor_counts: Sequence[int], repeats: int,
    progress: Callable[[str], None] | None = None, link_rate: str | None = None,
) -> tuple[list[BenchRow], str]:
    """Rows (until every actor on host B held the version, against one memcpy of the bf16
    version) and the delta table, for full and delta sends of a small AdamW step and of an
    everything-changed one, with each number of actors on the other host. ``link_rate``
    (tc syntax, ``10gbit``) caps the link between the hosts, which otherwise runs at
    memory speed: what a delta saves only shows on a link slower than its codec."""
    from weightsync.bench.multihost import parse_link_rate, two_host_cluster, unavailable_reason

    if link_rate is not None:
        parse_link_rate(link_rate)  # a typo fails before the cluster is built

    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the two-host cluster cannot be built here: {reason}")
    package_dir = str(Path(__file__).resolve().parents[2])  # actors import this weightsync
    cases = []
    with two_host_cluster(package_dir) as cluster:
        if link_rate is not None:
            cluster.shape_link(link_rate)
        for update, lr in ((f"AdamW lr={SMALL_LR:g}", SMALL_LR), ("everything changed", LARGE_LR)):
            counts = actor_counts if lr == SMALL_LR else actor_counts[:1]
            for n in counts:
                for mode in ("full", "delta"):
                    if progress:
                        progress(f"ray {mode} {update} {size} x{n} on host B")
                    case = DeltaCase(mode, update, n)
                    _run_case(cluster, case, nbytes, repeats, lr)
                    cases.append(case)
        if link_rate is not None:
            cluster.unshape_link()
    bf16_bytes = nbytes // 2
    floor = memcpy_floor(bf16_bytes)
    link = f", link {link_rate}" if link_rate else ""
    rows = [make_row(f"ray {c.mode} bf16 ({c.update}{link}) until held on host B", size, bf16_bytes,
                     c.actors, c.times, floor) for c in cases]
    return rows, delta_table(cases, bf16_bytes, floor)


def delta_table(cases: Sequence[DeltaCase], bf16_bytes: int, floor: float) -> str:
    """Markdown: per case, unchanged words, wire bytes, delta chunks and time, each delta
    beside the full broadcast of the same update and actor count."""
    full = {(c.update, c.actors): statistics.median(c.times) for c in cases if c.mode == "full"}
    lines = ["| update | actors on B | mode | unchanged bf16 words | wire bytes (of bf16 version) "
             "| delta chunks | until held: median | p90 | x full | x memcpy |",
             "|" + "---|" * 10]
    for c in cases:
        median = statistics.median(c.times)
        wire = statistics.median(c.wire_bytes)
        lines.append(
            f"| {c.update} | {c.actors} | {c.mode} | {100 * statistics.median(c.unchanged):.2f}% "
            f"| {wire / 1e6:.1f} MB ({100 * wire / bf16_bytes:.1f}%) | {c.delta_chunks}/{c.chunks} "
            f"| {format_duration(median)} | {format_duration(percentile(c.times, 0.9))} "
            f"| {median / full[(c.update, c.actors)]:.2f} | {median / floor:.1f} |")
    lines.append(f"\nmemcpy of the bf16 version ({bf16_bytes / 1e6:.0f} MB): "
                 f"{format_duration(floor)}")
    return "\n".join(lines)
