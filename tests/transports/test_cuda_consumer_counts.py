"""Taking back the consumer counts a dead worker left on shared CUDA buffers.

The decision (which counts, whose) and the write into torch's refcounted shared-memory
file run without a GPU: the file is a real one, made by torch's own CPU sharing, which
uses the same refcounted layout as its CUDA IPC counters."""

from __future__ import annotations

import torch
import torch.multiprocessing as torch_mp

from weightsync.transports.memory.cuda_ipc import (
    ConsumerCount,
    counts_to_take_back,
    handle_fields,
    take_back,
)


def _torch_counter_file(values: list[int]) -> tuple[torch.Tensor, bytes]:
    """int64 counters in a shared-memory file torch made, and the file's handle."""
    strategy = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        counters = torch.tensor(values, dtype=torch.int64)
        counters.share_memory_()
        _manager, handle, _size = counters.untyped_storage()._share_filename_cpu_()
    finally:
        torch_mp.set_sharing_strategy(strategy)
    return counters, handle


def test_only_dead_workers_counts_are_taken_back_one_per_buffer_opened():
    a, b, c = ConsumerCount(b"/f", 0), ConsumerCount(b"/f", 1), ConsumerCount(b"/g", 0)
    opened = {0: {a, b}, 1: {a}, 2: {c}, 3: set()}
    assert counts_to_take_back(opened, dead={0, 2}) == [a, b, c]
    assert counts_to_take_back(opened, dead={0, 1}) == [a, b, a]  # two dead openers of a
    assert counts_to_take_back(opened, dead=set()) == []
    assert counts_to_take_back(opened, dead={7}) == []  # never opened anything


def test_take_back_decrements_torchs_own_counter_and_never_below_zero():
    counters, handle = _torch_counter_file([2, 1, 0, 5])
    counts = [ConsumerCount(handle, i) for i in (0, 1, 2)]
    assert take_back(counts) == 2  # the third was already zero
    # the tensor maps the same file: torch sees the counts taken back
    assert counters.tolist() == [1, 0, 0, 5]
    assert take_back([ConsumerCount(handle, 1)]) == 0
    assert counters.tolist() == [1, 0, 0, 5]


def test_take_back_skips_gone_files_and_refuses_paths():
    assert take_back([ConsumerCount(b"/torch_no_such_file", 0)]) == 0
    assert take_back([ConsumerCount(b"/../etc/passwd", 0)]) == 0
    counters, handle = _torch_counter_file([3])
    assert take_back([ConsumerCount(handle, 99)]) == 0  # beyond the file: untouched
    assert counters.tolist() == [3]


def test_consumer_count_is_read_from_the_typed_handle_fields():
    args = (torch.Tensor, (4096,), (1,), 0, torch.storage.UntypedStorage, torch.uint8, 0,
            b"h" * 64, 4096, 0, False, b"/torch_1_2_3", 17, b"", True)
    count = ConsumerCount.of(handle_fields(args))
    assert count == ConsumerCount(b"/torch_1_2_3", 17)
    assert count.path() == "/dev/shm/torch_1_2_3"


def test_the_sender_takes_back_only_what_a_dead_worker_recorded_and_a_clean_close_clears():
    """The control-block record between a worker and its sender, with a real counter file:
    slots a worker recorded as open are taken back once when it is detached; a worker that
    closed cleanly cleared its record first, so nothing is taken back for it."""
    import os

    from weightsync.core.layout import Layout
    from weightsync.transports.shm import slots as shm_slots
    from weightsync.transports.shm import worker_slots

    counters, handle = _torch_counter_file([2, 2, 2])  # 2 consumers on each of 3 slots
    layout = Layout.from_weights({"w": torch.zeros(4)})
    sender = shm_slots._SenderModel(layout, max_slots=4)
    sender.cuda_counts = {i: {ConsumerCount(handle, i)} for i in range(3)}
    acks = sender.acks[0], sender.acks[1] = shm_slots._Ack(), shm_slots._Ack()
    dying = worker_slots._ReceiverModel(layout, os.dup(sender.control.fd), os.dup(acks[0].segment.fd))
    leaving = worker_slots._ReceiverModel(layout, os.dup(sender.control.fd), os.dup(acks[1].segment.fd))
    try:
        dying._opened_bits = 0b011  # slots 0 and 1 mapped by worker 0
        dying.record_opened(0)
        leaving._opened_bits = 0b110  # slots 1 and 2 mapped by worker 1
        leaving.record_opened(1)
        leaving.forget_opened()  # clean close: its own release gives the counts back
        assert sender.take_back_opened(1) == 0
        assert sender.take_back_opened(0) == 2  # worker 0 died holding slots 0 and 1
        assert counters.tolist() == [1, 1, 2]
        assert sender.take_back_opened(0) == 0  # once only
        assert counters.tolist() == [1, 1, 2]
    finally:
        dying.close()
        leaving.close()
        sender.close()
