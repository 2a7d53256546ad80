"""A trainer process for the LoRA fault tests: commits adapter versions 0..N-1 of
``vllm_model.peft_model`` (steps set by ``set_adapter``), then is killed by SIGKILL in the
middle of writing version N's slot.

    python lora_trainer.py DIRECTORY N
"""

from __future__ import annotations

import os
import signal
import sys

import vllm_model as vm

import weightsync as ws
from weightsync.transports.directory import writer


def main(directory: str, whole: int) -> None:
    model = vm.peft_model()
    sender = ws.VLLMDoubleBufferSyncScheme(directory, num_workers=1, adapter="policy").create_sender()
    sender.register_model(model)
    for step in range(whole):
        vm.set_adapter(model, step)
        assert sender.update_weights() == step
    print("committed", whole, flush=True)

    def die_halfway(layout, weights, data):  # the slot half written, the manifest untouched
        data[: data.numel() // 2].fill_(0x5A)
        os.kill(os.getpid(), signal.SIGKILL)

    writer.pack_with_checksums = die_halfway
    vm.set_adapter(model, whole)
    sender.update_weights()
    raise AssertionError("the trainer outlived its own SIGKILL")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
