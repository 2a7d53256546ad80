"""VLLMDoubleBufferSyncScheme(adapter=...): only a peft model's LoRA weights travel, under
peft's saved names, with the adapter's config in the slot; a changed base is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import weightsync as ws
from weightsync.core.errors import BaseWeightChangedError
from weightsync.schemes.lora import ADAPTER_CONFIG_KEY, ADAPTER_NAME_KEY
from weightsync.transports.directory.manifest import read_manifest, slot_path

peft = pytest.importorskip("peft")
safetensors = pytest.importorskip("safetensors")


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(32, 32)
        self.v_proj = torch.nn.Linear(32, 32)
        self.mlp = torch.nn.Linear(32, 32)
        self.register_buffer("scale", torch.ones(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.v_proj(self.q_proj(x))) * self.scale


def _peft_model(rank: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=rank, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             init_lora_weights=False)
    return peft.get_peft_model(Tiny(), config)


def _sender(directory: Path, model: torch.nn.Module) -> ws.VLLMDoubleBufferWeightSender:
    sender = ws.VLLMDoubleBufferSyncScheme(directory, adapter="policy").create_sender()
    sender.register_model(model)
    return sender


def _committed(directory: Path) -> tuple[int, dict[str, torch.Tensor], dict[str, str]]:
    manifest = read_manifest(directory)
    assert manifest is not None
    path = slot_path(directory, manifest.latest.slot)
    with safetensors.safe_open(str(path), "pt") as f:
        return manifest.latest.version, {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118


def test_only_the_adapter_travels_under_peft_saved_names(tmp_path: Path):
    model = _peft_model()
    with _sender(tmp_path / "d", model) as sender:
        assert sender.update_weights() == 0
        version, tensors, metadata = _committed(tmp_path / "d")
        expected = peft.get_peft_model_state_dict(model)
        assert version == 0 and set(tensors) == set(expected)
        assert all(name.startswith("base_model.model.") and ".lora_" in name for name in tensors)
        for name, tensor in expected.items():
            assert torch.equal(tensors[name], tensor)
        assert sender.stats()["layout_nbytes"] == sum(t.nbytes for t in expected.values())
        config = json.loads(metadata[ADAPTER_CONFIG_KEY])
        assert metadata[ADAPTER_NAME_KEY] == "policy"
        assert (config["r"], config["lora_alpha"]) == (4, 8)
        assert sorted(config["target_modules"]) == ["q_proj", "v_proj"]
        with torch.no_grad():  # a training step on the adapter is the next version
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(1.0)
        assert sender.update_weights() == 1
        _, tensors, _ = _committed(tmp_path / "d")
        for name, tensor in peft.get_peft_model_state_dict(model).items():
            assert torch.equal(tensors[name], tensor)


@pytest.mark.parametrize("change", ["optimizer", "merge_adapter", "buffer"])
def test_a_changed_base_is_refused_and_nothing_is_committed(tmp_path: Path, change: str):
    model = _peft_model()
    with _sender(tmp_path / "d", model) as sender:
        sender.update_weights()
        base = model.base_model.model
        if change == "optimizer":  # a base left trainable by mistake
            base.mlp.weight.requires_grad_(True)
            model(torch.randn(2, 32)).sum().backward()
            torch.optim.SGD([base.mlp.weight], lr=0.1).step()
            key = "base_model.model.mlp.weight"
        elif change == "merge_adapter":  # writes the base through .data
            model.merge_adapter()
            key = "base_model.model.q_proj.base_layer.weight"
        else:
            base.scale.mul_(2)
            key = "base_model.model.scale"
        with pytest.raises(BaseWeightChangedError) as caught:
            sender.update_weights()
        assert caught.value.key == key and key in str(caught.value)
        assert _committed(tmp_path / "d")[0] == 0
        assert sender.version == 0


def test_adapter_needs_a_peft_model_and_a_safe_name(tmp_path: Path):
    sender = ws.VLLMDoubleBufferSyncScheme(tmp_path / "d", adapter="policy").create_sender()
    with sender, pytest.raises(TypeError, match="peft model"):
        sender.register_model(torch.nn.Linear(2, 2))
    for bad in ("", "../x", "a/b", "x" * 65):
        with pytest.raises(ValueError, match="adapter must be a name"):
            ws.VLLMDoubleBufferSyncScheme(tmp_path / "e", adapter=bad)
    with pytest.raises(ValueError, match="trainer_ranks=1"):
        ws.VLLMDoubleBufferSyncScheme(tmp_path / "e", adapter="policy", trainer_ranks=2)


def test_another_adapter_config_replaces_the_slots_of_a_recovered_directory(tmp_path: Path):
    directory = tmp_path / "d"
    with _sender(directory, _peft_model()) as sender:
        sender.update_weights()
    model = _peft_model()
    model.peft_config["default"].lora_alpha = 32  # same shapes, another scale
    with _sender(directory, model) as sender:
        assert sender.update_weights() == 1  # numbering goes on
        version, _, metadata = _committed(directory)
        assert version == 1 and json.loads(metadata[ADAPTER_CONFIG_KEY])["lora_alpha"] == 32
        manifest = read_manifest(directory)
        assert manifest is not None and set(manifest.slots) == {manifest.latest.slot}
