"""The server host's side of LoRA on ``vllm serve`` without an engine: each adapter version
is copied, verified, from a double-buffer directory into its own private directory named by
the trainer's version (what ``/v1/load_lora_adapter`` is then pointed at), the newest
``keep`` stay, and what vLLM must not load is refused before any copy."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm_model as vm
from pidns import Namespaces, pid_namespaces_usable
from safetensors.torch import load_file

import weightsync as ws
from weightsync.core.errors import AdapterRankError, UnsafeDirectoryError, WeightSyncError
from weightsync.integrations.vllm.lora_routes import load_on_server
from weightsync.serving.adapter_files import AdapterFiles, version_path

pytest.importorskip("peft")


def _sender(directory: Path, model: Any) -> Any:
    sender = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, adapter="policy").create_sender()
    sender.register_model(model)
    return sender


def _versions(files: AdapterFiles) -> list[str]:
    return sorted(p.name for p in files.root.iterdir() if p.name.startswith("policy-v"))


def test_each_version_gets_its_own_directory_and_the_newest_keep_stay(tmp_path: Path):
    model = vm.peft_model()
    files = AdapterFiles(str(tmp_path / "adapters"), "policy", max_rank=8, keep=2)
    assert os.stat(files.root).st_mode & 0o777 == 0o700
    with _sender(tmp_path / "slots", model) as sender:
        for step in range(4):
            vm.set_adapter(model, step)
            version = sender.update_weights()
            path = files.stage(tmp_path / "slots", 10, expect=version, label=100 + version)
            assert str(path) == version_path(str(files.root), "policy", 100 + version)
            assert files.version == 100 + version
            saved = load_file(path / "adapter_model.safetensors")
            lora = {n: p for n, p in model.named_parameters() if ".lora_" in n}
            assert len(saved) == len(lora) > 0
            for name, tensor in saved.items():
                live = lora[name.replace(".weight", ".default.weight")]
                assert torch.equal(tensor, live), name
            assert json.loads((path / "adapter_config.json").read_text())["r"] == 8
        assert _versions(files) == ["policy-v102", "policy-v103"]
        with pytest.raises(WeightSyncError, match="version 1 was asked for.*holds version 3"):
            files.stage(tmp_path / "slots", 10, expect=1)
    files.close()
    assert not files.root.exists()


def test_an_adapter_above_max_lora_rank_is_refused_before_any_copy(tmp_path: Path):
    files = AdapterFiles(str(tmp_path / "adapters"), "policy", max_rank=8, keep=2)
    with _sender(tmp_path / "slots", vm.peft_model(rank=16)) as sender:
        sender.update_weights()
        with pytest.raises(AdapterRankError, match="rank 16.*max_lora_rank=8"):
            files.stage(tmp_path / "slots", 10)
    assert _versions(files) == []


def test_a_version_not_committed_in_time_is_a_timeout(tmp_path: Path):
    files = AdapterFiles(str(tmp_path / "adapters"), "policy", max_rank=8, keep=2)
    with _sender(tmp_path / "slots", vm.peft_model()) as sender:
        sender.update_weights()
        with pytest.raises(WeightSyncError, match="version 5 could not be read"):
            files.stage(tmp_path / "slots", 0.3, expect=5)


def test_a_directory_others_can_enter_is_refused(tmp_path: Path):
    shared = tmp_path / "adapters"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with pytest.raises(UnsafeDirectoryError, match="not a private directory"):
        AdapterFiles(str(shared), "policy", max_rank=8, keep=2)
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(UnsafeDirectoryError):
        AdapterFiles(str(tmp_path / "link"), "policy", max_rank=8, keep=2)
    with pytest.raises(WeightSyncError, match="parent does not exist"):
        AdapterFiles(str(tmp_path / "missing" / "adapters"), "policy", max_rank=8, keep=2)


def _adapter_server(out: Any, adapter_dir: str) -> None:
    """A server process's adapter directory: made, reported, then kept until killed."""
    files = AdapterFiles(adapter_dir, "policy", max_rank=8, keep=1)
    out.put(("ready", os.getpid(), str(files.root)))
    time.sleep(60)


def _killed_server(tmp_path: Path, name: str) -> Path:
    """The adapter directory of a server process SIGKILLed (as vLLM kills its workers)."""
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()
    proc = ctx.Process(target=_adapter_server, args=(out, str(tmp_path / name)), daemon=True)
    proc.start()
    try:
        assert _ready(out, 20)[0] == "ready"
    finally:
        proc.kill()
        proc.join(10)
    assert (tmp_path / name / "owner.json").exists()
    return tmp_path / name


def _ready(out: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while out.empty():
        assert time.monotonic() < end, f"no message within {timeout} s"
        time.sleep(0.01)
    return out.get()


def test_directories_of_server_processes_gone_are_swept_by_the_next(tmp_path: Path):
    """What a SIGKILLed server made is removed by the next server; a live server's
    directory, a private directory that is not weightsync's and one holding an owner file
    weightsync did not write are kept."""
    dead = _killed_server(tmp_path, "weightsync-policy-dead")
    live = AdapterFiles(str(tmp_path / "weightsync-policy-live"), "policy", max_rank=8, keep=1)
    other = tmp_path / "not-an-adapter-directory"
    other.mkdir(mode=0o700)
    foreign = tmp_path / "private-with-an-owner-file"
    foreign.mkdir(mode=0o700)
    (foreign / "owner.json").write_text(json.dumps({"pid": 2**22 + 1, "start": "1"}))
    AdapterFiles(str(tmp_path / "weightsync-policy-next"), "policy", max_rank=8, keep=1)
    assert not dead.exists()
    assert other.exists() and (foreign / "owner.json").exists()
    assert live.root.exists()  # its process is alive: kept
    live.close()
    assert not live.root.exists()


def test_an_existing_private_directory_with_files_is_refused_and_kept(tmp_path: Path):
    """``adapter_dir`` comes from ``init_info``: naming a private directory of the server's
    user that holds files (think ~/.ssh) is refused before anything is written, and nothing
    of it is removed, then or at close."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    (private / "id_ed25519").write_text("secret")
    (private / "keys").mkdir()
    (private / "keys" / "more").write_text("secret")
    with pytest.raises(UnsafeDirectoryError, match=f"{private} exists and is not empty"):
        AdapterFiles(str(private), "policy", max_rank=8, keep=2).close()
    assert sorted(p.name for p in private.iterdir()) == ["id_ed25519", "keys"]
    assert (private / "keys" / "more").read_text() == "secret"
    live = AdapterFiles(str(tmp_path / "adapters"), "policy", max_rank=8, keep=2)
    with pytest.raises(UnsafeDirectoryError, match="another weightsync server, process"):
        AdapterFiles(str(live.root), "policy", max_rank=8, keep=2)
    live.close()


def test_an_empty_directory_is_used_and_only_what_weightsync_wrote_is_removed(tmp_path: Path):
    """An existing empty private directory may be ``adapter_dir``; close() removes the
    versions written there and leaves the directory, and a file someone else put there."""
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    os.chmod(empty, 0o700)
    files = AdapterFiles(str(empty), "policy", max_rank=8, keep=2)
    with _sender(tmp_path / "slots", vm.peft_model()) as sender:
        sender.update_weights()
        files.stage(tmp_path / "slots", 10)
    (empty / "notes.txt").write_text("not weightsync's")
    assert _versions(files) == ["policy-v0"]
    files.close()
    assert sorted(p.name for p in empty.iterdir()) == ["notes.txt"]
    made = AdapterFiles(str(tmp_path / "made"), "policy", max_rank=8, keep=2)
    (made.root / "notes.txt").write_text("not weightsync's")
    made.close()  # made by weightsync, but it holds a file that is not: kept with it
    assert sorted(p.name for p in made.root.iterdir()) == ["notes.txt"]


def _other_namespace_server(out: Any, adapter_dir: str) -> None:
    files = AdapterFiles(adapter_dir, "policy", max_rank=8, keep=1)
    out.put(("ready", os.getpid(), sorted(p.name for p in files.root.iterdir())))
    time.sleep(60)


@pytest.mark.skipif(not pid_namespaces_usable(), reason="needs root on Linux (pid namespaces)")
def test_a_server_in_another_pid_namespace_keeps_its_directory(tmp_path: Path):
    """Server A runs as pid 1 of its own pid namespace with the directory shared (as docker
    ``--ipc=host`` shares /dev/shm); server B starts beside it: A's pid means another process
    in B's /proc, so B must not judge A dead. A's directory stays, live or killed (then only
    a server of A's namespace can tell)."""
    pool = Namespaces()
    try:
        out, init = pool.start(1, _other_namespace_server, str(tmp_path / "weightsync-policy-a"))
        ready = out.get(timeout=20)
        assert ready[:2] == ("ready", 1) and ready[2] == ["owner.json"], ready
        b = AdapterFiles(str(tmp_path / "weightsync-policy-b"), "policy", max_rank=8, keep=1)
        assert (tmp_path / "weightsync-policy-a" / "owner.json").exists()
        os.kill(init, signal.SIGKILL)
        pool.close()
        c = AdapterFiles(str(tmp_path / "weightsync-policy-c"), "policy", max_rank=8, keep=1)
        assert (tmp_path / "weightsync-policy-a" / "owner.json").exists()
        b.close()
        c.close()
    finally:
        pool.close()


def test_a_client_that_cannot_load_adapters_is_named():
    calls: list[tuple[str, str]] = []

    class Loader:
        def load_lora_adapter(self, name: str, path: str) -> None:
            calls.append((name, path))

    load_on_server(Loader(), "policy", "/dev/shm/x/policy-v3", 5)
    assert calls == [("policy", "/dev/shm/x/policy-v3")]
    with pytest.raises(TypeError, match="neither load_lora_adapter"):
        load_on_server(object(), "policy", "/dev/shm/x/policy-v3", 5)


def test_the_trainer_engine_refuses_what_cannot_serve_an_adapter(tmp_path: Path):
    """Before anything is written or sent: a model that is not a peft model, and a client
    that cannot point a name at an adapter."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo

    class NoLoader:
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            raise AssertionError("nothing may reach the server")

    info = WeightSyncTrainerInitInfo(rank=0, directory=str(tmp_path), adapter="policy")
    with pytest.raises(TypeError, match="needs a peft model"):
        WeightTransferTrainerFactory.trainer_init(info, client=NoLoader(),
                                                  source=ModuleSource(vm.build_model()))
    with pytest.raises(TypeError, match="neither load_lora_adapter"):
        WeightTransferTrainerFactory.trainer_init(info, client=NoLoader(),
                                                  source=ModuleSource(vm.peft_model()))
    assert list(tmp_path.iterdir()) == []
