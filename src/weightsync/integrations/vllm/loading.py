"""How a running vLLM worker takes a version: checked against the engine's checkpoint
layout, then loaded through vLLM's own reload path.

After start-up vLLM post-processes layers (``process_weights_after_loading``: oneDNN
repacking on CPU, quantised and FP8 layouts on GPU), so a second plain
``model.load_weights`` call fails on the repacked parameters. vLLM's
``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` restores the
checkpoint-format parameters, loads, and post-processes again: that is what we call.
Nothing here imports vLLM."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from weightsync.core.errors import SchemaMismatchError

logger = logging.getLogger(__name__)

Pairs = Iterable[tuple[str, torch.Tensor]]


def served_model(worker: Any) -> Any:
    """The ``nn.Module`` a vLLM worker serves (``model_runner.model`` or ``get_model()``)."""
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if model is None and runner is not None and hasattr(runner, "get_model"):
        model = runner.get_model()
    if model is None or not hasattr(model, "load_weights"):
        raise RuntimeError(
            f"{type(worker).__name__} is not a vLLM worker with a loaded model: weightsync "
            "needs model_runner.model.load_weights(weights)"
        )
    return model


def checkpoint_layout(hf_config: Any) -> tuple[dict[str, tuple[int, ...]], list[set[str]]] | None:
    """The names and shapes a checkpoint of ``hf_config`` holds, and the groups of names
    that are one tied tensor (any one name of a group is enough), from a transformers model
    built on the meta device (no memory). None when transformers cannot build it."""
    try:
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except Exception as exc:  # an architecture only vLLM knows: vLLM's loader checks names
        logger.info("no checkpoint layout for %s (%s): names are checked by vLLM only",
                    type(hf_config).__name__, exc)
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    groups: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # persistent entries only
        shapes[name] = tuple(tensor.shape)
        groups.setdefault(id(tensor), set()).add(name)
    return shapes, list(groups.values())


def check_against_checkpoint(
    slot_shapes: dict[str, tuple[int, ...]],
    layout: tuple[dict[str, tuple[int, ...]], list[set[str]]],
    where: str,
) -> None:
    """Raise ``SchemaMismatchError`` naming the first key the engine's model cannot take:
    a name it does not have, a shape that differs, or a tensor the slots lack."""
    expected, groups = layout
    for name, shape in slot_shapes.items():
        if name not in expected:
            raise SchemaMismatchError(
                f"{where}: layout mismatch: the slots hold {name!r} (shape {list(shape)}), "
                f"which the engine's model does not have; is the trainer's model the one vLLM "
                f"serves?",
                key=name, expected=None, got=shape,
            )
        if tuple(shape) != expected[name]:
            raise SchemaMismatchError(
                f"{where}: layout mismatch: {name!r} has shape {list(shape)} in the slots but "
                f"{list(expected[name])} in the engine's model",
                key=name, expected=expected[name], got=tuple(shape),
            )
    for group in groups:
        if not group & slot_shapes.keys():
            name = sorted(group)[0]
            raise SchemaMismatchError(
                f"{where}: layout mismatch: the slots lack {name!r} (shape "
                f"{list(expected[name])}), which the engine's model needs",
                key=name, expected=expected[name], got=None,
            )


class EngineLoader:
    """``loader(pairs)`` for a weightsync receiver inside a vLLM worker: check the
    version's layout once per layout, then load it the way vLLM reloads weights."""

    def __init__(self, worker: Any, where: str, reload: Callable[[Pairs], None] | None = None,
                 hf_config: Any = None) -> None:
        self.worker = worker
        self.where = where
        self.hf_config = hf_config
        self._reload = reload or self._default_reload(worker)
        self._checked: frozenset[tuple[str, tuple[int, ...]]] | None = None
        self._layout: Any = False  # False: not computed yet; None: unavailable

    @staticmethod
    def _default_reload(worker: Any) -> Callable[[Pairs], None]:
        if callable(getattr(worker, "reload_weights", None)):
            def reload(pairs: Pairs) -> None:
                worker.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
            return reload
        model = served_model(worker)  # an older vLLM: a plain load works before repacking

        def load(pairs: Pairs) -> None:
            model.load_weights(pairs)
        return load

    def _hf_config(self) -> Any:
        if self.hf_config is not None:
            return self.hf_config
        config = getattr(self.worker, "vllm_config", None) or getattr(self.worker, "model_config", None)
        model_config = getattr(config, "model_config", config)
        return getattr(model_config, "hf_config", None)

    def check(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ``SchemaMismatchError`` if these tensors do not fit the served model."""
        shapes = {name: tuple(t.shape) for name, t in pairs}
        key = frozenset(shapes.items())
        if key == self._checked:
            return
        if self._layout is False:
            hf_config = self._hf_config()
            self._layout = None if hf_config is None else checkpoint_layout(hf_config)
        if self._layout is not None:
            check_against_checkpoint(shapes, self._layout, self.where)
        self._checked = key

    def __call__(self, pairs: Pairs) -> None:
        materialised = list(pairs)  # views into the slot: no copy
        self.check(materialised)
        self._reload(materialised)
