"""vLLM's client protocol for a trainer engine (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) over an in-process
``vllm.LLM``, for a trainer that runs its engine in its own process."""

from __future__ import annotations

from typing import Any


class OfflineLLMClient:
    """vLLM's four-call weight-sync client protocol over an in-process ``LLM``, with the
    steps an update needs around it: pause generation ("wait": requests in flight finish
    on the old weights), and after loading, reset the prefix cache, set the version label
    and resume."""

    def __init__(self, llm: Any, mode: str = "wait") -> None:
        self.llm = llm
        self.mode = mode

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        self.llm.reset_prefix_cache()

    def start_weight_update(self) -> None:
        self.llm.sleep(level=0, mode=self.mode)
        try:
            self.llm.start_weight_update()
        except BaseException:
            self.llm.wake_up(tags=["scheduling"])
            raise

    def update_weights(self, update_info: Any) -> None:
        try:
            self.llm.update_weights({"update_info": update_info})
        except BaseException:
            self.llm.wake_up(tags=["scheduling"])
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        try:
            self.llm.finish_weight_update(weight_version=weight_version)
            self.llm.reset_prefix_cache()
        finally:
            self.llm.wake_up(tags=["scheduling"])
