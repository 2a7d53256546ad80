"""The LoRA adapter mode of the trainer engine (``adapter=``, on the directory path or the
network path with one trainer): only the active adapter of the source's peft model
travels; each server's host keeps its versions in a private directory of its own, and the
adapter's stable name on each ``vllm serve`` is pointed at each version in turn."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import Any

import torch

from weightsync.integrations.vllm.lora_routes import load_on_server
from weightsync.integrations.vllm.trainer_config import AdapterConfig
from weightsync.schemes.lora import LoraAdapter
from weightsync.serving.adapter_files import version_path


class ServedAdapter:
    """One trainer engine's adapter (``LoraAdapter``: what travels, and the guard on the
    base weights) and, per server ``index``, the directory its host keeps versions in."""

    def __init__(self, config: AdapterConfig, source: Any, clients: list[Any]) -> None:
        model = getattr(source, "_module", source)  # ModuleSource keeps its module there
        self.lora = LoraAdapter(model, config.name)
        for client in clients:
            if not hasattr(client, "load_lora_adapter") and getattr(client, "base_url", None) is None:
                raise TypeError(f"adapter={config.name!r} needs clients that can load an "
                                f"adapter on their server: {type(client).__name__} has neither "
                                "load_lora_adapter(name, path) nor an HTTP base_url (use "
                                "HTTPVLLMWeightSyncClient)")
        self.config = config
        self.dirs = {index: f"{config.root}/weightsync-{self.lora.name}-{secrets.token_hex(8)}"
                     for index in range(len(clients))}

    @property
    def name(self) -> str:
        return self.lora.name

    @property
    def model(self) -> Any:
        """The peft model the adapter is read from."""
        return self.lora.model

    def tensors(self) -> dict[str, torch.Tensor]:
        """This round's adapter tensors (``BaseWeightChangedError`` if a base weight
        changed since the first round)."""
        return self.lora.tensors()

    def metadata(self) -> dict[str, str]:
        """The adapter's name and config, carried in each version's header."""
        return self.lora.metadata()

    def init_fields(self, index: int) -> dict[str, Any]:
        """What server ``index``'s ``init_info`` carries for the adapter."""
        return {"adapter": self.name, "adapter_keep": self.config.keep,
                "adapter_dir": self.dirs[index]}

    def point(self, index: int, client: Any, version: int, timeout: float) -> None:
        """Point the adapter's name on server ``index`` at ``version``, which its host just
        staged (``/v1/load_lora_adapter``, a new path per version)."""
        path = version_path(self.dirs[index], self.name, version)
        load_on_server(client, self.name, path, timeout, self.config.load)


def round_weights(source: Iterable[tuple[str, torch.Tensor]],
                  adapter: ServedAdapter | None) -> dict[str, torch.Tensor]:
    """What one round sends: the whole source's tensors, or in adapter mode the adapter's
    alone (every rank computes it: the source's collectives run on each)."""
    if adapter is not None:
        return adapter.tensors()
    return {name: tensor.detach() for name, tensor in source}
