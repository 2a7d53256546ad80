"""A sharded trainer (FSDP2 / tensor parallel over gloo, real processes) writes each
version into SharedMem's slots from every rank, with no gather; the workers hold the
gathered model after every send."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from rank_harness import TrainingRanks, tiny_model

import weightsync as ws

pytestmark = pytest.mark.timeout(180)


def connect_all(receivers, timeout=60.0):
    errors: list[BaseException] = []

    def run(receiver):
        try:
            receiver.connect(timeout=timeout)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in receivers]
    for t in threads:
        t.start()
    return threads, errors


def assert_holds(receiver, model, state, version):
    got = receiver.receive(timeout=30) if receiver.version < version else receiver.version
    assert receiver.version == version, (got, receiver.version, version)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("world", "how"), [(2, "fsdp"), (4, "fsdp"), (2, "tp")])
def test_workers_hold_the_gathered_model_after_every_send(world, how):
    scheme = ws.SharedMemWeightSyncScheme(num_workers=2, trainer_ranks=world, timeout=60)
    models = [tiny_model(how), tiny_model(how)]
    receivers = [scheme.create_receiver(0), scheme.create_receiver(1, zero_copy=True)]
    for receiver, model in zip(receivers, models, strict=True):
        receiver.register_model(model)
    ranks = TrainingRanks(scheme, world, how=how, steps=3)
    try:
        threads, errors = connect_all(receivers)
        first = ranks.next(0)
        assert first[0] == "version", first
        for t in threads:
            t.join(60)
        assert not errors, errors
        for r in range(1, world):
            assert ranks.next(r)[:3] == ("version", r, 0)
        for receiver, model in zip(receivers, models, strict=True):
            assert_holds(receiver, model, first[3], 0)
        for step in range(1, 4):
            ranks.step()
            got = ranks.next(0)
            assert got[:3] == ("version", 0, step), got
            for r in range(1, world):
                assert ranks.next(r)[:3] == ("version", r, step)
            for receiver, model in zip(receivers, models, strict=True):
                assert_holds(receiver, model, got[3], step)
    finally:
        for receiver in receivers:
            receiver.close()
        ranks.close()


def test_create_sender_checks_the_rank():
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=2)
    assert pickle.loads(pickle.dumps(scheme)).trainer_ranks == 2
    for bad in (2, -1, "0", True):
        with pytest.raises(ValueError, match=r"rank must be an int in 0\.\.1"):
            scheme.create_sender(rank=bad)
    with pytest.raises(ValueError, match=r"pass create_sender\(rank=r\)"):
        scheme.create_sender()  # no process group here to take the rank from
    with pytest.raises(ValueError, match="trainer_ranks"):
        ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=0)
    with pytest.raises(ValueError, match=r"0\.\.0"):
        ws.SharedMemWeightSyncScheme(num_workers=1).create_sender(rank=1)


def test_the_rank_key_stays_out_of_the_workers_copy():
    """The scheme's own pickle carries the rank key (every trainer process is handed the
    scheme, as the contract shows); scheme.for_workers() is the workers' copy, whose pickle
    leaves it out: a worker holding that cannot create a rank's sender."""
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=2)
    assert scheme.config.rank_key not in (scheme.token, "")
    as_rank = pickle.loads(pickle.dumps(scheme))
    assert as_rank.config.rank_key == scheme.config.rank_key
    as_worker = pickle.loads(pickle.dumps(scheme.for_workers()))
    assert as_worker.config.rank_key == "" and as_worker.token == scheme.token
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"for_workers\(\)"):
            as_worker.create_sender(rank=rank)
    with pytest.raises(ValueError, match="workers' copy"):
        as_worker.for_trainer_ranks()
    assert scheme.config.rank_key  # the scheme in this process keeps it
    with pytest.raises(ValueError, match="workers' copy"):  # not even in this process
        scheme.for_workers().for_trainer_ranks()
    again = pickle.loads(pickle.dumps(scheme.for_trainer_ranks()))
    assert again.config.rank_key == scheme.config.rank_key
    again.create_sender(rank=1).close()


def test_rank_0_refuses_a_process_that_proves_only_the_workers_token():
    from weightsync.core.deadline import Deadline
    from weightsync.transports.shm.ranks import SlotHub, slot_link

    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=2)
    c = scheme.config
    hub = SlotHub(c.address, c.rank_key, c.uid, 2).board
    hub.start()
    try:
        def ignore(*_args):
            raise AssertionError("no slot reaches a refused process")

        posing = slot_link(c.address, c.token, c.uid, 1, ignore, ignore)
        with pytest.raises(ws.TrainerRankLostError, match="could not join rank 0"):
            posing.open(Deadline(5))
        assert hub.hellos() == {} and not hub.connections
        real = slot_link(c.address, c.rank_key, c.uid, 1, ignore, ignore)
        real.open(Deadline(5))
        real.close()
    finally:
        hub.close()
