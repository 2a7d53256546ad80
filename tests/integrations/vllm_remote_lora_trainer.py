"""A trainer process for the LoRA network-path tests: initialises a ``vllm serve
--enable-lora`` at argv[1] in adapter mode (listening at argv[2]), sends adapter version 1
(``set_adapter`` step 1), prints "sent" and its label, then dies by SIGKILL in the middle of version 2's
stream."""

from __future__ import annotations

import sys

import vllm_model as vm
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm_lora_serve import adapter_engine
from vllm_remote_trainer import die_mid_chunk

from weightsync.transports.net import publisher as net_publisher


def main() -> None:
    url, address = sys.argv[1], sys.argv[2]
    model = vm.peft_model()
    engine = adapter_engine(model, HTTPVLLMWeightSyncClient(url, timeout=120), address=address)
    vm.set_adapter(model, 1)
    print("sent", engine.send_weights(), flush=True)
    net_publisher.VersionPublisher._send_chunk = staticmethod(die_mid_chunk)  # type: ignore[method-assign]
    vm.set_adapter(model, 2)
    engine.send_weights()


if __name__ == "__main__":
    main()
