"""MPTransport used as the seed documents it: a weight queue and an ack queue."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from weightsync import MPTransport, TransportBackend


def queue_worker(weight_queue, ack_queue, out):
    model = torch.nn.Linear(3, 2)
    transport = MPTransport(weight_queue, ack_queue, timeout=10)
    transport.setup_connection_and_weights_on_receiver(worker_idx=0, model=model)
    out.put(float(model.weight.sum()))
    transport.receive_weights(model=model)
    out.put(float(model.weight.sum()))


def test_is_a_transport_backend():
    q = mp.get_context("fork").Queue()
    assert isinstance(MPTransport(q), TransportBackend)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_queues_weights_then_ack(method):
    ctx = mp.get_context(method)
    weight_queue, ack_queue, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=queue_worker, args=(weight_queue, ack_queue, out), daemon=True)
    proc.start()
    try:
        transport = MPTransport(weight_queue, ack_queue, timeout=30)
        weights = {"weight": torch.ones(2, 3), "bias": torch.zeros(2)}
        transport.send_weights(weights)  # blocks until acked
        assert out.get(timeout=30) == 6.0
        transport.send_weights_async({"weight": torch.full((2, 3), 2.0), "bias": torch.zeros(2)})
        with pytest.raises(RuntimeError, match="pending"):
            transport.send_weights_async(weights)
        transport.wait_ack()
        assert out.get(timeout=30) == 12.0
        with pytest.raises(RuntimeError, match="no send is pending"):
            transport.wait_ack()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
