"""Arguments that used to hang or fail bare: NaN, infinite, negative or string timeouts,
empty or numpy ``worker_ids``, too many workers, float versions, relative directories. Each
is refused at once with a ValueError that names the argument (or, for numpy ints, taken)."""

from __future__ import annotations

import importlib.util
import multiprocessing
import time

import numpy as np
import pytest
import torch

import weightsync as ws
from weightsync.integrations.vllm.extension import WeightSyncWorkerExtension, apply_exact

BAD_TIMEOUTS = [float("nan"), float("inf"), -1.0, "1", True]


def small_model() -> torch.nn.Module:
    return torch.nn.Linear(4, 4)


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_a_scheme_refuses_a_timeout_that_is_not_a_finite_number(timeout):
    for scheme_cls in (ws.SharedMemWeightSyncScheme, ws.MultiProcessWeightSyncScheme):
        with pytest.raises(ValueError, match="timeout"):
            scheme_cls(num_workers=1, timeout=timeout)


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS, ids=repr)
def test_every_blocking_call_refuses_a_bad_timeout_at_once(tmp_path, timeout):
    scheme = ws.VLLMDoubleBufferSyncScheme(tmp_path / "w", num_workers=1, timeout=5)
    with scheme.create_sender() as sender:
        sender.register_model(small_model())
        sender.update_weights()
        receiver = scheme.create_receiver(0)
        receiver.register_model(small_model())
        started = time.monotonic()
        with pytest.raises(ValueError, match="timeout"):
            receiver.connect(timeout=timeout)
        receiver.connect(timeout=5)
        for call in (receiver.receive, lambda t: sender.send(timeout=t),
                     lambda t: sender.connect(timeout=t), lambda t: sender.send_async(timeout=t)):
            with pytest.raises(ValueError, match="timeout"):
                call(timeout)
        assert time.monotonic() - started < 2.0
        receiver.close()
    shm = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=5).create_receiver(0)
    shm.register_model(small_model())
    with pytest.raises(ValueError, match="timeout"):
        shm.receive(timeout)  # before any wait: no trainer is needed to see it
    shm.close()


def test_worker_ids_empty_is_refused_and_numpy_ints_are_indices(tmp_path):
    scheme = ws.VLLMDoubleBufferSyncScheme(tmp_path / "w", num_workers=2, timeout=5)
    with scheme.create_sender() as sender:
        sender.register_model(small_model())
        sender.update_weights()
        with pytest.raises(ValueError, match="worker_ids is empty"):
            sender.send_async(worker_ids=[])
        assert sender.version == 0  # nothing published, nobody's lag raised
        with pytest.raises(ValueError, match=r"worker_ids.*float"):
            sender.send_async(worker_ids=[1.0])
        sender.send_async(worker_ids=np.int64(1))
        assert sender.version == 1


def test_shared_mem_refuses_more_workers_than_its_control_block_holds():
    started = time.monotonic()
    for count in (1025, 10**7):
        with pytest.raises(ValueError, match="at most 1024"):
            ws.SharedMemWeightSyncScheme(num_workers=count)
    assert time.monotonic() - started < 1.0
    with pytest.raises(ValueError, match="max_slots"):
        ws.SharedMemWeightSyncScheme(num_workers=4, max_slots=2000)
    scheme = ws.SharedMemWeightSyncScheme(num_workers=1000)
    with pytest.raises(ValueError, match="out of range"):
        scheme.create_receiver(1050)


def test_engine_versions_are_ints_or_refused(tmp_path):
    scheme = ws.VLLMDoubleBufferSyncScheme(tmp_path / "w", num_workers=1, timeout=5)
    with scheme.create_sender() as sender:
        sender.register_model(small_model())
        sender.update_weights()
        sender.update_weights()
        receiver = scheme.create_receiver(0)
        receiver.register_model(small_model())
        receiver.connect(timeout=5)
        for bad in (3.9, True, "1", 1.0):
            with pytest.raises(ValueError, match="version must be an int"):
                apply_exact(receiver, bad, 1.0)  # type: ignore[arg-type]
        assert apply_exact(receiver, np.int64(1), 1.0) == 1
        receiver.close()


def test_the_extension_names_the_bad_argument():
    ext = WeightSyncWorkerExtension()
    with pytest.raises(ValueError, match="worker_idx must be an int >= 0, got int -1"):
        ext.weightsync_connect("/tmp/weights", worker_idx=-1, timeout=1)
    with pytest.raises(ValueError, match="num_workers"):
        ext.weightsync_connect("/tmp/weights", worker_idx=0, timeout=1, num_workers="2")
    with pytest.raises(ValueError, match="timeout"):
        ext.weightsync_connect("/tmp/weights", worker_idx=0, timeout="5")
    with pytest.raises(ValueError, match="absolute path"):
        ext.weightsync_connect("relative/weights", worker_idx=0, timeout=1)
    with pytest.raises(ValueError, match="worker_offset must be an int >= 0"):
        ext.weightsync_connect("/tmp/weights", timeout=1, worker_offset=-2)


def test_the_vllm_backend_checks_its_infos_once():
    pytest.importorskip("vllm")
    from weightsync.integrations.vllm.backend import WeightSyncInitInfo, WeightSyncUpdateInfo

    for bad in (3.9, True, "3"):
        with pytest.raises(ValueError, match="update_info version must be an int"):
            WeightSyncUpdateInfo(version=bad)  # type: ignore[arg-type]
    assert WeightSyncUpdateInfo(version=np.int64(3)).version == 3
    with pytest.raises(ValueError, match="update_info timeout"):
        WeightSyncUpdateInfo(version=1, timeout=float("nan"))
    with pytest.raises(ValueError, match="init_info timeout"):
        WeightSyncInitInfo(directory="/tmp/w", timeout="5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="init_info num_workers"):
        WeightSyncInitInfo(directory="/tmp/w", num_workers="2")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="absolute path"):
        WeightSyncInitInfo(directory="weights")
    with pytest.raises(ValueError, match="update_info label must be a string"):
        WeightSyncUpdateInfo(version=1, label=2)  # type: ignore[arg-type]
    remote = {"address": "127.0.0.1:5000", "token": "t", "ticket": "k"}
    for url in ("10.0.0.2:8000", "ftp://host"):
        with pytest.raises(ValueError, match="the server's http"):
            WeightSyncInitInfo(**remote, stage_version=0, url=url)
    with pytest.raises(ValueError, match="sent with 'stage_version'"):
        WeightSyncInitInfo(**remote, url="http://10.0.0.2:8000")  # a lease is for in-flight
    assert WeightSyncInitInfo(**remote, stage_version=0, url="http://10.0.0.2:8000").url


def test_a_trainer_model_moved_to_meta_after_connect_is_named(tmp_path):
    model = small_model()
    with ws.VLLMDoubleBufferSyncScheme(tmp_path / "w", timeout=5).create_sender() as sender:
        sender.register_model(model)
        sender.update_weights()
        model.to("meta")
        with pytest.raises(ValueError, match="key 'weight'.* meta device"):
            sender.update_weights()


def _zero_copy_worker_cast_to_half(scheme, idx, out, stop):
    model = torch.nn.Linear(8, 8)
    receiver = scheme.create_receiver(idx, zero_copy=True)
    receiver.register_model(model)
    receiver.connect(timeout=30)
    model.half()
    out.put(("cast", idx))
    try:
        receiver.receive(timeout=30)
        out.put(("applied", idx, str(model.weight.dtype)))
    except ws.SchemaMismatchError as exc:
        out.put(("mismatch", idx, exc.key))
    receiver.close()


def test_a_zero_copy_model_cast_after_connect_is_refused_not_undone(workers):
    from workers import drain

    scheme = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=30)
    workers.start(_zero_copy_worker_cast_to_half, scheme, 0)
    with scheme.create_sender() as sender:
        sender.register_model(torch.nn.Linear(8, 8))
        sender.connect(timeout=30)
        assert drain(workers.out, 1)[0][0] == "cast"
        sender.send_async()
        (kind, _idx, key), = drain(workers.out, 1)
        assert (kind, key) == ("mismatch", "weight")


def refusal(what: str, value: object, optional: bool) -> str:
    """The one message every refused timeout gets."""
    return (f"{what} must be a finite number of seconds >= 0 (0: do not wait)"
            f"{' or None' if optional else ''}, got {type(value).__name__} {value!r}")


def timeout_entry_points(tmp_path):
    """(name, argument named, None taken, call(timeout)) for every public entry point that
    takes a timeout, on a directory scheme with a connected worker (cheap, one process)."""
    from weightsync.integrations.vllm.driver import connect_engine, update_engine
    from weightsync.transports.mp.transport import MPTransport

    scheme = ws.VLLMDoubleBufferSyncScheme(tmp_path / "w", num_workers=1, timeout=5)
    sender = scheme.create_sender()
    sender.register_model(small_model())
    sender.update_weights()
    receiver = scheme.create_receiver(0)
    receiver.register_model(small_model())
    receiver.connect(timeout=5)
    extension = WeightSyncWorkerExtension()
    shm = ws.SharedMemWeightSyncScheme(num_workers=1, timeout=5).create_receiver(0)
    shm.register_model(small_model())
    pipe, _ = multiprocessing.Pipe()
    pending = [False]

    def sender_pending() -> bool:
        try:
            sender.wait_async(timeout=float("nan"))
        except ValueError:
            return True  # there is a send to wait for: only the timeout was refused
        except RuntimeError:
            return False
        return False

    def wait_async(timeout):
        if not pending[0]:  # a refused wait_async leaves its send pending
            sender.send_async(timeout=5)
            pending[0] = True
        try:
            sender.wait_async(timeout=timeout)
        finally:  # a refused timeout leaves the send pending, a timed-out wait does not
            pending[0] = sender_pending()

    points = [
        ("SharedMem scheme", "timeout", False,
         lambda t: ws.SharedMemWeightSyncScheme(num_workers=1, timeout=t)),
        ("MultiProcess scheme", "timeout", False,
         lambda t: ws.MultiProcessWeightSyncScheme(num_workers=1, timeout=t)),
        ("directory scheme", "timeout", False,
         lambda t: ws.VLLMDoubleBufferSyncScheme(tmp_path / "c", num_workers=1, timeout=t)),
        ("Ray scheme", "timeout", False, lambda t: ws.RayWeightSyncScheme(timeout=t)),
        ("MPTransport", "timeout", False, lambda t: MPTransport(pipe, timeout=t)),
        ("sender.connect", "timeout", True, lambda t: sender.connect(timeout=t)),
        ("sender.send", "timeout", True, lambda t: sender.send(timeout=t)),
        ("sender.send_async", "timeout", True, lambda t: (sender.send_async(timeout=t),
                                                          sender.wait_async(timeout=5))),
        ("sender.wait_async", "timeout", True, wait_async),
        ("sender.update_weights", "timeout", True, lambda t: sender.update_weights(timeout=t)),
        ("receiver.connect", "timeout", True, lambda t: receiver.connect(timeout=t)),
        ("receiver.receive", "timeout", True, lambda t: receiver.receive(timeout=t)),
        ("receiver.apply_version", "timeout", True,
         lambda t: receiver.apply_version(sender.version, timeout=t)),
        ("SharedMem receiver.receive", "timeout", True, lambda t: shm.receive(t)),
        ("extension.weightsync_connect", "timeout", False,
         lambda t: extension.weightsync_connect(str(tmp_path / "w"), worker_idx=0, timeout=t)),
        ("connect_engine", "timeout", False,
         lambda t: connect_engine(None, str(tmp_path / "w"), timeout=t)),
        ("update_engine", "timeout", False, lambda t: update_engine(None, timeout=t)),
    ]
    if importlib.util.find_spec("vllm") is not None:
        from weightsync.integrations.vllm.backend import WeightSyncInitInfo, WeightSyncUpdateInfo

        points += [
            ("vLLM init_info", "init_info timeout", False,
             lambda t: WeightSyncInitInfo(directory="/tmp/w", timeout=t)),
            ("vLLM update_info", "update_info timeout", True,
             lambda t: WeightSyncUpdateInfo(version=1, timeout=t)),
        ]
    if importlib.util.find_spec("torchrl") is not None:
        from weightsync.integrations import torchrl as ws_torchrl

        points += [
            ("TorchRL scheme timeout", "timeout", False,
             lambda t: ws_torchrl.SharedMemWeightSyncScheme(timeout=t)),
            ("TorchRL scheme connect_timeout", "connect_timeout", False,
             lambda t: ws_torchrl.MultiProcessWeightSyncScheme(connect_timeout=t)),
        ]
        if importlib.util.find_spec("vllm") is not None:
            from weightsync.integrations.torchrl.llm import (
                VLLMDoubleBufferSyncScheme as TorchRLVLLMScheme,
            )

            points.append(("TorchRL vLLM scheme", "timeout", False,
                           lambda t: TorchRLVLLMScheme(str(tmp_path / "w"), timeout=t)))
    return points, (sender, receiver, shm, lambda: pending[0] and wait_async(5))


def test_every_timeout_takes_zero_and_refuses_the_rest_alike(tmp_path):
    """One rule (``core.deadline``): 0 is a timeout (do not wait: one non-blocking attempt)
    everywhere, and a negative, NaN or bool one is refused at once with the same words."""
    points, ends = timeout_entry_points(tmp_path)
    try:
        for name, what, optional, call in points:
            try:
                call(0)
            except ValueError as exc:  # another error (no engine, nothing newer) is fine
                assert "timeout" not in str(exc), (name, exc)
            except (RuntimeError, AttributeError, TypeError):
                pass  # not about the timeout: the call ran past its argument checks
            for bad in (-1.0, float("nan"), True, -5):
                with pytest.raises(ValueError) as refused:
                    call(bad)
                assert str(refused.value) == refusal(what, bad, optional), name
    finally:
        sender, receiver, shm, settle = ends
        settle()
        receiver.close()
        shm.close()
        sender.close()
