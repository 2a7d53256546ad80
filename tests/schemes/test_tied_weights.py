"""Tied weights (an LLM's embedding and ``lm_head``) in every same-host scheme and the
directory: packed once, the tie kept on the worker, and a tie on one side only refused
with both keys named (before, the worker's embedding silently took ``lm_head``'s values)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from workers import drain

import weightsync as ws
from weightsync.core.layout import Layout

VOCAB, DIM = 256, 64


class TinyLM(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def fill(model: TinyLM, embed: float, head: float) -> None:
    with torch.no_grad():
        model.embed.weight.fill_(embed)
        model.head.weight.fill_(head)  # the same tensor when tied: the last fill wins


def report(model: TinyLM) -> tuple[float, float, bool]:
    return (float(model.embed.weight[0, 0]), float(model.head.weight[0, 0]),
            model.embed.weight.data_ptr() == model.head.weight.data_ptr())


def tied_worker(scheme, idx, out, stop, tied):
    model = TinyLM(tied)
    receiver = scheme.create_receiver(idx)
    receiver.register_model(model)
    try:
        receiver.connect(timeout=30)
    except ws.SchemaMismatchError as exc:
        out.put(("mismatch", idx, exc.key, str(exc)))
        receiver.close()
        return
    out.put(("connected", idx, receiver.version, *report(model)))
    version = receiver.receive(timeout=30)
    out.put(("version", idx, version, *report(model)))
    stop.wait(30)
    receiver.close()


def directory_scheme(tmp_path, **kwargs):
    return ws.VLLMDoubleBufferSyncScheme(tmp_path / "weights", **kwargs)


SCHEMES = {
    "shm": ws.SharedMemWeightSyncScheme,
    "shm-zero-copy": lambda **kw: ws.SharedMemWeightSyncScheme(zero_copy=True, **kw),
    "mp": ws.MultiProcessWeightSyncScheme,
}


@pytest.fixture(params=[*sorted(SCHEMES), "dir"])
def make_scheme(request, tmp_path):
    if request.param == "dir":
        return lambda **kw: directory_scheme(tmp_path, **kw)
    return SCHEMES[request.param]


def test_layout_keeps_a_tied_tensor_once_and_says_so():
    tied, untied = Layout.from_weights(TinyLM(True).state_dict()), Layout.from_weights(
        TinyLM(False).state_dict())
    assert tied.ties == {"head.weight": "embed.weight"} and untied.ties == {}
    assert "head.weight" not in tied.names
    assert untied.nbytes - tied.nbytes == VOCAB * DIM * 4
    assert Layout.from_dict(tied.to_dict()) == tied and tied.fingerprint != untied.fingerprint
    with pytest.raises(ws.SchemaMismatchError, match="'head.weight' and 'embed.weight'") as exc:
        tied.check_compatible(untied)
    assert exc.value.key == "head.weight"
    with pytest.raises(ws.SchemaMismatchError, match="tied to 'embed.weight'"):
        tied.check_weights({k: v.clone() for k, v in TinyLM(True).state_dict().items()})


def test_tied_on_both_sides_arrives_once_and_stays_tied(make_scheme, workers):
    scheme = make_scheme(num_workers=1, timeout=30)
    workers.start(tied_worker, scheme, 0, True)
    model = TinyLM(True)
    fill(model, 1.0, 2.0)
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        assert sender.layout.nbytes < (VOCAB * DIM + 4 * DIM) * 4  # the tied tensor once
        assert drain(workers.out, 1)[0][2:] == (0, 2.0, 2.0, True)
        fill(model, 3.0, 5.0)
        assert sender.send(timeout=30) == 1
        assert drain(workers.out, 1)[0][2:] == (1, 5.0, 5.0, True)


@pytest.mark.parametrize("trainer_tied", [False, True])
def test_a_tie_on_one_side_only_is_refused_naming_both_keys(make_scheme, workers, trainer_tied):
    scheme = make_scheme(num_workers=1, timeout=20)
    workers.start(tied_worker, scheme, 0, not trainer_tied)
    model = TinyLM(trainer_tied)
    fill(model, 1.0, 2.0)
    sender = scheme.create_sender()
    try:
        sender.register_model(model)
        # the trainer may or may not hear of it (the directory's waits for an ack never
        # given): the worker's refusal is the promise
        with contextlib.suppress(ws.SchemaMismatchError, ws.WorkerLostError,
                                 ws.WeightSyncTimeoutError):
            sender.connect(timeout=5)
        (kind, _idx, key, message), = drain(workers.out, 1)
        assert (kind, key) == ("mismatch", "head.weight")
        assert "'head.weight' and 'embed.weight'" in message
    finally:
        sender.close()
