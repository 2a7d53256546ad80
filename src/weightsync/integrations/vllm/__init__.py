"""weightsync for vLLM: keep a running engine's weights in sync with a trainer through a
double-buffered directory (``VLLMDoubleBufferSyncScheme``).

Two ways in, both tested against a real vLLM engine (see docs/vllm.md):

* the worker extension, with one driver-side call per update::

      llm = LLM(model=..., worker_extension_cls=EXTENSION_CLS)
      connect_engine(llm, "/dev/shm/policy")        # every worker loads the newest version
      version = update_engine(llm)                   # pause, load one version on every rank,
                                                     # reset the prefix cache, label, resume

* weightsync as a vLLM weight-transfer backend (``WeightTransferConfig(backend="weightsync")``),
  registered through the ``vllm.general_plugins`` entry point and driven with vLLM's own
  ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
  ``finish_weight_update`` calls (``weightsync.integrations.vllm.backend``).

* LoRA adapters alone (``VLLMDoubleBufferSyncScheme(directory, adapter="policy")`` in the
  trainer)::

      llm = LLM(model=..., enable_lora=True, max_lora_rank=16, worker_extension_cls=EXTENSION_CLS)
      request = update_adapter(llm, "/dev/shm/policy")   # the newest version, as policy-v<N>
      llm.generate(prompts, params, lora_request=request)

Importing this package does not import vLLM, and it registers the ``weightsync`` backend
with vLLM's factories (as importing ``backend`` does): at once where vLLM's factories are
imported already, else as soon as they are. So ``WeightTransferTrainerFactory.trainer_init``
finds it in any process, whichever of the two was imported first.
"""

from weightsync.integrations.vllm.adapters import adapter_versions, update_adapter
from weightsync.integrations.vllm.driver import connect_engine, engine_versions, update_engine
from weightsync.integrations.vllm.extension import EXTENSION_CLS, WeightSyncWorkerExtension
from weightsync.integrations.vllm.plugin import register_when_imported as _register

_register()

__all__ = [
    "EXTENSION_CLS",
    "WeightSyncWorkerExtension",
    "adapter_versions",
    "connect_engine",
    "engine_versions",
    "update_adapter",
    "update_engine",
]
