"""MPTransport used as TorchRL does (a weight queue and an ack queue), and the
MultiProcess scheme's data path: bytes through a page-mapping pipe or the socket, and only
whole versions staged when the trainer dies mid-transfer."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import select
import signal
import time

import pytest
import torch
from stopped import stop_process
from workers import checksum, drain, echo_worker, fill_all, make_model

import weightsync as ws
from weightsync import MPTransport, TransportBackend
from weightsync.core.deadline import Deadline
from weightsync.transports.local.channel import ChannelClosed
from weightsync.transports.mp import pipe as mp_pipe
from weightsync.transports.mp import streams as multiprocess_streams
from weightsync.transports.mp.pipe import PipeReader, PipeWriter


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


# ------------------------------------------------ the scheme's data path: pipe or socket
WIDE = 400_000  # ~22 MB of weights: packed and streamed in several pieces, through a pipe


def _pipes_work() -> bool:
    opened = PipeWriter.open()
    if opened is None:
        return False
    opened[0].close()
    os.close(opened[1])
    return True


@pytest.mark.parametrize(("path", "method"), [("pipe", "fork"), ("pipe", "spawn"), ("socket", "fork")])
def test_every_version_arrives_whole_by_either_path(workers, monkeypatch, path, method):
    if path == "pipe" and not _pipes_work():
        pytest.skip("no page-mapping pipes on this platform")
    if path == "socket":  # as where no such pipe can be made
        monkeypatch.setattr(multiprocess_streams.PipeWriter, "open", classmethod(lambda cls: None))
    scheme = ws.MultiProcessWeightSyncScheme(num_workers=2, timeout=30)
    for i in range(2):
        workers.start(echo_worker, scheme, i, WIDE, method=method)
    model = make_model(WIDE)
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        drain(workers.out, 2, timeout=60)
        assert sender.writer.transfer_paths() == {0: path, 1: path}
        for value in (1.0, 2.0, 3.0):
            fill_all(model, value)
            version = sender.send(timeout=30)
            got = drain(workers.out, 2)
            assert {(m[0], m[2], m[3]) for m in got} == {("version", version, checksum(model))}


def test_small_versions_go_by_the_socket(workers):
    scheme = ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=30)
    workers.start(echo_worker, scheme, 0)
    model = make_model()
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        drain(workers.out, 1)
        assert sender.writer.transfer_paths() == {0: "socket"}
        fill_all(model, 5.0)
        version = sender.send(timeout=30)
        assert [(m[2], m[3]) for m in drain(workers.out, 1)] == [(version, checksum(model))]


def _payload(nbytes: int, value: int) -> torch.Tensor:
    return torch.full((nbytes,), value, dtype=torch.uint8)


def _write_then_die(writer: PipeWriter, data: torch.Tensor, nbytes: int, commit: bool) -> None:
    """In a forked trainer: map ``nbytes`` of ``data`` into the pipe, commit if asked, then
    die as a killed process does (no cleanup)."""
    writer.write(data.data_ptr(), nbytes, Deadline(20))
    if commit:
        writer.commit(7, Deadline(20))
    os.kill(os.getpid(), signal.SIGKILL)


def _pipe_from_dying_trainer(data: torch.Tensor, nbytes: int, commit: bool) -> tuple[PipeReader, object]:
    opened = PipeWriter.open()
    if opened is None:
        pytest.skip("no page-mapping pipes on this platform")
    writer, read_fd = opened
    proc = mp.get_context("fork").Process(target=_write_then_die, args=(writer, data, nbytes, commit),
                                          daemon=True)
    proc.start()
    writer.close()  # only the trainer holds the write end: its death ends the pipe
    return PipeReader(read_fd), proc


@pytest.mark.parametrize("commit", [False, True])
def test_a_payload_counts_only_with_its_trailer(commit):
    nbytes = 3 * mp_pipe.PIPE_BYTES + 12345  # more than the pipe holds: the reader must keep up
    data = _payload(nbytes, 42)
    reader, proc = _pipe_from_dying_trainer(data, nbytes, commit)
    try:
        into = torch.zeros(nbytes, dtype=torch.uint8)
        reader.read_into(memoryview(into.numpy()), Deadline(20))
        assert torch.equal(into, data)
        if commit:
            reader.read_commit(7, Deadline(20))
        else:
            with pytest.raises(ChannelClosed, match="mid-transfer"):
                reader.read_commit(7, Deadline(20))
    finally:
        reader.close()
        proc.join(20)
    assert proc.exitcode == -signal.SIGKILL


def test_a_trainer_killed_mid_payload_ends_the_read_with_an_error():
    nbytes = 4 * mp_pipe.PIPE_BYTES
    data = _payload(nbytes, 9)
    reader, proc = _pipe_from_dying_trainer(data, nbytes // 2, commit=False)
    try:
        into = torch.zeros(nbytes, dtype=torch.uint8)
        with pytest.raises(ChannelClosed, match="mid-transfer"):
            reader.read_into(memoryview(into.numpy()), Deadline(20))
    finally:
        reader.close()
        proc.join(20)


def _sending_trainer(scheme, out, width: int) -> None:
    """A trainer in its own process that sends versions (every weight = the version) until
    it is killed."""
    model = make_model(width)
    sender = scheme.create_sender()
    sender.register_model(model)
    sender.connect(timeout=30)
    out.put("connected")
    while True:
        fill_all(model, float(sender.version + 1))
        sender.send(timeout=30)


def test_a_trainer_killed_while_streaming_leaves_only_whole_versions():
    scheme = ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=30)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    trainer = ctx.Process(target=_sending_trainer, args=(scheme, out, WIDE), daemon=True)
    trainer.start()
    model = make_model(WIDE)
    receiver = scheme.create_receiver(worker_idx=0)
    receiver.register_model(model)
    try:
        receiver.connect(timeout=60)
        assert out.get(timeout=60) == "connected"
        applied = 0
        deadline = time.monotonic() + 60
        while applied < 5 and time.monotonic() < deadline:
            if receiver.receive(timeout=5) is not None:
                applied += 1
        assert applied == 5
        trainer.kill()  # most likely mid-transfer: the trainer sends back to back
        trainer.join(20)
        with pytest.raises(ws.SenderLostError):
            for _ in range(100):
                receiver.receive(timeout=0.2)
        values = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()
                            if t.is_floating_point()])
        assert torch.all(values == float(receiver.version)), "a version arrived in part"
    finally:
        receiver.close()
        if trainer.is_alive():
            trainer.kill()
            trainer.join(10)


def test_a_worker_stopped_mid_transfer_never_stages_the_reused_snapshot(workers):
    """The stopped worker's pipe still maps pages of a snapshot that is rewritten once its
    transfer is given up: resumed, the worker must stage nothing from them."""
    scheme = ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=30)
    workers.start(echo_worker, scheme, 0, WIDE)
    model = make_model(WIDE)
    expected = {}
    with scheme.create_sender() as sender:
        sender.register_model(model)
        sender.connect(timeout=60)
        expected[0] = checksum(model)
        drain(workers.out, 1)
        stop_process(workers.procs[0].pid)
        try:
            with pytest.raises((ws.WeightSyncTimeoutError, ws.WorkerLostError)):
                for value in range(1, 20):
                    fill_all(model, float(value))
                    expected[sender.version + 1] = checksum(model)
                    sender.send(timeout=1)
            for value in range(100, 104):  # rewrites every snapshot the worker's pipe maps
                fill_all(model, float(value))
                expected[sender.version + 1] = checksum(model)
                with contextlib.suppress(ws.WeightSyncError):  # reported once, then left out
                    sender.send(timeout=1)
        finally:
            os.kill(workers.procs[0].pid, signal.SIGCONT)
    reports = drain(workers.out, 1, timeout=30)  # the sender closed: the worker ends in an error
    while reports[-1][0] == "version":
        reports += drain(workers.out, 1, timeout=30)
    assert reports[-1][0] == "error", reports
    for _, _, version, total in reports[:-1]:
        assert total == expected[version], f"version {version} was staged torn"


def _lone_pipe_ends() -> int:
    """Pipes of which this process holds one end only (a worker's pipe is one: its read end
    goes to the worker; a queue's pipes show both ends)."""
    fds = f"/proc/{os.getpid()}/fd"
    links = []
    for fd in os.listdir(fds):
        with contextlib.suppress(OSError):
            links.append(os.readlink(os.path.join(fds, fd)))
    pipes = [link for link in links if link.startswith("pipe:")]
    return sum(1 for link in set(pipes) if pipes.count(link) == 1)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_closed_senders_leave_no_pipe_open(workers):
    counts = []
    for cycle in range(4):
        scheme = ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=30)
        workers.start(echo_worker, scheme, 0, WIDE)
        model = make_model(WIDE)
        with scheme.create_sender() as sender:
            sender.register_model(model)
            sender.connect(timeout=60)
            fill_all(model, float(cycle))
            sender.send(timeout=30)
        drain(workers.out, 3)  # connected, the version, then the error "the sender closed"
        workers.procs[0].join(30)
        counts.append(_lone_pipe_ends())
    assert counts[-1] <= counts[0], f"open pipes grew over the cycles: {counts}"


def _write_fork_then_die(writer: PipeWriter, data: torch.Tensor, nbytes: int,
                         pid_fd: int) -> None:
    """A trainer that maps part of a payload, forks a child that keeps the pipe open (and
    lives on), then dies: end-of-file never comes."""
    writer.write(data.data_ptr(), nbytes, Deadline(20))
    keeper = os.fork()
    if keeper == 0:
        time.sleep(120)
        os._exit(0)
    os.write(pid_fd, keeper.to_bytes(8, "little"))  # synchronous, unlike a Queue
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_dead_trainer_whose_fork_keeps_the_pipe_ends_the_read_within_ticks():
    from weightsync.core.liveness import process_dying

    opened = PipeWriter.open()
    if opened is None:
        pytest.skip("no page-mapping pipes on this platform")
    writer, read_fd = opened
    nbytes = 2 * mp_pipe.PIPE_BYTES
    data = _payload(nbytes, 3)
    pid_read, pid_write = os.pipe()
    trainer = mp.get_context("fork").Process(
        target=_write_fork_then_die, args=(writer, data, nbytes // 8, pid_write), daemon=True)
    trainer.start()
    writer.close()
    os.close(pid_write)
    assert select.select([pid_read], [], [], 30)[0], "the trainer never forked its keeper"
    keeper = int.from_bytes(os.read(pid_read, 8), "little")
    os.close(pid_read)
    reader = PipeReader(read_fd, lambda: not process_dying(trainer.pid))
    try:
        into = torch.zeros(nbytes, dtype=torch.uint8)
        started = time.monotonic()
        with pytest.raises(ChannelClosed, match="trainer died"):
            reader.read_into(memoryview(into.numpy()), Deadline(60))
        assert time.monotonic() - started < 30, "waited for the deadline, not the trainer"
    finally:
        reader.close()
        os.kill(keeper, signal.SIGKILL)
        trainer.join(20)
