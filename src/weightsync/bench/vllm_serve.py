"""``weightsync bench --transports vllm-serve``: a Llama-shaped fp32 model, sent as bf16 to
a real ``vllm serve`` (CPU build) on the second host of a two-host network (network
namespaces; the server has its own /dev/shm and /tmp), over a link capped at each rate.
In one run, side by side, each timed until the server serves the version:

* the floor: the bf16 bytes over one bare TCP connection, plus the engine's own
  ``reload_weights`` of those tensors from memory;
* the naive way without a shared file system: save a bf16 checkpoint, copy it to the
  server's host over the link, have the server reload it from its disk (dev
  ``/collective_rpc``);
* weightsync's network path: a full update, and a delta after one AdamW step (the fraction
  of bf16 words the step left unchanged is reported).
"""

from __future__ import annotations

import contextlib
import io
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from weightsync.bench.rows import BenchRow, make_row, percentile
from weightsync.units import format_duration

BF16 = torch.bfloat16
LR = 2e-6
PORT = 8000
WORKER_EXTENSION = "weightsync.bench.vllm_serve_worker.BenchWorkerExtension"
#: vLLM's budget of tokens per engine step: after an in-flight take every running request
#: recomputes its KV (a prefill of its whole context); in chunks of this many tokens the
#: first request's next token comes after its own context, not after all of them
#: (docs/vllm.md, "The recompute after a take")
PREFILL_BUDGET = 64


def llama_config(nbytes: int) -> Any:
    """A Llama whose fp32 weights take about ``nbytes`` (hidden 768, untied embeddings of a
    32k vocabulary, or a smaller one so that they take at most half, as many layers as
    fit)."""
    import transformers

    hidden, inter = 768, 2048
    vocab = max(256, min(32000, nbytes // 4 // 2 // (2 * hidden)))
    per_layer = 2 * hidden * hidden + 2 * hidden * 256 + 3 * hidden * inter + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, (nbytes // 4 - fixed) // per_layer)
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256,
        tie_word_embeddings=False, initializer_range=0.02)


@dataclass
class Case:
    label: str
    times: list[float] = field(default_factory=list)
    wire_bytes: list[int] = field(default_factory=list)
    unchanged: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    def add_phases(self, phases: dict[str, float]) -> None:
        for name, seconds in phases.items():
            self.phases.setdefault(name, []).append(seconds)


def _serve_bytes(listener: socket.socket, header: dict[str, Any], payload: torch.Tensor) -> int:
    """Send ``header`` and ``payload`` to the one peer that connects; wait for its ack."""
    from weightsync.transports.net.wire import recv_exact, send_frame, tensor_view

    conn, _ = listener.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send_frame(conn, header)
        conn.sendall(tensor_view(payload))
        recv_exact(conn, 1)
    return int(payload.numel())


def _rpc(server: Any, method: str, payload: tuple[dict[str, Any], torch.Tensor],
         listen_host: str) -> dict[str, float]:
    """Call ``method`` on the server's workers while this process serves them the bytes."""
    with socket.create_server((listen_host, 0)) as listener:
        listener.settimeout(600)
        address = f"{listen_host}:{listener.getsockname()[1]}"
        result: dict[str, Any] = {}

        def call() -> None:
            try:
                result["reply"] = server.post("collective_rpc", {"method": method, "args": [address]})
            except BaseException as exc:  # raised below, in the caller's thread
                result["error"] = exc

        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        _serve_bytes(listener, *payload)
        thread.join(600)
    if "error" in result:
        raise RuntimeError(f"{method} failed: {result['error']}\n{server.log()}")
    return dict(result["reply"]["results"][0])


def _adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One AdamW step on gradient noise; returns the fraction of bf16 words unchanged."""
    before = [p.detach().to(BF16) for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    same = total = 0
    for old, p in zip(before, model.parameters(), strict=True):
        same += int((old.view(torch.int16) == p.detach().to(BF16).view(torch.int16)).sum())
        total += old.numel()
    return same / max(total, 1)


def trainer_steps(model: torch.nn.Module) -> Callable[[], None]:
    """An AdamW step per call (fused, on one fixed gradient), as cheap as a trainer's step
    can be on a CPU: here the trainer shares the server's machine, and the in-flight bench
    measures what an update costs generation, not the trainer's arithmetic (the unfused
    step with fresh noise and ``_adamw_step``'s word count took 1.3-1.9 s of a core each)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    gradients = [torch.randn_like(p) for p in model.parameters()]

    def step() -> None:
        for p, gradient in zip(model.parameters(), gradients, strict=True):
            p.grad = gradient
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _engine(model: torch.nn.Module, url: str, address: str, delta: bool,
            pause: str = "keep") -> Any:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, address=address, dtype="bfloat16", delta=delta,
                                  timeout=600, pause=pause),
        client=HTTPVLLMWeightSyncClient(url, timeout=600), source=ModuleSource(model))


def _measure(server: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             repeats: int, rate: str, progress: Callable[[str], None] | None,
             listen_host: str) -> list[Case]:
    from safetensors.torch import save

    from weightsync.transports.net.packed import plan

    link = f"link {rate}"
    floor, naive = Case(f"floor (bare TCP + reload from memory, {link})"), \
        Case(f"naive (save, copy, reload from disk, {link})")
    full, delta = Case(f"weightsync full ({link})"), Case(f"weightsync delta ({link})")
    reused: torch.Tensor | None = None  # the floor packs into one warm buffer, as weightsync
    for label, case in (("floor", floor), ("naive", naive)):
        if progress:
            progress(f"vllm-serve {label} {rate}")
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            if case is floor:
                state = dict(model.state_dict())
                packed = plan(state, 0, BF16, reused)
                packed.fill(state)
                reused = packed.buffer
                payload = (packed.header("bench"), packed.buffer)
            else:
                state = {k: v.detach().to(BF16).contiguous() for k, v in model.state_dict().items()}
                raw = save(state)  # the checkpoint a trainer writes (bytes of a .safetensors)
                del state
                payload = ({"nbytes": len(raw)}, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                del raw
            made = time.perf_counter() - t0
            phases = _rpc(server, f"bench_{label}", payload, listen_host)
            elapsed = time.perf_counter() - t0
            if i:
                case.times.append(elapsed)
                case.wire_bytes.append(int(payload[1].numel()))
                case.add_phases({"prepare": made, **phases})
    for case, on in ((full, False), (delta, True)):
        if progress:
            progress(f"vllm-serve weightsync {'delta' if on else 'full'} {rate}")
        engine = _engine(model, server.url, f"{listen_host}:0", on)
        try:
            for i in range(repeats + 1):
                unchanged = _adamw_step(model, optimizer)
                t0 = time.perf_counter()
                engine.send_weights()
                elapsed = time.perf_counter() - t0
                if i:
                    last = engine.stats()["last"]
                    case.times.append(elapsed)
                    case.wire_bytes.append(int(last["wire_bytes"]))
                    case.unchanged.append(unchanged)
                    case.add_phases({"pack": last["pack_seconds"]})
        finally:
            engine.shutdown()
    return [floor, naive, full, delta]


def run_vllm_serve_bench(
    size: str, nbytes: int, rates: Sequence[str], repeats: int,
    progress: Callable[[str], None] | None = None, interval: float = 5.0,
) -> tuple[list[BenchRow], str]:
    """Rows against the floor of each link rate, and the tables with the delta figures and
    the in-flight ones (``vllm_inflight``: ``repeats`` updates of each kind under three
    streams, each opening a window of ``interval`` seconds, quiet windows as long between
    them)."""
    from weightsync.bench.multihost import ADDRESS_A, ADDRESS_B, parse_link_rate, two_host_network
    from weightsync.bench.vllm_inflight import in_flight_table, measure_in_flight
    from weightsync.bench.vllm_server import VLLMServer

    for rate in rates:
        parse_link_rate(rate)
    import transformers

    torch.manual_seed(0)
    config = llama_config(nbytes)
    model = transformers.LlamaForCausalLM(config).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    work = Path(tempfile.mkdtemp(prefix="ws-bench-vllm-", dir="/var/tmp"))
    model.save_pretrained(work / "model", safe_serialization=True)
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    results: list[tuple[str, list[Case]]] = []
    in_flight: list[Any] = []
    with two_host_network() as hosts, contextlib.ExitStack() as stack:
        hosts.enter("a")
        server = VLLMServer(str(work / "model"), host=ADDRESS_B, port=PORT, netns=hosts.ns_b,
                            extra=("--worker-extension-cls", WORKER_EXTENSION,
                                   "--max-model-len", "256", "--enable-scale-out",
                                   "--max-num-batched-tokens", str(PREFILL_BUDGET)))
        stack.callback(server.stop)
        stack.callback(shutil.rmtree, work, True)
        server.start().wait_ready(600)
        steps = trainer_steps(model)
        for rate in rates:
            hosts.shape_link(rate)
            results.append((rate, _measure(server, model, optimizer, repeats, rate, progress,
                                           ADDRESS_A)))

            def make_engine(delta: bool, pause: str) -> Any:
                return _engine(model, server.url, f"{ADDRESS_A}:0", delta, pause)

            in_flight.append(measure_in_flight(
                server, model, steps, make_engine, rate, repeats, interval, progress))
            hosts.unshape_link()
    rows, out = [], io.StringIO()
    for rate, cases in results:
        floor = statistics.median(cases[0].times)
        for case in cases:
            rows.append(make_row(f"vllm-serve {case.label}", size, fp32_bytes // 2, 1, case.times,
                                 floor, "bare TCP + reload"))
        print(case_table(rate, cases, fp32_bytes), file=out)
    print(f"In flight: three streams generate while windows of {interval:g}s with one update "
          f"at their start (a fused AdamW step, then the send) alternate with windows of "
          f"{interval:g}s without:", file=out)
    print(in_flight_table(in_flight), file=out)
    return rows, out.getvalue()


def case_table(rate: str, cases: Sequence[Case], fp32_bytes: int) -> str:
    floor, _naive, full = (statistics.median(c.times) for c in cases[:3])
    lines = [f"link {rate}, {fp32_bytes / 1e6:.0f} MB fp32 sent as bf16:",
             "| path | until served: median | p90 | x floor | x full | wire bytes | "
             "unchanged bf16 words | phases (median) |", "|" + "---|" * 8]
    for c in cases:
        median = statistics.median(c.times)
        unchanged = f"{100 * statistics.median(c.unchanged):.2f}%" if c.unchanged else ""
        phases = ", ".join(f"{k} {format_duration(statistics.median(v))}"
                           for k, v in c.phases.items())
        lines.append(f"| {c.label} | {format_duration(median)} | "
                     f"{format_duration(percentile(c.times, 0.9))} | {median / floor:.2f} | "
                     f"{median / full:.2f} | {statistics.median(c.wire_bytes) / 1e6:.1f} MB | "
                     f"{unchanged} | {phases} |")
    return "\n".join(lines) + "\n"
