"""One trainer per vLLM server at a time, without starting a vLLM engine: the weightsync
backend's worker engine (vLLM's own class, given a plain module: its reload copies each
version in) is driven in process by two weightsync trainer engines, through a client that
makes vLLM's four weight-sync calls on it, over a real loopback listener (the network path
into ``vllm serve``) or through directories."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed; bash scripts/env.sh installs it")
pytest.importorskip("zstandard")

from vllm.distributed.weight_transfer import ModuleSource

from weightsync.core.errors import TrainerSessionEndedError
from weightsync.integrations.vllm.backend import (
    WeightSyncInitInfo,
    WeightSyncTrainerEngine,
    WeightSyncTrainerInitInfo,
    WeightSyncUpdateInfo,
    WeightSyncWeightTransferEngine,
)

TIMEOUT = 15.0


class PlainWorker(WeightSyncWeightTransferEngine):
    """The backend's worker engine serving a dict instead of a vLLM model."""

    def __init__(self) -> None:
        config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=1),
                                 model_config=SimpleNamespace(hf_config=None),
                                 instance_id=f"sessions-{secrets.token_hex(4)}")
        super().__init__(None, config, torch.device("cpu"), torch.nn.Module())
        self.held: dict[str, torch.Tensor] = {}

    def _reload(self, pairs: Any) -> None:
        self.held = {name: tensor.clone() for name, tensor in pairs}


class Client:
    """vLLM's four weight-sync calls on one worker engine, in process; ``label`` is the
    weight version the server would report. ``http``: a failed call raises what vLLM's
    HTTP client raises (an HTTP 500 whose JSON body holds the server's error message)."""

    def __init__(self, worker: PlainWorker, http: bool = False) -> None:
        self.worker = worker
        self.http = http
        self.label: str | None = None

    def _call(self, route: str, call: Any, *args: Any) -> None:
        if not self.http:
            call(*args)
            return
        import json

        import requests

        try:
            call(*args)
        except Exception as exc:
            reply = requests.Response()
            reply.status_code = 500
            reply._content = json.dumps({"error": {"message": str(exc), "code": 500}}).encode()
            raise requests.HTTPError(f"500 Server Error: Internal Server Error for url: "
                                     f"http://server/{route}", response=reply) from None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", self.worker.init_transfer_engine,
                   self.worker.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self._call("start_weight_update", self.worker.start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", self.worker.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.worker.finish_weight_update()
        if weight_version is not None:
            self.label = weight_version


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[Client]:
    worker = PlainWorker()
    yield Client(worker, http=getattr(request, "param", "") == "http")
    worker.shutdown()
    if worker.host is not None:
        worker.host.close()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(32, 16)


def _step(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A new version of ``model``'s weights; returns them."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _trainer(client: Client, model: torch.nn.Module, **where: Any) -> WeightSyncTrainerEngine:
    return WeightSyncTrainerEngine.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, timeout=TIMEOUT, **where), client=client,
        source=ModuleSource(model))


def _same(held: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> bool:
    return held.keys() == weights.keys() and all(torch.equal(held[k], weights[k]) for k in held)


def _where(kind: str, tmp_path: Path, name: str) -> dict[str, Any]:
    return ({"address": "127.0.0.1:0"} if kind == "network"
            else {"directory": str(tmp_path / name)})


@pytest.mark.parametrize(("kind", "server"), [("network", ""), ("network", "http"),
                                              ("directory", ""), ("directory", "http")],
                         indirect=["server"], ids=["network", "network-http", "directory",
                                                   "directory-http"])
def test_a_second_trainer_ends_the_first_ones_session(server: Client, tmp_path: Path, kind: str):
    """Trainer A inits a server and sends version 1; trainer B inits the same server (it
    takes the server over) and sends versions 1 and 2; A's version 2 is then refused with
    TrainerSessionEndedError naming both sessions, and the server keeps B's weights under
    B's label. A's later sends (which init the server again first) are refused too; B
    goes on. Over HTTP the trainer finds the server's error in the reply's body."""
    a_model, b_model = _model(0), _model(1)
    a = _trainer(server, a_model, **_where(kind, tmp_path, "a"))
    b = None
    try:
        a_v1 = _step(a_model)
        a.send_weights()
        assert server.label == "1" and _same(server.worker.held, a_v1)
        b = _trainer(server, b_model, **_where(kind, tmp_path, "b"))
        assert a.session != b.session
        for _ in (1, 2):
            b_weights = _step(b_model)
            b.send_weights()
        assert b.version == 2 and server.label == "2" and _same(server.worker.held, b_weights)
        _step(a_model)
        with pytest.raises(TrainerSessionEndedError) as raised:
            a.send_weights()  # A's version 2
        message = str(raised.value)
        for named in (f"trainer session {a.session}", f"trainer session {b.session}",
                      "took it over", "one trainer per server at a time"):
            assert named in message, message
        assert raised.value.session == a.session
        assert server.label == "2" and _same(server.worker.held, b_weights)
        b_weights = _step(b_model)
        b.send_weights()
        assert server.label == "3" and _same(server.worker.held, b_weights)
        _step(a_model)
        with pytest.raises(TrainerSessionEndedError, match=f"trainer session {a.session}"):
            a.send_weights()  # its init again first: refused, B's session stays
        assert server.label == "3" and _same(server.worker.held, b_weights)
        b_weights = _step(b_model)
        b.send_weights()
        assert server.label == "4" and _same(server.worker.held, b_weights)
    finally:
        for trainer in (a, b):
            if trainer is not None:
                trainer.shutdown()


def test_updates_and_inits_without_a_session_still_work(server: Client, tmp_path: Path):
    """The directory path's direct calls carry no session: an update without one is
    loaded whatever session initialised the server, and an init without one takes the
    server over from a trainer engine (whose next update is then refused)."""
    model = _model(0)
    trainer = _trainer(server, model, directory=str(tmp_path / "a"))
    try:
        weights = _step(model)
        trainer.send_weights()
        _step(model)
        trainer.sender.update_weights(dict(model.named_parameters()))  # version 2, not loaded
        server.update_weights({"version": 1})  # a direct call, no session
        assert _same(server.worker.held, weights)
        server.init_weight_transfer_engine({"directory": str(tmp_path / "a"),
                                            "timeout": TIMEOUT})  # loads the newest: 2
        assert server.worker.version == 2
        _step(model)
        with pytest.raises(TrainerSessionEndedError, match="an init without a trainer session"):
            trainer.send_weights()
        server.update_weights({"version": 3})  # a direct call loads the trainer's version 3
        assert server.worker.version == 3
    finally:
        trainer.shutdown()


def test_session_ids_are_checked_as_parsed():
    for bad in ("xyz12345", "abc", 12345678, "a" * 65):
        with pytest.raises(ValueError, match="update_info session must be a trainer session"):
            WeightSyncUpdateInfo(version=1, session=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="init_info session must be a trainer session"):
            WeightSyncInitInfo(directory="/tmp/w", session=bad)  # type: ignore[arg-type]
    assert WeightSyncUpdateInfo(version=1).session == ""
    assert WeightSyncUpdateInfo(version=1, session="0123abcd").session == "0123abcd"
