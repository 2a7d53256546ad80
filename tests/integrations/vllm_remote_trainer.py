"""A trainer process for the network-path tests: initialises a ``vllm serve`` at argv[1]
through the network path (listening at argv[2]), sends one update (perturb step 1), prints
"sent" and its label, then dies by SIGKILL in the next version (argv[3], where):
"mid-chunk" (default) in the middle of its stream; "after-pause" inside the take, once the
server paused; "after-load" inside the take, once the server loaded it (before the label).
argv[4]: the engine's timeout (default 60 s), which is also how long the server waits for a
take it was left inside."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import vllm_model as vm
from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from weightsync.integrations.vllm import server_take
from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo
from weightsync.transports.net import publisher as net_publisher
from weightsync.transports.net.wire import CHUNK_HEADER


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_mid_chunk(conn, seal, packed, index, kind, payload, figures) -> None:  # type: ignore[no-untyped-def]
    """The publisher's ``_send_chunk``, dying halfway through the chunk's bytes."""
    head = CHUNK_HEADER.pack(kind, payload.numel(), packed.checksums[index])
    conn.sendall(head + seal.sign(head))  # the tag does not matter: the host never gets that far
    conn.sendall(net_publisher.tensor_view(payload[: payload.numel() // 2]))
    die()


def main() -> None:
    url, address = sys.argv[1], sys.argv[2]
    where = sys.argv[3] if len(sys.argv) > 3 else "mid-chunk"
    timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 60.0
    trainer = vm.build_model()
    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, address=address, dtype="bfloat16", timeout=timeout),
        client=client, source=ModuleSource(trainer),
    )
    vm.perturb(trainer, 1)
    print("sent", engine.send_weights(), flush=True)
    if where == "mid-chunk":
        net_publisher.VersionPublisher._send_chunk = staticmethod(die_mid_chunk)  # type: ignore[method-assign]
    elif where == "after-pause":
        post = server_take.post

        def post_then_die(url: str, route: str, timeout: float, **params: str) -> None:
            post(url, route, timeout, **params)
            if route == "pause":
                die()

        server_take.post = post_then_die
    elif where == "after-load":
        finish = client.finish_weight_update

        def die_before_the_label(weight_version: Any = None) -> None:
            if weight_version is not None:  # the take's (a stage's finish names no label)
                die()
            finish()

        client.finish_weight_update = die_before_the_label  # type: ignore[method-assign]
    else:
        raise SystemExit(f"unknown place to die: {where}")
    vm.perturb(trainer, 2)
    engine.send_weights()


if __name__ == "__main__":
    main()
