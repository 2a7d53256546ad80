"""A version is read while it is being packed: a SharedMem worker in copy mode copies each
piece as the trainer packs it, a MultiProcess streamer writes each piece to its socket;
neither ever hands a worker a torn version, even when the pack fails or stalls half-way.

Each test slows the trainer's pack after its first piece until the reader is provably
reading (it holds the slot's shared lock, or the first bytes arrived), so the overlap is
exercised deterministically, whatever the machine's load."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
import torch

from weightsync.core.deadline import Deadline
from weightsync.core.layout import Layout
from weightsync.transports.local.channel import Channel, ChannelClosed
from weightsync.transports.memory.pieces import PIECE_BYTES, PiecePlan
from weightsync.transports.mp import streams as multiprocess_streams
from weightsync.transports.mp.snapshots import as_bytes
from weightsync.transports.mp.streams import SnapshotPool, Streamer
from weightsync.transports.shm.slots import _IDX_LATEST, _lock, _unlock, _unpack_target
from weightsync.transports.shm.transport import SharedMemTransport

#: 3 tensors of 12 MB: several pieces each
SHAPES = {"a": (3_000_000,), "b": (1000, 3000), "c": (3_000_000,)}


def weights_at(value: float) -> dict[str, torch.Tensor]:
    return {name: torch.full(shape, value) for name, shape in SHAPES.items()}


def held_value(dest: dict[str, torch.Tensor]) -> float | None:
    """The version every weight holds, or None if they disagree (a torn version)."""
    values = torch.cat([t.reshape(-1) for t in dest.values()])
    low, high = float(values.min()), float(values.max())
    return low if low == high else None


def slow_down(plan: PiecePlan, after_first_piece) -> None:
    """Make ``plan.pack`` call ``after_first_piece()`` once its first piece is packed."""
    original = plan.pack

    def pack(weights, buffers, advance, views=None):
        pieces = 0

        def step(watermark: int) -> None:
            nonlocal pieces
            advance(watermark)
            pieces += 1
            if pieces == 1:
                after_first_piece()

        original(weights, buffers, step, views)

    plan.pack = pack  # type: ignore[method-assign]


def copying_worker(pipe, out, stop) -> None:
    """Copy mode, polling: report each version taken and whether it was whole."""
    transport = SharedMemTransport()
    transport.register_pipe(pipe)
    dest = weights_at(-1.0)
    transport.setup_connection_and_weights_on_receiver(worker_idx=0, weights=dest, timeout=30)
    out.put(("held", held_value(dest)))
    while not stop.is_set():
        if transport.receive_weights(timeout=0.0, weights=dest) is not None:
            out.put(("held", held_value(dest)))
        time.sleep(0.001)
    transport.close()


def wait_until_read(transport: SharedMemTransport) -> None:
    """Until the worker holds the shared lock of the newest slot (it follows the pack)."""
    model = transport.publisher._models["policy"]
    index = _unpack_target(model.ctrl[_IDX_LATEST])[1]
    deadline = time.monotonic() + 30
    while _lock(model.control.fd, index, exclusive=True):
        _unlock(model.control.fd, index)
        assert time.monotonic() < deadline, "the worker never started copying the slot"
        time.sleep(0.001)


@pytest.fixture
def copying_worker_pair():
    ctx = mp.get_context("fork")
    parent, child = mp.Pipe(duplex=True)
    out, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=copying_worker, args=(child, out, stop), daemon=True)
    proc.start()
    transport = SharedMemTransport()
    transport.register_pipe(parent)
    transport.send_weights("policy", weights_at(0.0))
    assert out.get(timeout=30) == ("held", 0.0)
    assert transport.publisher._models["policy"].plan.in_pieces
    yield transport, out
    stop.set()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    transport.close()


def test_a_copying_worker_follows_the_pack_and_holds_the_whole_version(copying_worker_pair):
    transport, out = copying_worker_pair
    slow_down(transport.publisher._models["policy"].plan, lambda: wait_until_read(transport))
    transport.send_weights("policy", weights_at(1.0))
    assert out.get(timeout=30) == ("held", 1.0)


def test_a_pack_that_fails_half_way_leaves_the_worker_a_whole_version(copying_worker_pair):
    transport, out = copying_worker_pair

    def fail() -> None:
        wait_until_read(transport)
        raise RuntimeError("the trainer's pack broke")

    model = transport.publisher._models["policy"]
    original = model.plan.pack
    slow_down(model.plan, fail)
    with pytest.raises(RuntimeError, match="pack broke"):
        transport.send_weights("policy", weights_at(1.0))
    assert _unpack_target(model.target(0))[0] == 0  # pointed back at the whole version 0
    model.plan.pack = original  # type: ignore[method-assign]
    transport.send_weights("policy", weights_at(2.0), version=2)
    # a worker that had copied part of version 1 copied version 0 back, whole
    seen = [out.get(timeout=30)]
    while seen[-1] != ("held", 2.0):
        seen.append(out.get(timeout=30))
    assert all(value in (0.0, 2.0) for _, value in seen), seen


def test_a_pack_that_stalls_is_given_up_with_a_whole_version(copying_worker_pair):
    from weightsync.transports.shm import apply as shm_apply

    transport, out = copying_worker_pair

    def stall() -> None:
        wait_until_read(transport)
        time.sleep(shm_apply.STALL_S * 4)  # the worker gives up and restores version 0

    slow_down(transport.publisher._models["policy"].plan, stall)
    transport.send_weights("policy", weights_at(1.0))
    seen = [out.get(timeout=30)]
    while seen[-1] != ("held", 1.0):
        seen.append(out.get(timeout=30))
    assert all(value in (0.0, 1.0) for _, value in seen), seen  # never torn


# ---------------------------------------------------------------------- MultiProcess
def read_frame_in_two(channel: Channel, nbytes: int, first_bytes_in: threading.Event,
                      got: dict) -> None:
    try:
        layout_message = channel.recv(timeout=30)
        message = channel.recv_header(timeout=30)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        view = as_bytes(buffer)
        channel.recv_payload_into(view[:PIECE_BYTES], timeout=30)
        first_bytes_in.set()
        channel.recv_payload_into(view[PIECE_BYTES:], timeout=30)
        got.update(layout=layout_message.header["t"], header=message.header, buffer=buffer)
    except ChannelClosed as exc:
        got["closed"] = str(exc)
        first_bytes_in.set()


@pytest.fixture
def socket_only(monkeypatch):
    """Streamers that carry the bytes on the socket (where no page-mapping pipe can be
    made): the tests below read the socket itself."""
    monkeypatch.setattr(multiprocess_streams.PipeWriter, "open", classmethod(lambda cls: None))


def streamer_pair():
    layout = Layout.from_weights(weights_at(0.0))
    pool = SnapshotPool(layout, 3)
    ours, theirs = Channel.pair()
    failures: list[str] = []
    streamer = Streamer(0, ours, pool, 30.0, lambda idx, ch, why: failures.append(why))
    first_bytes_in, got = threading.Event(), {}
    reader = threading.Thread(target=read_frame_in_two,
                              args=(theirs, layout.nbytes, first_bytes_in, got), daemon=True)
    reader.start()
    return layout, pool, streamer, reader, first_bytes_in, got, failures, (ours, theirs)


def test_a_streamer_writes_pieces_while_the_snapshot_is_packed(socket_only):
    layout, pool, streamer, reader, first_bytes_in, got, failures, ends = streamer_pair()
    original = PiecePlan.pack

    def pack(plan, weights, buffers, advance, views=None):
        pieces = 0

        def step(watermark: int) -> None:
            nonlocal pieces
            advance(watermark)
            pieces += 1
            if pieces == 2:  # the first piece must already be in the reader's buffer
                assert first_bytes_in.wait(30), "nothing was streamed before the pack ended"

        original(plan, weights, buffers, step, views)

    try:
        PiecePlan.pack = pack  # type: ignore[method-assign]
        pool.fill(weights_at(5.0), 5, Deadline(30), on_started=lambda: streamer.offer(5))
    finally:
        PiecePlan.pack = original  # type: ignore[method-assign]
    reader.join(30)
    assert got["header"]["v"] == 5 and not failures
    received = layout.tensor_views({"cpu": got["buffer"]})
    assert all(bool((t == 5.0).all()) for t in received.values())
    streamer.stop()
    for end in ends:
        end.close()


def test_a_pack_that_fails_mid_stream_breaks_the_stream_and_keeps_the_old_snapshot(socket_only):
    _, pool, streamer, reader, first_bytes_in, got, failures, ends = streamer_pair()
    pool.fill(weights_at(1.0), 1, Deadline(30))
    before = pool.latest
    original = PiecePlan.pack

    def pack(plan, weights, buffers, advance, views=None):
        def step(watermark: int) -> None:
            advance(watermark)
            assert first_bytes_in.wait(30)
            raise RuntimeError("the trainer's pack broke")

        original(plan, weights, buffers, step, views)

    try:
        PiecePlan.pack = pack  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="pack broke"):
            pool.fill(weights_at(2.0), 2, Deadline(30), on_started=lambda: streamer.offer(2))
    finally:
        PiecePlan.pack = original  # type: ignore[method-assign]
    reader.join(30)
    assert "closed" in got and "buffer" not in got  # the receiver never got a whole frame
    deadline = time.monotonic() + 30
    while not failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert failures and "version 2" in failures[0]
    assert pool.latest is before and pool.latest.version == 1
    streamer.stop()
    for end in ends:
        end.close()


# ---------------------------------------------------------------------- the schemes
@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero-copy"])
def test_hammer_on_a_model_packed_in_pieces_never_reads_a_torn_version(workers, zero_copy):
    """Workers poll in a tight loop while 17 MB versions (several pieces each) are sent back
    to back: each read finds every tensor at the version the worker holds."""
    from workers import fill_all, hammer_worker, make_model

    import weightsync as ws

    width = 300_000
    scheme = ws.SharedMemWeightSyncScheme(num_workers=2, timeout=60, zero_copy=zero_copy)
    for idx in range(2):
        workers.start(hammer_worker, scheme, idx, width)
    model = make_model(width)
    assert PiecePlan(Layout.from_weights(dict(model.state_dict()))).in_pieces
    fill_all(model, 0.0)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=60)
    for version in range(1, 41):
        fill_all(model, float(version))
        assert sender.send(timeout=60) == version
    deadline = time.monotonic() + 30
    while max(sender.worker_lag().values(), default=1) > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    workers.stop.set()
    results = [workers.out.get(timeout=60) for _ in range(2)]
    for _, idx, reads, violations, applied, first_bad, final in results:
        assert violations == 0, f"worker {idx}: torn read {first_bad} ({violations}/{reads})"
        assert applied >= 1 and final == 40
    sender.close()


def count_frames(channel: Channel, frames: list[int]) -> None:
    """Read weights frames until the channel ends; record each one's version."""
    try:
        while True:
            message = channel.recv(timeout=30)
            if message.header.get("t") == "mp.weights":
                frames.append(int(message.header["v"]))
    except (ChannelClosed, TimeoutError):
        return


def test_an_offer_whose_pack_failed_is_dropped_not_replaced_by_a_resend(socket_only):
    layout = Layout.from_weights(weights_at(0.0))
    pool = SnapshotPool(layout, 3)
    ours, theirs = Channel.pair()
    streamer = Streamer(0, ours, pool, 30.0, lambda idx, ch, why: None)
    frames: list[int] = []
    reader = threading.Thread(target=count_frames, args=(theirs, frames), daemon=True)
    reader.start()
    pool.fill(weights_at(1.0), 1, Deadline(30), on_started=lambda: streamer.offer(1))
    original = PiecePlan.pack

    def broken(plan, weights, buffers, advance, views=None):
        raise RuntimeError("the trainer's pack broke")

    try:
        PiecePlan.pack = broken  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="pack broke"):
            pool.fill(weights_at(2.0), 2, Deadline(30))
    finally:
        PiecePlan.pack = original  # type: ignore[method-assign]
    streamer.offer(2)  # e.g. delivered although its pack failed: the newest is version 1
    deadline = time.monotonic() + 30
    while (streamer._wanted_version, streamer._sent_version) != (1, 1):
        assert time.monotonic() < deadline, (streamer._wanted_version, streamer._sent_version)
        time.sleep(0.01)
    streamer.stop()
    ours.close()
    reader.join(30)
    assert frames == [1]  # version 1 once, never sent again in place of version 2
    theirs.close()
