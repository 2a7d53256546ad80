"""``NetWeightSyncScheme`` over a pool of hosts (``bench.pool_network``): six worker
hosts (four in the failure tests) and the trainer on one switch, each host a network
namespace with a private /dev/shm and /tmp, the trainer behind a 250 Mb/s uplink. Each
version must cross the trainer's link about once (hosts relay it, along a chain or a
tree), exactly, and a relay that dies or stalls mid-version must be named alone while
every other host gets the version from elsewhere. On the code before relays, every host
fetched from the trainer: a version's bytes per host per send."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from net_host_workers import make_model
from net_hosts import HostWorkers, bf16_checksum, checksums_of, holds, report_dir, reports, step, wait_reports

import weightsync as ws
from weightsync.bench.pool_network import TRAINER_ADDRESS, HostPool, host_pool
from weightsync.transports.net import relay

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]

POOL_HOSTS = 6  # the exact test's
HOSTS = 4  # the failure tests
WIDTH = 2896  # about 17 MB in bf16: three chunks, 0.5 s over the trainer's 250 Mb/s
ENV = {"WS_NET_WIDTH": str(WIDTH)}


@pytest.fixture(scope="module")
def pool() -> Iterator[HostPool]:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "tc", "unshare", "mount")):
        pytest.skip("a pool of hosts needs root and the ip, tc, unshare and mount commands")
    with host_pool(POOL_HOSTS) as made:
        made.shape_uplink("250mbit")
        made.enter_trainer()
        yield made


@pytest.fixture
def out_dir() -> Iterator[Path]:
    with report_dir("ws-net-relay-") as path:
        yield path


@contextlib.contextmanager
def pool_session(pool: HostPool, out_dir: Path, hosts: int = HOSTS, env: dict[str, str] = ENV,
                 **options: Any) -> Iterator[tuple[ws.WeightSender, torch.nn.Module,
                                                    list[HostWorkers]]]:
    """A trainer (this process) and one worker on each of ``hosts`` hosts, connected, all
    holding version 0; ``options`` go to the scheme (bf16 on the wire, a 60 s timeout)."""
    scheme = ws.NetWeightSyncScheme(num_workers=hosts, address=f"{TRAINER_ADDRESS}:0",
                                    dtype=torch.bfloat16, timeout=60, **options)
    workers = [HostWorkers(pool.host_ns(i), scheme, out_dir, [i], env=env) for i in range(hosts)]
    model = make_model(WIDTH)
    try:
        with scheme.create_sender() as sender:
            sender.register_model(model)
            sender.connect(timeout=90)
            wait_reports(out_dir, holds(0, list(range(hosts))))
            yield sender, model, workers
    finally:
        (out_dir / "stop").touch()
        for w in workers:
            w.stop()


def relayed(last: dict[str, Any]) -> dict[int, str]:
    """Per worker (one per host here), whom its host fetched from: "trainer" or the worker
    whose host relayed it."""
    worker_of = {host: seen["workers"][0] for host, seen in last["fetched_from"].items()
                 if seen["workers"]}
    return {seen["workers"][0]: seen["from"] if seen["from"] == "trainer"
            else f"worker {worker_of.get(seen['from'], '?')}"
            for seen in last["fetched_from"].values() if seen["workers"]}


def test_each_version_crosses_the_trainers_link_about_once_exactly(pool, out_dir, monkeypatch):
    """Six hosts, full versions then deltas, along a chain (what a 3-chunk version gets)
    and then along a tree of fan-out 2 (what many hosts and a small version get)."""
    everyone = list(range(POOL_HOSTS))
    with pool_session(pool, out_dir, hosts=POOL_HOSTS, delta=True) as (sender, model, _):
        for seed in (1, 2, 3, 4):
            if seed == 3:
                monkeypatch.setattr(relay, "FAN_OUTS", (2,))
            step(model, seed)
            version = sender.send(timeout=60)
            last = sender.stats()["last"]
            got = wait_reports(out_dir, holds(version, everyone))
            assert checksums_of(got, version) == dict.fromkeys(everyone, bf16_checksum(model))
            # one host fetched from the trainer, each other one from another host
            assert last["hosts"] == 1, last
            sources = relayed(last)
            assert sorted(sources) == everyone, last
            assert list(sources.values()).count("trainer") == 1, sources
            if seed > 1:  # every host held the version before: deltas, hop by hop too
                assert last["delta_chunks"] >= 1, last
            fed = [s for s in sources.values() if s != "trainer"]
            # a chain: each relay feeds one host; a tree: a relay feeds two
            assert max(fed.count(s) for s in fed) == (1 if seed < 3 else 2), sources


def _relay_and_below(sender: ws.WeightSender) -> tuple[int, list[int]]:
    """A host that relayed the last version to another (its worker), and the workers of
    the hosts that fetched from it."""
    sources = relayed(sender.stats()["last"])
    relays = {int(s.removeprefix("worker ")) for s in sources.values() if s != "trainer"}
    relay = min(relays)
    return relay, [w for w, s in sources.items() if s == f"worker {relay}"]


@pytest.mark.parametrize("fault", ["killed", "stalled"])
def test_a_relay_lost_mid_version_is_named_alone_and_the_others_hold_it(pool, out_dir, fault):
    everyone = list(range(HOSTS))
    with pool_session(pool, out_dir) as (sender, model, _):
        version_bytes = sender.stats()["last"]["nbytes"] // 2  # bf16 on the wire
        step(model, 1)
        sender.send(timeout=60)
        # whole chunks (no delta): about one version's bytes left the trainer, not four
        assert sender.stats()["last"]["wire_bytes"] < 1.5 * version_bytes
        relay, below = _relay_and_below(sender)
        assert below, sender.stats()["last"]
        pid = next(r[2] for r in reports(out_dir)[relay] if r[0] == "pid")
        step(model, 2)
        # the version takes about 0.5 s to leave the trainer: the relay goes mid-way
        hit = threading.Timer(0.25, os.kill, (pid, signal.SIGKILL if fault == "killed"
                                              else signal.SIGSTOP))
        hit.start()
        started = time.monotonic()
        expected = ws.WorkerLostError if fault == "killed" else ws.WeightSyncTimeoutError
        try:
            with pytest.raises(expected) as lost:
                sender.send(timeout=25)
            assert lost.value.worker_ids == (relay,), (str(lost.value), relay)
            assert time.monotonic() - started < 30
            others = [w for w in everyone if w != relay]
            got = wait_reports(out_dir, holds(2, others))
            assert checksums_of(got, 2) == {w: bf16_checksum(model) for w in others}
        finally:
            hit.join()
            if fault == "stalled":
                os.kill(pid, signal.SIGCONT)
        assert set(below) <= set(others)


def test_a_restarted_host_takes_the_current_version_from_its_peers(pool, out_dir):
    everyone = list(range(HOSTS))
    with pool_session(pool, out_dir) as (sender, model, workers):
        version_bytes = sender.stats()["last"]["nbytes"] // 2  # bf16 on the wire
        step(model, 1)
        version = sender.send(timeout=60)
        wait_reports(out_dir, holds(version, everyone))
        before = sender.stats()["last"]["wire_bytes"]
        restarted = HOSTS - 1
        workers[restarted].stop()  # its host comes back with empty shared memory
        (out_dir / f"worker{restarted}").unlink()
        workers[restarted] = HostWorkers(pool.host_ns(restarted), sender.scheme, out_dir,
                                         [restarted], env=ENV)
        got = wait_reports(out_dir, holds(version, [restarted]))
        assert checksums_of(got, version)[restarted] == bf16_checksum(model)
        last = sender.stats()["last"]
        # what the trainer's link carried for the join: its peers sent the version
        assert last["wire_bytes"] - before <= 0.3 * version_bytes, (last, before)
        assert relayed(last)[restarted].startswith("worker "), last
        step(model, 2)  # and it takes part in the next version as any host
        version = sender.send(timeout=60)
        got = wait_reports(out_dir, holds(version, everyone))
        assert checksums_of(got, version) == dict.fromkeys(everyone, bf16_checksum(model))


def test_a_relay_that_changes_a_chunk_is_refused_and_every_host_holds_it_exactly(
        pool, out_dir):
    """Every host's relay forges what it forwards (a checksum and a MAC recomputed over the
    changed bytes): each host refuses it against the trainer's digest and fetches from the
    trainer; all hold the version exactly."""
    forging = ENV | {"WS_TAMPER_RELAY": "1"}
    with pool_session(pool, out_dir, hosts=3, env=forging) as (sender, model, _):
        step(model, 1)
        version = sender.send(timeout=60)
        got = wait_reports(out_dir, holds(version, [0, 1, 2]))
        assert checksums_of(got, version) == dict.fromkeys([0, 1, 2], bf16_checksum(model))
        assert set(relayed(sender.stats()["last"]).values()) == {"trainer"}
