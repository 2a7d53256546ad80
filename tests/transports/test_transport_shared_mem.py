"""SharedMemTransport used as the seed documents it: pipes, lazy registration, model ids."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch

from weightsync import SharedMemTransport, TransportBackend


def seed_worker(pipe, out, width):
    model = torch.nn.Linear(width, 2)
    transport = SharedMemTransport()
    transport.register_pipe(pipe)
    weights = transport.setup_connection_and_weights_on_receiver(worker_idx=0, model=model)
    out.put(("initial", float(model.weight.sum()), sorted(weights.keys())))
    while True:
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            got = transport.receive_weights(timeout=5.0, model=model)  # never blocks
            time.sleep(0.001)
        if got is None:
            out.put(("timeout",))
            return
        out.put(("update", float(model.weight.sum())))
        if float(model.weight.sum()) < 0:
            return


def test_is_a_transport_backend():
    assert isinstance(SharedMemTransport(), TransportBackend)


def test_lazy_registration_worker_starts_before_any_weights():
    ctx = mp.get_context("fork")
    parent, child = mp.Pipe(duplex=True)
    out = ctx.Queue()
    proc = ctx.Process(target=seed_worker, args=(child, out, 3), daemon=True)
    proc.start()  # the worker waits: no weights exist yet
    transport = SharedMemTransport()
    transport.register_pipe(parent)
    try:
        with pytest.raises(queue.Empty):
            out.get(timeout=0.3)
        weights = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
        transport.send_weights("policy", weights)  # first send: creates and passes segments
        assert out.get(timeout=10) == ("initial", 6.0, ["bias", "weight"])
        weights["weight"].fill_(2.0)
        transport.send_weights("policy", weights)
        assert out.get(timeout=10) == ("update", 12.0)
        transport.send_weights("policy", {"weight": -torch.ones(2, 3), "bias": torch.zeros(2)})
        assert out.get(timeout=10) == ("update", -6.0)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        transport.close()


def test_a_receiver_learns_that_the_sender_closed():
    """The standalone flow: ``sender_closed()`` turns True once the sender closes."""
    ours, theirs = mp.Pipe(duplex=True)
    sender, receiver = SharedMemTransport(), SharedMemTransport()
    sender.register_pipe(ours)
    receiver.register_pipe(theirs)
    try:
        sender.send_weights("policy", {"w": torch.ones(3)})
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(3))
        receiver.setup_connection_and_weights_on_receiver(worker_idx=0, model=model, timeout=10)
        assert float(model.w.detach().sum()) == 3.0 and not receiver.sender_closed()
        sender.close()
        assert receiver.sender_closed()
    finally:
        sender.close()
        receiver.close()


def test_auto_register_false_requires_registration():
    transport = SharedMemTransport(auto_register=False)
    with pytest.raises(KeyError, match="register"):
        transport.send_weights("policy", {"w": torch.zeros(2)})
    transport.register_weights("policy", {"w": torch.zeros(2)})
    assert transport.send_weights("policy", {"w": torch.ones(2)}) == 1
    transport.close()


def test_unsupported_weights_type_raises_value_error():
    transport = SharedMemTransport()
    with pytest.raises(ValueError, match="expected"):
        transport.send_weights("policy", [torch.zeros(2)])
    transport.close()


def test_policy_weights_in_constructor_registers_them():
    transport = SharedMemTransport(policy_weights={"policy": {"w": torch.arange(4.0)}})
    layout = transport.layout("policy")
    assert layout is not None and layout.names == ("w",)
    transport.close()


def test_register_pipe_refuses_one_way_pipes():
    r, _w = mp.Pipe(duplex=False)
    with pytest.raises(TypeError, match="duplex"):
        SharedMemTransport().register_pipe(r)
