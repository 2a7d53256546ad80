"""A trainer process for the network-path tests: initialises a ``vllm serve`` at argv[1]
through the network path (listening at argv[2]), sends one update (perturb step 1), prints
"sent" and its label, then dies by SIGKILL in the middle of the next version's stream."""

from __future__ import annotations

import os
import signal
import sys

import vllm_model as vm
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo
from weightsync.transports.net import publisher as net_publisher
from weightsync.transports.net.wire import CHUNK_HEADER


def die_mid_chunk(conn, seal, packed, index, kind, payload, figures) -> None:  # type: ignore[no-untyped-def]
    """The publisher's ``_send_chunk``, dying halfway through the chunk's bytes."""
    head = CHUNK_HEADER.pack(kind, payload.numel(), packed.checksums[index])
    conn.sendall(head + seal.sign(head))  # the tag does not matter: the host never gets that far
    conn.sendall(net_publisher.tensor_view(payload[: payload.numel() // 2]))
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    url, address = sys.argv[1], sys.argv[2]
    trainer = vm.build_model()
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, address=address, dtype="bfloat16"),
        client=HTTPVLLMWeightSyncClient(url, timeout=120), source=ModuleSource(trainer),
    )
    vm.perturb(trainer, 1)
    print("sent", engine.send_weights(), flush=True)
    net_publisher.VersionPublisher._send_chunk = staticmethod(die_mid_chunk)  # type: ignore[method-assign]
    vm.perturb(trainer, 2)
    engine.send_weights()


if __name__ == "__main__":
    main()
