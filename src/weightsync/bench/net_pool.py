"""``weightsync bench --transports net-pool``: ``NetWeightSyncScheme`` over a pool of hosts
(``bench.pool_network``: each host a network namespace with its own /dev/shm and /tmp, the
trainer behind one uplink capped at each rate), one worker per host, an fp32 model sent as
bf16 whole chunks. Per number of hosts: the time until every host holds a version (what
``send()`` waits for) against one host's, the bytes that crossed the trainer's link
against the version's, and, for a host that restarts, the bytes its join took from the
trainer. Beside them, the same run's floors: the version's bytes at the link's rate, and a
memcpy of them."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weightsync.bench.floors import memcpy_floor
from weightsync.bench.local import make_model
from weightsync.bench.multihost import parse_link_rate
from weightsync.bench.pool_network import TRAINER_ADDRESS, HostPool, host_pool
from weightsync.bench.rows import BenchRow, make_row
from weightsync.units import format_duration

#: the longest any one step of the bench may take (a join, a send)
STEP_S = 300.0


@dataclass
class PoolCase:
    """One pool's outcome: seconds until every host held each version, and the trainer's
    link bytes of each, as a ratio to the version's; what a restarted host's join took."""

    hosts: int
    rate: str
    times: list[float] = field(default_factory=list)
    link_ratios: list[float] = field(default_factory=list)
    join_ratio: float | None = None


class _Workers:
    """One worker process per host of ``pool``, each in its host's namespaces."""

    def __init__(self, pool: HostPool, scheme: object, nbytes: int, folder: Path) -> None:
        self.pool, self.nbytes, self.folder = pool, nbytes, folder
        self.pickled = folder / "scheme.pkl"
        self.pickled.write_bytes(pickle.dumps(scheme))
        self.stop_file = folder / "stop"
        self.procs = [self.start(i) for i in range(pool.hosts)]  # /tmp is private there

    def start(self, index: int) -> subprocess.Popen[bytes]:
        script = ("mount -t tmpfs tmpfs /dev/shm && mount -t tmpfs tmpfs /tmp && exec "
                  f"{sys.executable} -m weightsync.bench.net_pool_worker {self.pickled} "
                  f"{index} {self.nbytes} {self.stop_file}")
        with open(self.folder / f"host{index}.log", "ab") as log:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.pool.host_ns(index), "unshare", "--mount",
                 "--propagation", "private", "sh", "-c", script],
                start_new_session=True, stdout=subprocess.DEVNULL, stderr=log)

    def logs(self) -> str:
        """The end of what each host's worker wrote to stderr (to say why one failed)."""
        return "; ".join(f"{p.name}: {p.read_text(errors='replace')[-800:]}"
                         for p in sorted(self.folder.glob("host*.log")))

    def restart(self, index: int) -> None:
        """Kill host ``index``'s worker and start it again on a host with empty memory."""
        self.kill(self.procs[index])
        self.procs[index] = self.start(index)

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def close(self) -> None:
        self.stop_file.touch()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill(proc)


@contextlib.contextmanager
def _pool(hosts: int, rate: str) -> Iterator[HostPool]:
    with host_pool(hosts) as pool:
        pool.shape_uplink(rate)
        pool.enter_trainer()
        yield pool


def _wait(done: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + STEP_S
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(f"pool bench: {what} within {STEP_S:g} s")
        time.sleep(0.05)


def measure_pool(nbytes: int, hosts: int, rate: str, repeats: int) -> PoolCase:
    """Sends to ``hosts`` hosts (one worker each) behind a ``rate`` uplink, then one join."""
    import weightsync as ws

    case = PoolCase(hosts, rate)
    model = make_model(nbytes)
    version_bytes = sum(p.numel() for p in model.parameters()) * 2  # bf16 on the wire
    with _pool(hosts, rate) as pool, tempfile.TemporaryDirectory(prefix="ws-pool-", dir="/var/tmp") as tmp:
        scheme = ws.NetWeightSyncScheme(num_workers=hosts, address=f"{TRAINER_ADDRESS}:0",
                                        dtype=torch.bfloat16, timeout=STEP_S)
        workers = _Workers(pool, scheme, nbytes, Path(tmp))
        try:
            with scheme.create_sender() as sender:
                sender.register_model(model)
                try:
                    sender.connect(timeout=STEP_S)
                except ws.WeightSyncError as exc:
                    raise RuntimeError(f"pool bench: {exc}; the workers said: "
                                       f"{workers.logs()}") from exc
                for step in range(repeats + 1):  # the first: hosts learn of each other
                    with torch.no_grad():
                        for p in model.parameters():
                            p.add_(1e-3)
                    started = time.perf_counter()
                    sender.send(timeout=STEP_S)
                    seconds = time.perf_counter() - started
                    if step:
                        case.times.append(seconds)
                        case.link_ratios.append(sender.stats()["last"]["wire_bytes"] / version_bytes)
                if hosts > 1:
                    before = sender.stats()["last"]["wire_bytes"]
                    workers.restart(hosts - 1)
                    _wait(lambda: sender.worker_lag().get(hosts - 1) == 0,
                          "the restarted host did not take the current version")
                    after = sender.stats()["last"]["wire_bytes"]
                    case.join_ratio = (after - before) / version_bytes
        finally:
            workers.close()
    return case


def run_pool_bench(size: str, nbytes: int, host_counts: Sequence[int], link_rates: Sequence[str],
                   repeats: int, progress: Callable[[str], None]) -> tuple[list[BenchRow], str]:
    """Every host count at every link rate: the rows (floor: the version at the link's rate)
    and a table of the ratios the issue asks for."""
    rows: list[BenchRow] = []
    lines = ["| uplink | hosts | every host holds it | x one host | trainer link bytes "
             "x version | join: trainer bytes x version | floor: version at link rate | "
             "memcpy |", "|" + "---|" * 8]
    version_bytes = sum(p.numel() for p in make_model(nbytes).parameters()) * 2
    memcpy = memcpy_floor(version_bytes)
    for rate in link_rates:
        link_s = version_bytes * 8 / parse_link_rate(rate)
        one: float | None = None
        for hosts in host_counts:
            progress(f"net-pool {size}, {hosts} hosts, uplink {rate}")
            case = measure_pool(nbytes, hosts, rate, repeats)
            median = statistics.median(case.times)
            one = median if hosts == 1 or one is None else one
            rows.append(make_row(f"net-pool {rate}", size, version_bytes, hosts, case.times,
                                 link_s, "link"))
            join = "-" if case.join_ratio is None else f"{case.join_ratio:.2f}"
            lines.append(f"| {rate} | {hosts} | {format_duration(median)} | {median / one:.2f} "
                         f"| {statistics.median(case.link_ratios):.2f} | {join} | "
                         f"{format_duration(link_s)} | {format_duration(memcpy)} |")
    return rows, "\n".join(lines)
