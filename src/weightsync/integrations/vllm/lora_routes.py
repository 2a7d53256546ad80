"""Pointing a stable adapter name on ``vllm serve`` at one LoRA adapter version, through
vLLM's ``/v1/load_lora_adapter`` route (the trainer side of served adapters; the files on
the server's host are ``weightsync.serving.adapter_files``)."""

from __future__ import annotations

from typing import Any

from weightsync.core.errors import WeightSyncError

#: how the stable name moves to a new version (see :func:`load_on_server`)
LOAD_MODES = ("inplace", "swap")


def load_on_server(client: Any, name: str, path: str, timeout: float, mode: str = "inplace") -> None:
    """Point ``name`` on the server of ``client`` at the adapter in ``path`` (on the
    server's host) through vLLM's ``/v1/load_lora_adapter``; requests sent after this
    returns get this version. ``mode``: ``"inplace"`` (``load_inplace``: the name keeps its
    LoRA id and never stops answering; vLLM 0.32 then re-reads the files at every step,
    vLLM issue #33791) or ``"swap"`` (``/v1/unload_lora_adapter``, then a plain load under
    a new id: no re-reads, and requests in flight finish on their version, but for one
    round trip the name answers 404). ``client``: one with a ``load_lora_adapter(name,
    path)`` method (it decides how), or an HTTP client with ``base_url``
    (``HTTPVLLMWeightSyncClient``)."""
    if mode not in LOAD_MODES:
        raise ValueError(f"adapter load mode must be one of {LOAD_MODES}, got {mode!r}")
    if hasattr(client, "load_lora_adapter"):
        client.load_lora_adapter(name, path)
        return
    base_url = getattr(client, "base_url", None)
    if base_url is None:
        raise TypeError(f"adapter {name!r}: the client {type(client).__name__} has neither "
                        "load_lora_adapter(name, path) nor an HTTP base_url")
    import requests

    url = str(base_url).rstrip("/")
    if mode == "swap":
        reply = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name},
                              timeout=timeout)
        if reply.status_code >= 400 and "cannot be found" not in reply.text:  # first version
            _refused(url, name, path, reply)
    reply = requests.post(f"{url}/v1/load_lora_adapter", timeout=timeout, json={
        "lora_name": name, "lora_path": path, "load_inplace": mode == "inplace"})
    if reply.status_code >= 400:
        _refused(url, name, path, reply)


def _refused(url: str, name: str, path: str, reply: Any) -> None:
    if reply.status_code == 404 and "lora" not in reply.text.lower():
        raise WeightSyncError(
            f"{url} has no LoRA adapter routes: start vllm serve with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora")
    raise WeightSyncError(f"{url} refused adapter {name!r} from {path}: "
                          f"HTTP {reply.status_code}: {reply.text[:500]}")
