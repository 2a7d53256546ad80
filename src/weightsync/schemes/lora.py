"""A peft model's LoRA adapter as the thing that travels: its tensors under the names vLLM's
LoRA loader expects (peft's saved names, ``base_model.model.<module>.lora_A.weight``), its
config (``adapter_config.json``'s content) and a guard that the base stayed as connected.

Duck-typed on peft's ``PeftModel`` (``peft_config``, ``active_adapter``); importing this
module does not import peft.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import torch

from weightsync.core.frozen import FrozenWeights
from weightsync.core.own_tensors import OwnTensors

logger = logging.getLogger(__name__)

#: slot header metadata: the name the adapter is served under, and its peft config (JSON)
ADAPTER_NAME_KEY = "weightsync.adapter"
ADAPTER_CONFIG_KEY = "weightsync.adapter_config"

#: a state-dict name of any adapter's LoRA weights (peft's layer attributes)
_ANY_LORA = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")

#: names an adapter may be served under: they become file and request names
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_adapter_name(name: object) -> str:
    """``name`` if it can name an adapter's versions (``policy`` -> ``policy-v7``)."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name):
        raise ValueError(f"adapter must be a name of letters, digits, '.', '_' or '-' (at most "
                         f"64, starting with a letter or digit), got {name!r}")
    return name


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # an enum (peft's PeftType, TaskType)
        return value.value
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def config_json(config: Any) -> str:
    """A peft config as ``adapter_config.json`` holds it."""
    obj = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.dumps(obj, default=_json_default, sort_keys=True)


def adapter_rank(config: dict[str, Any]) -> int:
    """The largest rank an adapter config asks for (``r`` and any ``rank_pattern`` entry)."""
    ranks = [config.get("r", 0), *(config.get("rank_pattern") or {}).values()]
    return max(int(r) for r in ranks)


class LoraAdapter:
    """The active LoRA adapter of ``model`` (a peft ``PeftModel``), served as ``name``.

    :meth:`tensors` returns the adapter's live tensors (no copy) and, from its first call
    on, refuses to return them once a base weight changed (:class:`BaseWeightChangedError`
    naming it): only the adapter travels, so a changed base would silently diverge."""

    def __init__(self, model: Any, name: str) -> None:
        self.name = check_adapter_name(name)
        configs = getattr(model, "peft_config", None)
        if not isinstance(model, torch.nn.Module) or not isinstance(configs, dict):
            raise TypeError(f"adapter={name!r}: register_model needs a peft model (PeftModel, "
                            f"from peft.get_peft_model), got {type(model).__name__}")
        active = getattr(model, "active_adapter", None)
        if isinstance(active, (list, tuple)):
            if len(active) != 1:
                raise ValueError(f"adapter={name!r}: the peft model has {len(active)} active "
                                 f"adapters {list(active)}; activate exactly one")
            active = active[0]
        config = configs.get(active)
        if config is None:
            raise ValueError(f"adapter={name!r}: the peft model has no config for its active "
                             f"adapter {active!r}")
        peft_type = str(getattr(getattr(config, "peft_type", None), "value", config.peft_type))
        if peft_type != "LORA":
            raise ValueError(f"adapter={name!r}: only LoRA adapters travel alone; the active "
                             f"adapter {active!r} is {peft_type}")
        for feature in ("use_dora", "modules_to_save"):
            if getattr(config, feature, None):
                raise ValueError(f"adapter={name!r}: {feature} is not supported (vLLM serves "
                                 "plain LoRA weights only)")
        self.model = model
        self.peft_name = str(active)
        self.config = config
        self.config_json = config_json(config)
        self._own = OwnTensors(model)  # walked once, walked again only if the tree changes
        self._split: tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        self._names = self._adapter_names(self._own.get(), self.peft_name)
        if not self._names:
            raise ValueError(f"adapter={name!r}: the peft model has no LoRA weights for "
                             f"adapter {active!r}")
        self._check_against_peft()
        self._guard: FrozenWeights | None = None

    @staticmethod
    def _adapter_names(own: dict[str, torch.Tensor], adapter: str) -> dict[str, str]:
        """Saved name -> state-dict name, for every LoRA weight of ``adapter``."""
        marker = re.compile(rf"\.(lora_A|lora_B)\.{re.escape(adapter)}\.weight$")
        return {marker.sub(r".\1.weight", name): name for name in own if marker.search(name)}

    def _check_against_peft(self) -> None:
        """Where peft is importable: the names must be exactly those it saves (anything else
        in the adapter, embeddings or extra modules, would be left behind)."""
        try:
            from peft import get_peft_model_state_dict
        except ImportError:
            return
        saved = set(get_peft_model_state_dict(self.model, adapter_name=self.peft_name))
        if saved != set(self._names):
            extra = sorted(saved - set(self._names))[:3]
            raise ValueError(f"adapter={self.name!r}: peft saves weights this sender cannot "
                             f"send alone (e.g. {extra}); only lora_A/lora_B of linear "
                             "layers travel")

    def metadata(self) -> dict[str, str]:
        """What every slot's header carries beside the tensors."""
        return {ADAPTER_NAME_KEY: self.name, ADAPTER_CONFIG_KEY: self.config_json}

    @property
    def rank(self) -> int:
        return adapter_rank(json.loads(self.config_json))

    def _parts(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(adapter by saved name, base by state-dict name), split again only when the
        module tree changed (:class:`OwnTensors` hands back the same dict until then)."""
        own = self._own.get()
        if self._split is None or self._split[0] != id(own):
            missing = [n for n in self._names.values() if n not in own]
            if missing:
                raise ValueError(f"adapter={self.name!r}: the peft model lost {missing[0]!r} "
                                 "since register_model")
            # the parameters themselves: a send detaches them then, seeing ``.data`` swaps
            adapter = {saved: own[name] for saved, name in self._names.items()}
            # the base: all but LoRA weights (this adapter's, and any other the model holds)
            base = {name: t for name, t in own.items() if not _ANY_LORA.search(name)}
            self._split = (id(own), adapter, base)
        return self._split[1], self._split[2]

    def tensors(self, *, guard: bool = True) -> dict[str, torch.Tensor]:
        """The adapter's weights by saved name (the live parameters, not to be modified:
        the same dict while the module tree is unchanged). With ``guard``: the first call records the
        base, each later one checks it is unchanged (raising before anything is returned)."""
        adapter, base = self._parts()
        if guard:
            if self._guard is None:
                self._guard = FrozenWeights(base)
                logger.debug("adapter %r: guarding %d base tensors", self.name, len(self._guard))
            else:
                self._guard.check(base)
        return adapter
