"""A sharded trainer's ranks (Megatron-style ``LocalShard`` blocks, real processes) killed
or stopped mid-write, restarted, disagreeing on the layout, and sending as fast as they
can: workers only ever hold whole versions, and every rank's error names the rank."""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time

import pytest
import torch
from rank_harness import BlockModel, BlockRanks

import weightsync as ws

pytestmark = pytest.mark.timeout(120)


def uniform_version(model: BlockModel) -> float:
    """The one value every element holds (a version), or fail on a mix."""
    values = torch.cat([model.w.detach().flatten(), model.b.detach().flatten()]).unique()
    assert values.numel() == 1, f"a torn version: values {values.tolist()[:8]}"
    return float(values.item())


def connect_workers(scheme, n, **kwargs):
    receivers, models = [], []
    for i in range(n):
        receiver = scheme.create_receiver(i, **kwargs) if i == 0 else \
            scheme.create_receiver(i, zero_copy=True)
        model = BlockModel()
        receiver.register_model(model)
        receivers.append(receiver)
        models.append(model)
    threads = [threading.Thread(target=r.connect, kwargs={"timeout": 60}, daemon=True)
               for r in receivers]
    for t in threads:
        t.start()
    return receivers, models, threads


def expect(ranks, rank, kind, timeout=60.0):
    got = ranks.next(rank, timeout)
    assert got[0] == kind, got
    return got


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_rank_lost_mid_write_commits_nothing_and_is_named_then_rejoins(how):
    world = 3
    scheme = ws.SharedMemWeightSyncScheme(num_workers=2, trainer_ranks=world, timeout=60)
    receivers, models, threads = connect_workers(scheme, 2)
    ranks = BlockRanks(scheme, world)
    try:
        for r in range(world):
            assert expect(ranks, r, "connected")[2] == 0
        for t in threads:
            t.join(30)
        assert [r.version for r in receivers] == [0, 0]
        ranks.tell(2, "kill_mid_write" if how == "kill" else "stop_mid_write")
        started = time.monotonic()
        ranks.tell(0, "send", 4.0)
        ranks.tell(1, "send", 4.0)
        for r in (0, 1):
            got = expect(ranks, r, "error", timeout=30)
            assert got[2] == "TrainerRankLostError" and got[4] == 2, got
            assert "rank 2" in got[3], got
        assert time.monotonic() - started < 10.0
        for receiver, model in zip(receivers, models, strict=True):
            assert receiver.poll() is None  # nothing was committed
            assert receiver.version == 0 and uniform_version(model) == 0.0
        if how == "kill":
            ranks.procs[2].join(10)
            ranks.start(2, first_value=1.0)  # a restarted rank joins the next version
            ranks.tell(0, "send", 60.0)
            ranks.tell(1, "send", 60.0)
            assert expect(ranks, 2, "connected")[2] == 1
        else:
            os.kill(ranks.procs[2].pid, signal.SIGCONT)
            assert expect(ranks, 2, "error")[2] == "TrainerRankLostError"  # it hears why
            ranks.tell_all("send", 60.0)
            assert expect(ranks, 2, "version")[2] == 1
        for r in (0, 1):
            assert expect(ranks, r, "version")[2] == 1
        for receiver, model in zip(receivers, models, strict=True):
            assert receiver.receive(timeout=30) == 1
            assert uniform_version(model) == 1.0
        ranks.tell_all("send", 60.0)  # and the next version too, in slots made since
        for r in range(world):
            assert expect(ranks, r, "version")[2] == 2
        for receiver, model in zip(receivers, models, strict=True):
            assert receiver.receive(timeout=30) == 2
            assert uniform_version(model) == 2.0
    finally:
        for receiver in receivers:
            receiver.close()
        ranks.close()


def test_ranks_that_disagree_on_the_layout_are_refused_naming_rank_and_key():
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=2, timeout=30)
    ranks = BlockRanks.__new__(BlockRanks)
    BlockRanks.__init__(ranks, scheme, 0)  # no rank yet
    ranks.world = 2
    try:
        ranks.start(0)
        ranks.start(1, rows=8)  # another global shape of "w"
        for r in (0, 1):
            got = expect(ranks, r, "crash")
            assert got[2] == "SchemaMismatchError", got
            assert "rank 1" in got[3] and "'w'" in got[3], got
    finally:
        ranks.close()


@pytest.mark.parametrize("zero_copy", [False, True])
def test_tear_free_while_ranks_send_as_fast_as_they_can(zero_copy):
    """One worker in this process (``fcntl`` slot locks are per process: two receivers in
    one process would release each other's), polling while two ranks race."""
    world, sends = 2, 40
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=world, timeout=60,
                                          zero_copy=zero_copy)
    receiver = scheme.create_receiver(0)
    model = BlockModel()
    receiver.register_model(model)
    receivers, models = [receiver], [model]
    threads = [threading.Thread(target=receiver.connect, kwargs={"timeout": 60}, daemon=True)]
    threads[0].start()
    ranks = BlockRanks(scheme, world)
    stop = threading.Event()
    seen: list[list[int]] = [[]]
    errors: list[BaseException] = []

    def watch(i):
        try:
            while not stop.is_set():
                version = receivers[i].poll()
                if version is not None:
                    assert uniform_version(models[i]) == float(version)
                    seen[i].append(version)
        except BaseException as exc:
            errors.append(exc)

    try:
        for r in range(world):
            expect(ranks, r, "connected")
        for t in threads:
            t.join(30)
        watchers = [threading.Thread(target=watch, args=(0,), daemon=True)]
        for t in watchers:
            t.start()
        ranks.tell_all("hammer", sends)
        for r in range(world):
            for v in range(1, sends + 1):
                assert expect(ranks, r, "version")[2] == v
        time.sleep(0.2)
        stop.set()
        for t in watchers:
            t.join(10)
        assert not errors, errors
        for i in range(1):
            assert seen[i] and seen[i] == sorted(set(seen[i]))
            receivers[i].receive(timeout=10)
            assert uniform_version(models[i]) == float(sends)
    finally:
        stop.set()
        for receiver in receivers:
            receiver.close()
        ranks.close()


def test_a_worker_cannot_write_the_slots_the_ranks_write():
    """Slots are handed to the ranks before they are sealed: a worker gets them sealed."""
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=2, timeout=60)
    receivers, _models, threads = connect_workers(scheme, 1)
    ranks = BlockRanks(scheme, 2)
    try:
        for r in range(2):
            expect(ranks, r, "connected")
        for t in threads:
            t.join(30)
        slots = receivers[0].reader.slots._models["policy"].slots
        assert slots
        for slot in slots.values():
            fd = slot.segments["cpu"].fd
            with pytest.raises(PermissionError):
                mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED,
                          prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"\x01", 0)
    finally:
        for receiver in receivers:
            receiver.close()
        ranks.close()
