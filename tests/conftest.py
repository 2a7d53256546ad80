"""Shared fixtures: process contexts, worker start/stop that never hang."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from workers import StopFlag

import weightsync as ws

#: Processes started without a context of their own (TorchRL's collector workers among
#: them, which TorchRL would spawn) come from a fork server that imported torch, TorchRL
#: and weightsync once: a spawned worker imports them again, 10-13 s of CPU each on two
#: cores (TorchRL's peer suite: 370 s spawned, 49 s from the fork server, alone). As with
#: spawn, they inherit nothing of the test's process and get their arguments pickled.
#: Set before TorchRL's import, which would set "spawn". The server starts at the first such
#: process, with the environment of that moment (no test here changes it for longer than
#: its own processes live). ``WEIGHTSYNC_TEST_START_METHOD=spawn`` starts them as TorchRL
#: does by default.
START_METHOD = os.environ.get("WEIGHTSYNC_TEST_START_METHOD", "forkserver")
FORKSERVER_PRELOAD = ["torch", "tensordict", "torchrl", "torchrl.collectors", "torchrl.envs",
                      "gymnasium", "weightsync"]
if mp.get_start_method(allow_none=True) is None:
    mp.set_start_method(START_METHOD)
    if START_METHOD == "forkserver":
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)


def _zero_copy_scheme(*args: Any, **kwargs: Any) -> ws.SharedMemWeightSyncScheme:
    """SharedMem whose receivers default to zero-copy (weights are views into the slot)."""
    return ws.SharedMemWeightSyncScheme(*args, zero_copy=True, **kwargs)


def _net_scheme(*args: Any, **kwargs: Any) -> ws.NetWeightSyncScheme:
    """The network scheme on this host's loopback (a free port chosen at creation)."""
    return ws.NetWeightSyncScheme(*args, address="127.0.0.1:0", **kwargs)


def _directory_scheme(*args: Any, **kwargs: Any) -> ws.VLLMDoubleBufferSyncScheme:
    """The directory scheme in a fresh private directory of /dev/shm (removed after the
    test by the ``scheme_cls`` fixture)."""
    import tempfile

    path = tempfile.mkdtemp(prefix="ws-suite-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    _SUITE_DIRS.append(path)
    return ws.VLLMDoubleBufferSyncScheme(path, *args, **kwargs)


_SUITE_DIRS: list[str] = []


SCHEMES = {
    "shm": ws.SharedMemWeightSyncScheme,
    "shm-zero-copy": _zero_copy_scheme,
    "mp": ws.MultiProcessWeightSyncScheme,
    "net": _net_scheme,
    "directory": _directory_scheme,
}


@pytest.fixture(params=sorted(SCHEMES))
def scheme_cls(request: pytest.FixtureRequest) -> Iterator[Any]:
    yield SCHEMES[request.param]
    import shutil

    while _SUITE_DIRS:
        shutil.rmtree(_SUITE_DIRS.pop(), ignore_errors=True)


class MergedQueue:
    """One ``multiprocessing.Queue`` per worker, read as one: a worker SIGKILLed while
    holding its queue's write lock must not block the others' messages."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")  # usable by children of every start method
        self.queues: list[Any] = []

    def new(self) -> Any:
        q = self._ctx.Queue()
        self.queues.append(q)
        return q

    def get(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            for q in self.queues:
                try:
                    return q.get_nowait()
                except queue.Empty:
                    pass
            if time.monotonic() >= deadline:
                raise queue.Empty
            time.sleep(0.002)

    def empty(self) -> bool:
        return all(q.empty() for q in self.queues)

    def close(self) -> None:
        for q in self.queues:
            q.close()
            q.cancel_join_thread()


class Workers:
    """Starts worker processes and makes sure none outlives the test."""

    def __init__(self, method: str = "fork") -> None:
        self.ctx = mp.get_context(method)
        self.out = MergedQueue()
        self.stop = StopFlag()
        self.procs: dict[int, Any] = {}

    def start(self, target: Any, scheme: Any, idx: int, *args: Any, method: str | None = None) -> Any:
        ctx = mp.get_context(method) if method else self.ctx
        proc = ctx.Process(
            target=target, args=(scheme, idx, self.out.new(), self.stop, *args), daemon=True
        )
        proc.start()
        self.procs[idx] = proc
        return proc

    def kill(self, idx: int) -> None:
        proc = self.procs[idx]
        proc.kill()
        _wait_exit(proc, 10)

    def close(self) -> None:
        self.stop.set()
        for proc in self.procs.values():
            _wait_exit(proc, 5)
            if proc.is_alive():
                proc.kill()
                _wait_exit(proc, 5)
        self.out.close()


def _wait_exit(proc: Any, timeout: float) -> None:
    """Wait for ``proc`` to exit by its pid, not by ``join()``'s pipe, which a child it
    forked inherits and keeps open after it died."""
    deadline = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture
def workers() -> Iterator[Workers]:
    pool = Workers()
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _single_thread_torch() -> None:
    torch.set_num_threads(1)


# ---------------------------------------------------------------------- test tiers
#: Tests that only the full run takes (`bash scripts/run.sh test-all`, what CI runs): the
#: peer suite (TorchRL's own tests on our schemes), the two-host Ray clusters and `vllm
#: serve` on a second host (network namespaces), Ray's one-node and sharded suites,
#: the writer/reader suite's Ray cases, TorchRL's collectors (the network scheme's
#: collector test among them), RayCollector and AsyncVLLM, `vllm serve` with LoRA, vLLM
#: tensor parallelism, the transformers end-to-end run, the sharded directory suite, a pool
#: of hosts relaying versions, the rank conformance suite on the directory, Ray and the
#: network path, the load into a shadow on an in-process engine, benches, demos and
#: examples, and the single cases below. The README's
#: default command
#: (`bash scripts/run.sh test`) leaves them out so that it ends within 15 minutes in a
#: fresh clone on two cores. What stays: the same-host contract suite
#: (`tests/schemes/test_local_schemes.py`) on every scheme in `SCHEMES` above, SharedMem,
#: MultiProcess and the network scheme (`NetWeightSyncScheme`, on loopback) among them;
#: the writer/reader suite (`tests/transports/test_endpoints.py`) on every family but Ray;
#: `NetWeightSyncScheme` across two hosts (network namespaces; skipped without root); the
#: directory; the network path's pieces over loopback; Ray (two delta cases with real
#: actors, the rest without a cluster); the rank conformance suite on SharedMem (and the
#: directory's and the network path's own rank faults); a real vLLM engine, the `vllm
#: serve` backend's registration, LoRA, and TorchRL's LLM scheme. Chosen from
#: `--durations` of a full run.
FULL_TIER: tuple[str, ...] = (
    "tests/torchrl_compat/",
    "tests/integrations/test_vllm_serve_remote.py",
    "tests/integrations/test_vllm_serve_lora.py",
    "tests/integrations/test_vllm_serve_lora_remote.py",
    "tests/schemes/test_ray_multihost.py",
    "tests/schemes/test_ray_delta_multihost.py",
    "tests/integrations/test_torchrl_ray_multihost.py",
    "tests/schemes/test_ray_scheme.py",
    "tests/schemes/test_sharded_ray.py",
    "tests/integrations/test_torchrl_ray.py",
    "tests/integrations/test_torchrl_collectors.py",
    "tests/integrations/test_torchrl_async_vllm.py",
    "tests/integrations/test_torchrl_demo.py",
    "tests/integrations/test_vllm_tensor_parallel.py",
    "tests/integrations/test_transformers_end_to_end.py",
    "tests/schemes/test_sharded_directory.py",
    "tests/test_demo_llm.py",
    "tests/test_demo.py",
    "tests/test_examples.py",
    "tests/test_bench.py",
    "tests/test_bench_lora.py",
    "tests/test_bench_delta.py",
    "tests/transports/test_net_relay.py",  # a pool of hosts (two hosts relay in the default)
    "tests/integrations/test_vllm_prepared_load.py",  # an engine of its own, in-process
)
#: single cases of the full tier: (module, a piece of the test id)
FULL_TIER_CASES: tuple[tuple[str, str], ...] = (
    # a rank lost and restarted on the network path (~10 s: two rank processes start)
    ("tests/transports/test_net_sharded.py", "test_a_lost_rank_fails"),
    ("tests/transports/test_net_sharded.py", "test_a_rank_that_dies_while"),
    ("tests/transports/test_net_sharded.py", "test_a_rank_that_stalls_while"),
    ("tests/transports/test_net_sharded.py", "test_a_server_that_fails"),
    # the vLLM trainer engine with two ranks (~30 s: a second rank process imports vLLM)
    ("tests/integrations/test_vllm_backend_sharded.py", "test_two_engine_ranks"),
    ("tests/faults/test_rank_protocol.py", "[ray"),  # the conformance suite on Ray
    # the writer/reader suite on Ray (~50 s: a Ray instance, its actors, a rendezvous
    # actor per writer); its other families stay
    ("tests/transports/test_endpoints.py", "[ray"),
    ("tests/faults/test_rank_protocol.py", "[directory"),  # and on the directory
    ("tests/faults/test_rank_protocol.py", "[net"),  # and on the network path
    # a real `vllm serve` (the default keeps vLLM engines in-process and its registration)
    ("tests/integrations/test_vllm_serve.py", "through_a_directory"),
    ("tests/integrations/test_vllm_serve.py", "cached_before_an_update"),
    # TorchRL's LLM stack on a vLLM engine (its scheme's construction stays)
    ("tests/integrations/test_torchrl_llm.py", "test_llm_"),
    # Ray with deltas: one case (a replacement actor, whole chunks then deltas) stays
    ("tests/schemes/test_ray_delta.py", "test_dtype_alone"),
    ("tests/schemes/test_ray_delta.py", "test_delta_accounting"),
    ("tests/schemes/test_ray_delta.py", "test_corrupted_delta"),
    ("tests/schemes/test_ray_delta.py", "test_headers_no_sender"),
    # one of each pair stays
    ("tests/faults/test_sharded_shm_faults.py", "as_fast_as_they_can[False"),
    ("tests/faults/test_local_faults.py", "keeps_its_socket_can_restart[mp"),
)


def in_full_tier(nodeid: str) -> bool:
    return nodeid.startswith(FULL_TIER) or any(
        nodeid.startswith(module) and piece in nodeid for module, piece in FULL_TIER_CASES)


# ---------------------------------------------------------------------- parallel lanes
#: `scripts/run.sh` runs the suite on two pytest-xdist workers (``-n 2 --dist loadscope``):
#: a single run keeps about 0.7 of two cores busy on average (its processes often wait on
#: each other). Work is handed out by lane (:class:`LaneScheduling`): each module is a lane
#: of its own, run whole by one worker, so its module-scoped clusters and servers start
#: once. The modules below share the "vllm" lane: they use the session's shared vLLM engine
#: (``served``, tests/integrations/conftest.py), which then starts once, not once per worker.
VLLM_LANE: tuple[str, ...] = (
    "tests/integrations/test_torchrl_llm.py",
    "tests/integrations/test_vllm_backend.py",
    "tests/integrations/test_vllm_extension.py",
    "tests/integrations/test_vllm_sharded_trainer.py",
)
#: The "ray" lane: every test that starts a Ray cluster and keeps it for more than a few
#: seconds, so that one worker runs them one after the other and two Ray clusters never
#: share the two cores. Beside another worker's Ray cluster, Ray's actors and rank
#: processes missed their 60-120 s start-up deadlines (two CI runs, five Ray tests).
RAY_LANE: tuple[str, ...] = (
    "tests/torchrl_compat/test_distributed.py",
    "tests/schemes/test_ray_scheme.py",
    "tests/schemes/test_sharded_ray.py",
    "tests/schemes/test_ray_delta.py",
    "tests/schemes/test_ray_multihost.py",
    "tests/schemes/test_ray_delta_multihost.py",
    "tests/integrations/test_torchrl_ray.py",
    "tests/integrations/test_torchrl_ray_multihost.py",
    "tests/integrations/test_torchrl_async_vllm.py",
)
#: single cases of other modules that join the "ray" lane: (module, a piece of the test id)
RAY_LANE_CASES: tuple[tuple[str, str], ...] = (
    ("tests/transports/test_endpoints.py", "[ray"),
    ("tests/integrations/test_torchrl_collectors.py", "test_ray_collector"),
)
#: Tests that measure against the clock or against the whole machine (an accept flood under
#: a low open-file limit, a thousand tear-free reads while ranks write flat out, nothing new
#: left in /dev/shm; Ray's rank processes, whose board calls on the rendezvous actor gave up
#: after their 5 s while the other worker started vLLM at the start of a parallel run):
#: `scripts/run.sh` runs them after the parallel part, alone.
SERIAL: tuple[tuple[str, str], ...] = (
    ("tests/faults/test_rank_protocol.py", "[ray"),
    ("tests/transports/test_local_listener.py", "accept_flood"),
    ("tests/transports/test_net_listener.py", "accept_flood"),
    ("tests/schemes/test_local_schemes.py", "leave_nothing_behind"),
    ("tests/schemes/test_local_schemes.py", "hammer"),
    ("tests/faults/test_sharded_shm_faults.py", "as_fast_as_they_can"),
    ("tests/faults/test_sharded_directory_faults.py", "test_killed_rank"),
)


#: The longest lanes (minutes each on two cores, from ``--durations`` of a parallel run),
#: longest first: they are handed out before every other lane, so that none of them starts
#: last and runs alone at the end while the other worker idles.
LONGEST_LANES: tuple[str, ...] = (
    "ray",
    "tests/integrations/test_vllm_serve_remote.py",
    "tests/torchrl_compat/test_collectors.py",
    "vllm",
    "tests/integrations/test_vllm_serve_lora_remote.py",
    "tests/faults/test_rank_protocol.py",
    "tests/test_demo_llm.py",
    "tests/test_examples.py",
    "tests/integrations/test_vllm_serve.py",
    "tests/integrations/test_torchrl_collectors.py",
)


def lane(nodeid: str) -> str:
    """The lane of a test: its module, or the shared lane its module belongs to."""
    module = nodeid.split("::", 1)[0]
    if module.startswith(VLLM_LANE):
        return "vllm"
    if module.startswith(RAY_LANE) or any(
            module == name and piece in nodeid for name, piece in RAY_LANE_CASES):
        return "ray"
    return module


def lane_rank(item: pytest.Item) -> int:
    """Where a test's lane comes in the hand-out: the longest lanes first, in their order."""
    name = lane(item.nodeid)
    return LONGEST_LANES.index(name) if name in LONGEST_LANES else len(LONGEST_LANES)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` hands out lanes (pytest-xdist's own ``loadgroup`` cannot group
    under pytest 9, which ignores the node ids it rewrites)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the lanes come in the order the tests are sorted

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return LaneScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lane_rank)  # stable: each module's tests keep their order
    for item in items:
        if in_full_tier(item.nodeid):
            item.add_marker(pytest.mark.full)
        if any(item.nodeid.startswith(module) and piece in item.nodeid
               for module, piece in SERIAL):
            item.add_marker(pytest.mark.serial)
