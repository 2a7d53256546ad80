"""``NetWeightSyncScheme`` across hosts: the trainer on host A (a network namespace), its
workers on host A and host B, each host its own mount namespace with a private /dev/shm
and /tmp (no file shared with the trainer or with each other). Workers report to their
own files; every wait has a timeout."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from net_host_workers import make_model
from net_hosts import (
    HostWorkers,
    bf16_checksum,
    checksums_of,
    held_locks,
    holds,
    host_logs,
    report_dir,
    reports,
    step,
    wait_reports,
)
from stopped import stop_process

import weightsync as ws
from weightsync.bench.multihost import ADDRESS_A, TwoHostCluster, two_host_network

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHostCluster]:
    if os.geteuid() != 0 or not all(shutil.which(tool) for tool in ("ip", "unshare", "mount")):
        pytest.skip("two hosts unavailable: needs root and the ip, unshare and mount commands")
    with two_host_network() as made:
        made.shape_link("1gbit")  # a datacenter link between the hosts, not a memory-speed veth
        made.enter("a")  # the trainer (this process) lives on host A
        yield made


@pytest.fixture
def out_dir() -> Iterator[Path]:
    with report_dir("ws-net-hosts-") as path:
        yield path


def test_two_hosts_three_workers_bf16_deltas_and_a_killed_worker(hosts, out_dir):
    scheme = ws.NetWeightSyncScheme(num_workers=3, address=f"{ADDRESS_A}:0",
                                    dtype=torch.bfloat16, delta=True, timeout=60)
    host_a = HostWorkers(hosts.ns_a, scheme, out_dir, [0])
    host_b = HostWorkers(hosts.ns_b, scheme, out_dir, [1, 2])
    model = make_model()
    try:
        with scheme.create_sender() as sender:
            sender.register_model(model)
            assert sender.connect(timeout=90) == 0
            got = wait_reports(out_dir, holds(0, [0, 1, 2]))
            assert set(checksums_of(got, 0).values()) == {bf16_checksum(model)}
            # one fetch per host (from the trainer, or from the other host if it held it)
            assert len(sender.stats()["last"]["fetched_from"]) == 2
            version_bytes = sender.stats()["last"]["nbytes"] // 2  # bf16 on the wire

            for seed in (1, 2, 3):
                step(model, seed)
                version = sender.send(timeout=60)
                last = sender.stats()["last"]
                # one host fetches from the trainer, the other from it (relayed); workers
                # 1 and 2 share host B's one fetch
                assert last["hosts"] == 1, last
                assert sorted(sorted(h["workers"]) for h in last["fetched_from"].values()) \
                    == [[0], [1, 2]], last
                assert sorted(h["from"] == "trainer" for h in last["fetched_from"].values()) \
                    == [False, True], last
                assert last["delta_chunks"] >= 1, last  # each host held the version before
                assert last["wire_bytes"] < 2 * version_bytes, last
                got = wait_reports(out_dir, holds(version, [0, 1, 2]))
                assert checksums_of(got, version) == dict.fromkeys([0, 1, 2], bf16_checksum(model))

            pid = next(r[2] for r in reports(out_dir)[2] if r[0] == "pid")
            os.kill(pid, signal.SIGKILL)
            step(model, 4)
            deadline = time.monotonic() + 30
            with pytest.raises(ws.WorkerLostError) as lost:
                while time.monotonic() < deadline:  # the loss is named at a send, at once
                    sender.send(timeout=30)
            assert lost.value.worker_ids == (2,)
            assert "worker 2" in str(lost.value)
            got = wait_reports(out_dir, holds(lost.value.version, [0, 1]))
            assert set(checksums_of(got, lost.value.version).values()) == {bf16_checksum(model)}
            step(model, 5)
            version = sender.send(worker_ids=[0, 1], timeout=30)  # the others go on
            wait_reports(out_dir, holds(version, [0, 1]))
    finally:
        (out_dir / "stop").touch()
        host_a.stop()
        host_b.stop()


def _trainer(scheme: ws.NetWeightSyncScheme, ready: str) -> None:
    model = make_model()
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=90)
    step(model, 1)
    sender.send(timeout=60)
    Path(ready + ".tmp").write_text(str(bf16_checksum(model)))
    os.replace(ready + ".tmp", ready)
    time.sleep(300)


def test_a_killed_trainer_is_sender_lost_on_every_host(hosts, out_dir):
    import multiprocessing as mp

    scheme = ws.NetWeightSyncScheme(num_workers=3, address=f"{ADDRESS_A}:0",
                                    dtype=torch.bfloat16, delta=True, timeout=60)
    host_a = HostWorkers(hosts.ns_a, scheme, out_dir, [0])
    host_b = HostWorkers(hosts.ns_b, scheme, out_dir, [1, 2])
    ready = out_dir / "trainer-ready"
    trainer = mp.get_context("fork").Process(target=_trainer, args=(scheme, str(ready)),
                                             daemon=True)  # forked on host A
    trainer.start()
    try:
        wait_reports(out_dir, lambda got: holds(1, [0, 1, 2])(got) and ready.exists(), timeout=90)
        expected = float(ready.read_text())
        trainer.kill()
        trainer.join(10)
        got = wait_reports(out_dir, lambda g: all(
            any(r[0] == "error" for r in g.get(w, [])) for w in (0, 1, 2)), timeout=30)
        for w in (0, 1, 2):
            error = next(r for r in got[w] if r[0] == "error")
            assert error[2] == "SenderLostError", error
            assert error[4] == 1 and error[5] == expected  # each keeps the version it held
    finally:
        if trainer.is_alive():
            trainer.kill()
        (out_dir / "stop").touch()
        host_a.stop()
        host_b.stop()


def test_a_stopped_worker_is_named_within_the_deadline_and_catches_up(hosts, out_dir):
    scheme = ws.NetWeightSyncScheme(num_workers=2, address=f"{ADDRESS_A}:0", timeout=60)
    host_b = HostWorkers(hosts.ns_b, scheme, out_dir, [0, 1])
    model = make_model()
    try:
        with scheme.create_sender() as sender:
            sender.register_model(model)
            sender.connect(timeout=90)
            wait_reports(out_dir, holds(0, [0, 1]))
            pids = [next(r[2] for r in reports(out_dir)[w] if r[0] == "pid") for w in (0, 1)]
            pid = pids[1]
            time.sleep(0.5)  # it stops idle, not inside its own staging of version 0
            stop_process(pid)  # alive, connected, silent (and holds no staging lock)
            try:
                step(model, 1)
                started = time.monotonic()
                with pytest.raises(ws.WeightSyncTimeoutError) as late:
                    # long enough for its host-mate's fetch on a loaded CI machine (3 s
                    # named both once), short beside the scheme's own 60 s
                    sender.send(timeout=10)
                assert late.value.worker_ids == (1,) and "worker(s) [1]" in str(late.value), \
                    (str(late.value), held_locks(pids), host_logs(out_dir))
                assert time.monotonic() - started < 14
                wait_reports(out_dir, holds(1, [0]))  # its host-mate got the version
            finally:
                os.kill(pid, signal.SIGCONT)
            step(model, 2)
            version = sender.send(timeout=30)
            got = wait_reports(out_dir, holds(version, [0, 1]))
            assert set(checksums_of(got, version).values()) == {
                float(sum(t.detach().double().sum() for t in model.state_dict().values()))}
    finally:
        (out_dir / "stop").touch()
        host_b.stop()
