"""The test side of worker hosts (network namespaces, each with its own /dev/shm and /tmp)
that run ``net_host_workers.py``: start and stop them, read what their workers reported,
and the model steps and checksums the tests compare."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import weightsync as ws

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
Reports = dict[int, list[list]]


@contextlib.contextmanager
def report_dir(prefix: str) -> Iterator[Path]:
    """A folder the hosts' workers report into (under /var/tmp: each host has a /tmp of
    its own); its ``stop`` file ends them, and it is removed after."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    try:
        yield path
    finally:
        (path / "stop").touch()
        shutil.rmtree(path, ignore_errors=True)


class HostWorkers:
    """Worker processes on one host: ``ip netns exec`` + a private mount namespace."""

    def __init__(self, ns: str, scheme: ws.NetWeightSyncScheme, out_dir: Path,
                 indices: list[int], env: dict[str, str] | None = None) -> None:
        pickled = out_dir / f"scheme-{ns}.pkl"
        pickled.write_bytes(pickle.dumps(scheme))
        script = ("mount -t tmpfs tmpfs /dev/shm && mount -t tmpfs tmpfs /tmp && exec "
                  + " ".join([sys.executable, str(TESTS / "net_host_workers.py"), str(pickled),
                              str(out_dir), *map(str, indices)]))
        env = os.environ | (env or {}) | {"PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}
        with open(out_dir / f"{ns}.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private",
                 "sh", "-c", script], env=env, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def reports(out_dir: Path) -> Reports:
    found: Reports = {}
    for path in out_dir.glob("worker*"):
        idx = int(path.name.removeprefix("worker"))
        found[idx] = [json.loads(line) for line in path.read_text().splitlines() if line]
    return found


def host_logs(out_dir: Path) -> dict[str, str]:
    """The end of what each host's workers wrote to stderr (to say why a test failed)."""
    return {p.name: p.read_text(errors="replace")[-2000:] for p in out_dir.glob("*.log")}


def held_locks(pids: list[int]) -> list[str]:
    """The file locks these processes hold (``/proc/locks``: kind, mode, pid, inode), to
    say which worker held what when a host-mate waited too long."""
    wanted = {str(p) for p in pids}
    with open("/proc/locks", encoding="ascii") as f:
        return [line.strip() for line in f if len(line.split()) > 4 and line.split()[4] in wanted]


def wait_reports(out_dir: Path, done: Callable[[Reports], bool], timeout: float = 60) -> Reports:
    end = time.monotonic() + timeout
    while True:
        got = reports(out_dir)
        if done(got):
            return got
        if time.monotonic() > end:
            raise AssertionError(f"workers did not report in {timeout} s: {got}; "
                                 f"logs: {host_logs(out_dir)}")
        time.sleep(0.05)


def holds(version: int, workers: list[int]) -> Callable[[Reports], bool]:
    return lambda got: all(any(r[0] == "version" and r[2] == version for r in got.get(w, []))
                           for w in workers)


def checksums_of(got: Reports, version: int) -> dict[int, float]:
    return {w: r[3] for w, lines in got.items() for r in lines
            if r[0] == "version" and r[2] == version}


def bf16_checksum(model: torch.nn.Module) -> float:
    return float(sum(t.detach().to(torch.bfloat16).double().sum()
                     for t in model.state_dict().values()))


def step(model: torch.nn.Module, seed: int) -> None:
    """A small optimizer-like step: most bf16 words stay, some change."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for t in model.parameters():
            t.add_(torch.randn_like(t) * 1e-3 * (torch.rand_like(t) < 0.2))
