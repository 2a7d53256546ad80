# Copyright (c) Meta Platforms, Inc. and affiliates.
#
# This source code is licensed under the MIT license found in the
# LICENSE file in this directory (TorchRL's LICENSE, copied with these files).
#
# Copied from pytorch/rl test/test_distributed.py at commit ae9719f17b1517af5c2523a36c4616f003ee55cf
# (TorchRL 0.14.x): only the weight-sync tests and the module-level helpers they use;
# the tests themselves are unchanged. TestRayCollector's base class loses only its
# test_distributed_collector_sync (TestRayCollector overrides it; it names a class not copied).
# Of TestRayCollector, the tests left out are those with no policy weights to move
# (replay buffers, the private trainer-execution and DDP-stepper checks). conftest.py runs them on weightsync's schemes.
from __future__ import annotations
import abc
import argparse
import importlib
import os
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial
import pytest
import torch
import torch.distributed as dist
from tensordict import NestedKey, TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from torch import multiprocessing as mp, nn
from torchrl import service_backend
from torchrl._utils import logger as torchrl_logger
from torchrl.checkpoint import Checkpoint
from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.collectors.distributed import RayCollector
from torchrl.collectors.distributed.ray import DEFAULT_RAY_INIT_CONFIG
from torchrl.data import LazyTensorStorage, RayReplayBuffer, TensorDictReplayBuffer
from torchrl.modules import RandomPolicy
from torchrl.modules.inference_server import InferenceServer
from torchrl.objectives import LossModule
from torchrl.objectives.utils import TargetNetUpdater
from torchrl.testing.dist_utils import assert_no_new_python_processes, snapshot_python_processes
from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv, CountingEnv
from torchrl.trainers._ray_execution import _RayTrainerExecution
from torchrl.trainers.algorithms import DDPGTrainer, DQNTrainer, SACTrainer, TD3Trainer


_has_ray = importlib.util.find_spec("ray") is not None


if _has_ray:
    import ray


TIMEOUT = 200


if sys.platform.startswith("win"):
    pytest.skip("skipping windows tests in windows", allow_module_level=True)


class CountingPolicy(TensorDictModuleBase):
    """A policy for counting env.

    Returns a step of 1 by default but weights can be adapted.

    """

    def __init__(self):
        weight = 1.0
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(weight))
        self.in_keys = []
        self.out_keys = ["action"]

    def forward(self, tensordict):
        tensordict.set("action", self.weight.expand(tensordict.shape).clone())
        return tensordict


class MismatchedCountingPolicy(CountingPolicy):
    def __init__(self):
        super().__init__()
        self.unexpected = nn.Parameter(torch.ones(()))


class ScalarRayLoss(LossModule):
    @dataclass
    class _AcceptedKeys:
        reward: NestedKey = "reward"
        done: NestedKey = "done"
        terminated: NestedKey = "terminated"
        action: NestedKey = "action"

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, tensordict):
        value = tensordict.get("value", None)
        if value is None:
            value = tensordict["observation"].float()
        return TensorDict({"loss": self.weight * value.mean()}, batch_size=[])


class CountingTargetUpdater(TargetNetUpdater):
    def __init__(self, loss_module):
        self.loss_module = loss_module
        self.calls = 0

    def step(self):
        self.calls += 1

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state_dict):
        self.calls = state_dict["calls"]


class DistributedCollectorBase:
    @classmethod
    @abc.abstractmethod
    def distributed_class(self) -> type:
        raise ImportError

    @classmethod
    @abc.abstractmethod
    def distributed_kwargs(self) -> dict:
        raise ImportError

    @classmethod
    @abc.abstractmethod
    def _start_worker(cls):
        raise NotImplementedError

    @classmethod
    def _test_distributed_collector_basic(cls, queue, frames_per_batch):
        try:
            cls._start_worker()
            env = ContinuousActionVecMockEnv
            policy = RandomPolicy(env().action_spec)
            torchrl_logger.info("creating collector")
            collector = cls.distributed_class()(
                [env] * 2,
                policy,
                total_frames=1000,
                frames_per_batch=frames_per_batch,
                **cls.distributed_kwargs(),
            )
            total = 0
            for data in collector:
                total += data.numel()
                assert data.numel() == frames_per_batch
            assert data.names[-1] == "time"
            assert total == 1000
            queue.put(("passed", None))
        except Exception as e:
            tb = traceback.format_exc()
            queue.put(("not passed", (e, tb)))
        finally:
            collector.shutdown()

    @pytest.mark.parametrize("frames_per_batch", [50, 100])
    def test_distributed_collector_basic(self, frames_per_batch):
        """Basic functionality test."""
        queue = mp.Queue(1)
        proc = mp.Process(
            target=self._test_distributed_collector_basic,
            args=(queue, frames_per_batch),
        )
        proc.start()
        try:
            out, maybe_err = queue.get(timeout=TIMEOUT)
            if out != "passed":
                raise RuntimeError(f"Error with stack {maybe_err[1]}") from maybe_err[0]
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
            queue.close()

    @classmethod
    def _test_distributed_collector_mult(cls, queue, frames_per_batch):
        try:
            cls._start_worker()
            env = ContinuousActionVecMockEnv
            policy = RandomPolicy(env().action_spec)
            collector = cls.distributed_class()(
                [env] * 2,
                policy,
                total_frames=1000,
                frames_per_batch=frames_per_batch,
                **cls.distributed_kwargs(),
            )
            total = 0
            for data in collector:
                total += data.numel()
                assert data.numel() == frames_per_batch
            collector.shutdown()
            assert total == -frames_per_batch * (1000 // -frames_per_batch)
            queue.put(("passed", None))
        except Exception as e:
            tb = traceback.format_exc()
            queue.put(("not passed", (e, tb)))

    def test_distributed_collector_mult(self, frames_per_batch=200):
        """Testing multiple nodes."""
        time.sleep(1.0)
        queue = mp.Queue(1)
        proc = mp.Process(
            target=self._test_distributed_collector_mult,
            args=(queue, frames_per_batch),
        )
        proc.start()
        try:
            out, maybe_err = queue.get(timeout=TIMEOUT)
            if out != "passed":
                raise RuntimeError(f"Error with stack {maybe_err[1]}") from maybe_err[0]
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
            queue.close()

    @classmethod
    def _test_distributed_collector_sync(cls, queue, sync):
        try:
            frames_per_batch = 50
            env = ContinuousActionVecMockEnv
            policy = RandomPolicy(env().action_spec)
            collector = cls.distributed_class()(
                [env] * 2,
                policy,
                total_frames=200,
                frames_per_batch=frames_per_batch,
                sync=sync,
                **cls.distributed_kwargs(),
            )
            total = 0
            for data in collector:
                total += data.numel()
                assert data.numel() == frames_per_batch
            collector.shutdown()
            assert total == 200
            queue.put(("passed", None))
        except Exception as e:
            tb = traceback.format_exc()
            queue.put(("not passed", (e, tb)))

    @classmethod
    def _test_distributed_collector_updatepolicy_shutdown_only(cls, queue, sync):
        """Small rollout + weight sync + shutdown (used for leak checks in parent process)."""
        collector = None
        try:
            frames_per_batch = 50
            total_frames = 250
            env = CountingEnv
            policy = CountingPolicy()
            dcls = cls.distributed_class()
            collector = dcls(
                [env] * 2,
                policy,
                collector_class=Collector,
                total_frames=total_frames,
                frames_per_batch=frames_per_batch,
                sync=sync,
                **cls.distributed_kwargs(),
            )
            first_batch = None
            seen_updated = False
            total = 0
            for i, data in enumerate(collector):
                total += data.numel()
                if i == 0:
                    first_batch = data
                    policy.weight.data.add_(1)
                    collector.update_policy_weights_(policy)
                else:
                    if (data["action"] == 2).all():
                        seen_updated = True
            assert total == total_frames
            assert first_batch is not None
            assert (first_batch["action"] == 1).all(), first_batch["action"]
            assert (
                seen_updated
            ), "Updated weights were never observed in collected batches."
            queue.put(("passed", None))
        except Exception as e:
            tb = traceback.format_exc()
            queue.put(("not passed", (e, tb)))
        finally:
            if collector is not None:
                collector.shutdown()

    @pytest.mark.parametrize("sync", [False, True])
    def test_collector_shutdown_clears_python_processes(self, sync):
        """Regression test: collector.shutdown() should not leak python processes."""
        queue = mp.Queue(1)
        # Creating multiprocessing primitives (Queue / SemLock) may spawn Python's
        # `multiprocessing.resource_tracker` helper process. That process is not owned
        # by the collector and may live for the duration of the test runner, so we
        # include it in the baseline.
        baseline = snapshot_python_processes()
        baseline_time = time.time()

        proc = mp.Process(
            target=self._test_distributed_collector_updatepolicy_shutdown_only,
            args=(queue, sync),
        )
        proc.start()
        try:
            out, maybe_err = queue.get(timeout=TIMEOUT)
            if out != "passed":
                raise RuntimeError(f"Error with stack {maybe_err[1]}") from maybe_err[0]
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
            queue.close()

        assert_no_new_python_processes(
            baseline=baseline, baseline_time=baseline_time, timeout=20.0
        )

    @classmethod
    def _test_distributed_collector_class(cls, queue, collector_class):
        try:
            frames_per_batch = 50
            env = ContinuousActionVecMockEnv
            policy = RandomPolicy(env().action_spec)
            collector = cls.distributed_class()(
                [env] * 2,
                policy,
                collector_class=collector_class,
                total_frames=200,
                frames_per_batch=frames_per_batch,
                **cls.distributed_kwargs(),
            )
            total = 0
            for data in collector:
                total += data.numel()
                assert data.numel() == frames_per_batch
            collector.shutdown()
            assert total == 200
            queue.put(("passed", None))
        except Exception as e:
            tb = traceback.format_exc()
            queue.put(("not passed", (e, tb)))

    @pytest.mark.parametrize(
        "collector_class",
        [
            MultiSyncCollector,
            MultiAsyncCollector,
            Collector,
        ],
    )
    def test_distributed_collector_class(self, collector_class):
        """Testing various collector classes to be used in nodes."""
        queue = mp.Queue(1)
        proc = mp.Process(
            target=self._test_distributed_collector_class,
            args=(queue, collector_class),
        )
        proc.start()
        try:
            out, maybe_err = queue.get(timeout=TIMEOUT)
            if out != "passed":
                raise RuntimeError(f"Error with stack {maybe_err[1]}") from maybe_err[0]
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
            queue.close()

    @classmethod
    def _test_distributed_collector_updatepolicy(
        cls, queue, collector_class, sync, pfactory
    ):
        try:
            frames_per_batch = 50
            total_frames = 300
            env = CountingEnv
            if pfactory:
                policy_factory = CountingPolicy
                policy = None
            else:
                policy = CountingPolicy()
                policy_factory = None
            if collector_class is MultiAsyncCollector:
                # otherwise we may collect data from a collector that has not yet been
                # updated
                n_collectors = 1
            else:
                n_collectors = 2
            weights = None
            if policy is None and policy_factory is not None:
                policy_stateful = policy_factory()
                weights = TensorDict.from_module(policy_stateful).lock_()
            dcls = cls.distributed_class()
            torchrl_logger.info(f"Using distributed collector {dcls}")
            collector = None
            collector = dcls(
                [env] * n_collectors,
                policy,
                policy_factory=policy_factory,
                collector_class=collector_class,
                total_frames=total_frames,
                frames_per_batch=frames_per_batch,
                sync=sync,
                **cls.distributed_kwargs(),
            )
            total = 0
            first_batch = None
            last_batch = None
            for i, data in enumerate(collector):
                total += data.numel()
                assert data.numel() == frames_per_batch
                if i == 0:
                    first_batch = data
                    if policy is not None:
                        # Avoid using `.data` (and avoid tracking in autograd).
                        policy.weight.data.add_(1)
                    else:
                        assert weights is not None
                        weights.data += 1
                    torchrl_logger.info("TEST -- Calling update_policy_weights_()")
                    collector.update_policy_weights_(weights)
                    torchrl_logger.info("TEST -- Done calling update_policy_weights_()")
                elif total == total_frames - frames_per_batch:
                    last_batch = data
            assert first_batch is not None
            assert last_batch is not None
            assert (first_batch["action"] == 1).all(), first_batch["action"]
            assert (last_batch["action"] == 2).all(), last_batch["action"]
            collector.shutdown()
            assert total == total_frames
            queue.put(("passed", None))
        except Exception as e:
            tb = traceback.format_exc()
            queue.put(("not passed", (e, tb)))

    @pytest.mark.parametrize(
        "collector_class",
        [
            Collector,
            MultiSyncCollector,
            MultiAsyncCollector,
        ],
    )
    @pytest.mark.parametrize("sync", [False, True])
    @pytest.mark.parametrize("pfactory", [False, True])
    def test_distributed_collector_updatepolicy(self, collector_class, sync, pfactory):
        """Testing various collector classes to be used in nodes."""
        queue = mp.Queue(1)

        proc = mp.Process(
            target=self._test_distributed_collector_updatepolicy,
            args=(queue, collector_class, sync, pfactory),
        )
        proc.start()
        try:
            out, maybe_err = queue.get(timeout=TIMEOUT)
            if out != "passed":
                raise RuntimeError(f"Error with stack {maybe_err[1]}") from maybe_err[0]
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
            queue.close()

    @classmethod
    def _test_collector_next_method(cls, queue):
        """Non-regression test for iterator/flag bug.

        Previously, `__iter__` set `_iterator = True` as a flag, but `next()` expected
        `_iterator` to be either `None` or an actual iterator object. When Ray's remote
        collector called `next()` after `__iter__`, it tried `next(True)` which failed
        with `TypeError: 'bool' object is not an iterator`.

        This test ensures that calling `next()` works correctly regardless of whether
        `__iter__` has been called.
        """
        try:
            cls._start_worker()
            env = ContinuousActionVecMockEnv
            policy = RandomPolicy(env().action_spec)
            collector = cls.distributed_class()(
                [env] * 2,
                policy,
                total_frames=500,
                frames_per_batch=50,
                **cls.distributed_kwargs(),
            )

            # Test 1: Call next() directly without __iter__
            data1 = collector.next()
            assert data1 is not None, "next() should return data"
            assert data1.numel() == 50, f"Expected 50 frames, got {data1.numel()}"

            # Test 2: Call next() again
            data2 = collector.next()
            assert data2 is not None, "second next() should return data"
            assert data2.numel() == 50, f"Expected 50 frames, got {data2.numel()}"

            queue.put(("passed", None))
        except Exception as e:
            tb = traceback.format_exc()
            queue.put(("not passed", (e, tb)))
        finally:
            collector.shutdown()

    def test_collector_next_method(self):
        """Non-regression test: next() should work correctly (iterator/flag bug fix)."""
        queue = mp.Queue(1)
        proc = mp.Process(
            target=self._test_collector_next_method,
            args=(queue,),
        )
        proc.start()
        try:
            out, maybe_err = queue.get(timeout=TIMEOUT)
            if out != "passed":
                raise RuntimeError(f"Error with stack {maybe_err[1]}") from maybe_err[0]
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
            queue.close()


@pytest.mark.skipif(
    not _has_ray, reason="Ray not found. Ray may be badly configured or not installed."
)
class TestRayCollector(DistributedCollectorBase):
    """A testing distributed data collector class that runs tests without using a Queue,
    to avoid potential deadlocks when combining Ray and multiprocessing.
    """

    @pytest.fixture(autouse=True, scope="class")
    def start_ray(self):
        import ray

        # Ensure Ray is initialized with a runtime_env that lets workers import
        # this test module (e.g. `CountingPolicy`), otherwise actor unpickling can
        # fail with "No module named 'test_distributed'".
        ray.shutdown()
        ray_init_config = dict(DEFAULT_RAY_INIT_CONFIG)
        ray_init_config["runtime_env"] = {
            "working_dir": os.path.dirname(__file__),
            "env_vars": {"PYTHONPATH": os.path.dirname(__file__)},
        }
        ray.init(**ray_init_config)

        yield
        ray.shutdown()

    @pytest.fixture(autouse=True, scope="function")
    def reset_process_group(self):
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        yield

    @classmethod
    def distributed_class(cls) -> type:
        return RayCollector

    @classmethod
    def distributed_kwargs(cls) -> dict:
        # Ray will be auto-initialized by RayCollector if not already started.
        # We need to provide runtime_env so workers can import this test module.
        ray_init_config = dict(DEFAULT_RAY_INIT_CONFIG)
        ray_init_config["runtime_env"] = {
            "working_dir": os.path.dirname(__file__),
            "env_vars": {"PYTHONPATH": os.path.dirname(__file__)},
        }
        remote_configs = {
            "num_cpus": 1,
            "num_gpus": 0.0,
            "memory": 1024**2,
        }
        return {"ray_init_config": ray_init_config, "remote_configs": remote_configs}

    def test_dqn_trainer_ray_backend(self, tmp_path):
        replay = RayReplayBuffer(
            replay_buffer_cls=TensorDictReplayBuffer,
            storage=partial(LazyTensorStorage, 64),
            batch_size=8,
            remote_config={"num_cpus": 1},
        )
        collector = RayCollector(
            create_env_fn=[CountingEnv, CountingEnv],
            policy=CountingPolicy(),
            collector_class=Collector,
            frames_per_batch=8,
            total_frames=16,
            init_random_frames=16,
            remote_configs={"num_cpus": 1, "num_gpus": 0},
            sync=True,
        )
        loss = ScalarRayLoss()
        try:
            with pytest.warns(UserWarning, match="experimental"):
                trainer = DQNTrainer(
                    collector=collector,
                    total_frames=16,
                    frame_skip=1,
                    optim_steps_per_batch=1,
                    loss_module=loss,
                    optimizer=torch.optim.SGD(loss.parameters(), lr=0.1),
                    replay_buffer=replay,
                    batch_size=8,
                    target_net_updater=CountingTargetUpdater(loss),
                    learner_backend="ray",
                    learner_backend_options={
                        "world_size": 2,
                        "resources_per_rank": {"num_cpus": 1, "num_gpus": 0},
                        "backend": "gloo",
                        "setup_timeout": 60.0,
                        "command_timeout": 60.0,
                    },
                    enable_logging=False,
                    progress_bar=False,
                    checkpoint=Checkpoint(),
                    save_trainer_file=tmp_path / "checkpoint",
                    save_trainer_interval=0,
                )
            trainer.train()
            assert trainer.collected_frames == 16
            assert trainer._optim_count == 1
            assert trainer._published_model_version == 1
            manifest = Checkpoint.manifest(tmp_path / "checkpoint")
            assert {
                "collector",
                "learner_execution",
                "replay_buffer",
                "trainer_state",
            }.issubset(manifest["components"])

            restored_replay = RayReplayBuffer(
                replay_buffer_cls=TensorDictReplayBuffer,
                storage=partial(LazyTensorStorage, 64),
                batch_size=8,
                remote_config={"num_cpus": 1},
            )
            restored_collector = RayCollector(
                create_env_fn=[CountingEnv, CountingEnv],
                policy=CountingPolicy(),
                collector_class=Collector,
                frames_per_batch=8,
                total_frames=16,
                init_random_frames=16,
                remote_configs={"num_cpus": 1, "num_gpus": 0},
                sync=True,
            )
            restored_loss = ScalarRayLoss()
            restored = None
            try:
                with pytest.warns(UserWarning, match="experimental"):
                    restored = DQNTrainer(
                        collector=restored_collector,
                        total_frames=16,
                        frame_skip=1,
                        optim_steps_per_batch=1,
                        loss_module=restored_loss,
                        optimizer=torch.optim.SGD(restored_loss.parameters(), lr=0.1),
                        replay_buffer=restored_replay,
                        batch_size=8,
                        target_net_updater=CountingTargetUpdater(restored_loss),
                        learner_backend="ray",
                        learner_backend_options={
                            "world_size": 2,
                            "resources_per_rank": {"num_cpus": 1, "num_gpus": 0},
                            "backend": "gloo",
                            "setup_timeout": 60.0,
                            "command_timeout": 60.0,
                        },
                        enable_logging=False,
                        progress_bar=False,
                        checkpoint=Checkpoint(),
                    )
                restored.load_from_file(tmp_path / "checkpoint")
                assert restored.collected_frames == 16
                assert restored._optim_count == 1
                assert restored._execution_backend.model_version == 1
                assert restored._published_model_version == 1
            finally:
                if restored is not None and restored._execution_backend is not None:
                    restored._execution_backend.shutdown()
                restored_collector.shutdown()
                restored_replay.shutdown()
        finally:
            collector.shutdown()
            replay.shutdown()

    @pytest.mark.parametrize("trainer_cls", [DDPGTrainer, SACTrainer, TD3Trainer])
    def test_offpolicy_trainer_ray_backend(self, trainer_cls):
        replay = RayReplayBuffer(
            replay_buffer_cls=TensorDictReplayBuffer,
            storage=partial(LazyTensorStorage, 64),
            batch_size=8,
            remote_config={"num_cpus": 1},
        )
        collector = RayCollector(
            create_env_fn=[CountingEnv],
            policy=CountingPolicy(),
            collector_class=Collector,
            frames_per_batch=8,
            total_frames=8,
            init_random_frames=0,
            remote_configs={"num_cpus": 1, "num_gpus": 0},
            sync=True,
        )
        loss = ScalarRayLoss()
        try:
            with pytest.warns(UserWarning, match="experimental"):
                trainer = trainer_cls(
                    collector=collector,
                    total_frames=8,
                    frame_skip=1,
                    optim_steps_per_batch=1,
                    loss_module=loss,
                    optimizer=torch.optim.SGD(loss.parameters(), lr=0.1),
                    replay_buffer=replay,
                    batch_size=8,
                    target_net_updater=CountingTargetUpdater(loss),
                    learner_backend="ray",
                    learner_backend_options={
                        "world_size": 2,
                        "resources_per_rank": {"num_cpus": 1, "num_gpus": 0},
                        "backend": "gloo",
                        "setup_timeout": 60.0,
                        "command_timeout": 60.0,
                    },
                    enable_logging=True,
                    log_rewards=False,
                    log_actions=False,
                    progress_bar=False,
                )
            assert trainer._pre_steps_log_ops
            trainer.train()
            assert trainer.collected_frames == 8
            assert trainer._optim_count == 1
            assert trainer._published_model_version == 1
        finally:
            collector.shutdown()
            replay.shutdown()

    def test_ray_learner_publishes_directly_to_inference(self):
        replay = RayReplayBuffer(
            replay_buffer_cls=TensorDictReplayBuffer,
            storage=partial(LazyTensorStorage, 64),
            batch_size=8,
            remote_config={"num_cpus": 0},
        )
        replay.extend(TensorDict({"value": torch.ones(32, 1)}, [32]))
        inference = InferenceServer(
            policy_factory=CountingPolicy,
            service_backend="ray",
            service_backend_options={"remote_config": {"num_cpus": 0}},
            transport="auto",
        )
        collector = RayCollector(
            create_env_fn=[CountingEnv],
            policy=inference,
            collector_class=Collector,
            frames_per_batch=8,
            total_frames=8,
            remote_configs={"num_cpus": 1, "num_gpus": 0},
            sync=True,
        )
        loss = ScalarRayLoss()
        backend = _RayTrainerExecution(
            loss_module=loss,
            optimizer=torch.optim.SGD(loss.parameters(), lr=0.1),
            optimization_stepper=None,
            target_net_updater=None,
            replay_buffer=replay,
            global_batch_size=8,
            options={
                "world_size": 2,
                "resources_per_rank": {"num_cpus": 1, "num_gpus": 0},
                "backend": "gloo",
                "setup_timeout": 60.0,
                "command_timeout": 60.0,
            },
            weight_sync_factory=collector._learner_weight_sync,
        )
        caller_store = dist.HashStore()
        dist.init_process_group("gloo", store=caller_store, rank=0, world_size=1)
        try:
            assert dist.is_initialized()
            backend.start()
            assert backend.publish_weights(expected_version=0) == 0
            assert inference.policy_version == 0
            backend.step(1)
            assert backend.publish_weights(expected_version=1) == 1
            assert inference.policy_version == 1
            state = backend.state_dict()
            generation = backend.generation
            backend.shutdown()
            backend.start()
            backend.load_state_dict(state)
            assert backend.generation == generation + 1
            assert backend.publish_weights(expected_version=1) == 1
            assert inference.policy_version == 1
            result = inference.client()(TensorDict({}, batch_size=[]))
            torch.testing.assert_close(result["action"], torch.tensor(0.9))
            assert dist.is_initialized()
        finally:
            backend.shutdown()
            collector.shutdown()
            inference.shutdown()
            replay.shutdown()
            if dist.is_initialized():
                dist.destroy_process_group()

    def test_ray_learner_publishes_to_collector_owned_policy(self):
        replay = RayReplayBuffer(
            replay_buffer_cls=TensorDictReplayBuffer,
            storage=partial(LazyTensorStorage, 64),
            batch_size=8,
            remote_config={"num_cpus": 0},
        )
        replay.extend(TensorDict({"value": torch.ones(32, 1)}, [32]))
        collector = RayCollector(
            create_env_fn=[CountingEnv],
            policy=CountingPolicy(),
            collector_class=Collector,
            collector_kwargs={"track_policy_version": True},
            frames_per_batch=8,
            total_frames=8,
            remote_configs={"num_cpus": 1, "num_gpus": 0},
            sync=True,
        )
        loss = ScalarRayLoss()
        backend = _RayTrainerExecution(
            loss_module=loss,
            optimizer=torch.optim.SGD(loss.parameters(), lr=0.1),
            optimization_stepper=None,
            target_net_updater=None,
            replay_buffer=replay,
            global_batch_size=8,
            options={
                "world_size": 2,
                "resources_per_rank": {"num_cpus": 1, "num_gpus": 0},
                "backend": "gloo",
                "setup_timeout": 60.0,
                "command_timeout": 60.0,
            },
            weight_sync_factory=collector._learner_weight_sync,
        )
        try:
            backend.start()
            backend.publish_weights(expected_version=0)
            backend.step(5)
            backend.publish_weights(expected_version=5)
            batch = next(iter(collector))
            torch.testing.assert_close(
                batch["action"], torch.full_like(batch["action"], 0.5)
            )
            torch.testing.assert_close(
                batch["next", "policy_version"],
                torch.full_like(batch["next", "policy_version"], 5),
            )
            with pytest.raises(
                ray.exceptions.RayTaskError, match="tensor schema changed"
            ):
                backend.publish_weights(
                    expected_version=5,
                    model_weights_key=("module", "0"),
                )
        finally:
            backend.shutdown()
            collector.shutdown()
            replay.shutdown()

    def test_ray_learner_rejects_weight_schema_mismatch(self):
        replay = RayReplayBuffer(
            replay_buffer_cls=TensorDictReplayBuffer,
            storage=partial(LazyTensorStorage, 64),
            batch_size=8,
            remote_config={"num_cpus": 0},
        )
        replay.extend(TensorDict({"value": torch.ones(32, 1)}, [32]))
        collector = RayCollector(
            create_env_fn=[CountingEnv],
            policy=MismatchedCountingPolicy(),
            collector_class=Collector,
            frames_per_batch=8,
            total_frames=8,
            remote_configs={"num_cpus": 1, "num_gpus": 0},
            sync=True,
        )
        loss = ScalarRayLoss()
        backend = _RayTrainerExecution(
            loss_module=loss,
            optimizer=torch.optim.SGD(loss.parameters(), lr=0.1),
            optimization_stepper=None,
            target_net_updater=None,
            replay_buffer=replay,
            global_batch_size=8,
            options={
                "world_size": 2,
                "resources_per_rank": {"num_cpus": 1, "num_gpus": 0},
                "backend": "gloo",
                "setup_timeout": 60.0,
                "command_timeout": 60.0,
            },
            weight_sync_factory=collector._learner_weight_sync,
        )
        try:
            backend.start()
            with pytest.raises(
                ray.exceptions.RayTaskError, match="tensor schemas differ"
            ):
                backend.publish_weights(expected_version=0)
        finally:
            backend.shutdown()
            collector.shutdown()
            replay.shutdown()

    def test_ray_owned_inference_and_replay(self):
        replay = inference = collector = None
        try:
            with service_backend("ray"):
                replay = TensorDictReplayBuffer(
                    storage=partial(LazyTensorStorage, 100),
                    batch_size=4,
                    service_backend_options={"remote_config": {"num_cpus": 0}},
                    transport="auto",
                )
                inference = InferenceServer(
                    policy_factory=CountingPolicy,
                    service_backend_options={"remote_config": {"num_cpus": 0}},
                    transport="auto",
                )
                collector = Collector(
                    create_env_fn=CountingEnv,
                    num_collectors=1,
                    policy=inference,
                    replay_buffer=replay,
                    backend_options={
                        "collector_class": Collector,
                        "remote_configs": {"num_cpus": 1, "num_gpus": 0},
                    },
                    frames_per_batch=8,
                    total_frames=16,
                    sync=True,
                )
            assert all(batch is None for batch in collector)
            assert len(replay) == 16
            assert replay.sample().shape == (4,)
        finally:
            if collector is not None:
                collector.shutdown()
            if inference is not None:
                inference.shutdown()
            if replay is not None:
                replay.shutdown()

    def test_ray_collector_pause_drains_and_resumes(self):
        replay = TensorDictReplayBuffer(
            storage=partial(LazyTensorStorage, 1000),
            batch_size=4,
            service_backend="ray",
            service_backend_options={"remote_config": {"num_cpus": 0}},
            transport="auto",
        )
        collector = RayCollector(
            create_env_fn=[CountingEnv],
            policy=CountingPolicy(),
            replay_buffer=replay,
            collector_class=Collector,
            frames_per_batch=8,
            total_frames=1000,
            remote_configs={"num_cpus": 1, "num_gpus": 0},
            sync=False,
        )
        try:
            collector.start()
            for _ in range(100):
                if replay.write_count:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("Collector did not write before pause.")
            with collector.pause():
                paused_count = replay.write_count
                time.sleep(0.2)
                assert replay.write_count == paused_count
                assert collector.remote_collectors

            for _ in range(100):
                if replay.write_count > paused_count:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("Collector did not resume after pause.")
        finally:
            collector.shutdown()
            replay.shutdown()

    @classmethod
    def _start_worker(cls):
        pass

    @pytest.mark.parametrize("sync", [False, True])
    def test_distributed_collector_sync(self, sync, frames_per_batch=200):
        frames_per_batch = 50
        env = ContinuousActionVecMockEnv
        policy = RandomPolicy(env().action_spec)
        collector = self.distributed_class()(
            [env] * 2,
            policy,
            total_frames=200,
            frames_per_batch=frames_per_batch,
            sync=sync,
            **self.distributed_kwargs(),
        )
        try:
            total = 0
            for data in collector:
                total += data.numel()
                assert data.numel() == frames_per_batch
            assert total == 200
        finally:
            collector.shutdown()

    @pytest.mark.parametrize("sync", [False, True])
    def test_collector_shutdown_clears_python_processes(self, sync):
        """Regression test: collector.shutdown() should not leak python processes (ray)."""
        kwargs = self.distributed_kwargs()
        baseline = snapshot_python_processes()
        baseline_time = time.time()

        frames_per_batch = 50
        total_frames = 250
        env = CountingEnv
        policy = CountingPolicy()
        collector = self.distributed_class()(
            [env] * 2,
            policy,
            collector_class=Collector,
            total_frames=total_frames,
            frames_per_batch=frames_per_batch,
            sync=sync,
            **kwargs,
        )
        try:
            total = 0
            first_batch = None
            seen_updated = False
            for i, data in enumerate(collector):
                total += data.numel()
                if i == 0:
                    first_batch = data
                    policy.weight.data.add_(1)
                    collector.update_policy_weights_(policy)
                else:
                    if (data["action"] == 2).all():
                        seen_updated = True
            assert total == total_frames
            assert first_batch is not None
            assert (first_batch["action"] == 1).all(), first_batch["action"]
            assert (
                seen_updated
            ), "Updated weights were never observed in collected batches."
        finally:
            collector.shutdown()

        def _is_ray_runtime_proc(info):
            args = info.get("args") or ""
            comm = info.get("comm") or ""
            return (
                " ray::" in args.lower()
                or "/site-packages/ray/" in args
                or comm in {"raylet", "gcs_server"}
            )

        assert_no_new_python_processes(
            baseline=baseline,
            baseline_time=baseline_time,
            timeout=30.0,
            # Ray's core daemons and prestarted workers can legitimately outlive a
            # collector. We only want to catch leaked *non-Ray* Python processes
            # spawned by the collector itself.
            ignore_info_fn=_is_ray_runtime_proc,
        )

    @pytest.mark.parametrize(
        "collector_class",
        [
            MultiSyncCollector,
            MultiAsyncCollector,
            Collector,
        ],
    )
    def test_distributed_collector_class(self, collector_class):
        frames_per_batch = 50
        env = ContinuousActionVecMockEnv
        policy = RandomPolicy(env().action_spec)
        collector = self.distributed_class()(
            [env] * 2,
            policy,
            collector_class=collector_class,
            total_frames=200,
            frames_per_batch=frames_per_batch,
            **self.distributed_kwargs(),
        )
        try:
            total = 0
            for data in collector:
                total += data.numel()
                assert data.numel() == frames_per_batch
            assert total == 200
        finally:
            collector.shutdown()

    @pytest.mark.parametrize(
        "collector_class",
        [
            Collector,
            MultiSyncCollector,
            MultiAsyncCollector,
        ],
    )
    @pytest.mark.parametrize("sync", [False, True])
    @pytest.mark.parametrize("pfactory", [False, True])
    def test_distributed_collector_updatepolicy(self, collector_class, sync, pfactory):
        frames_per_batch = 50
        total_frames = 300
        env = CountingEnv
        if pfactory:
            policy_factory = CountingPolicy
            policy = None
        else:
            policy = CountingPolicy()
            policy_factory = None
        if collector_class is MultiAsyncCollector:
            # otherwise we may collect data from a collector that has not yet been
            # updated
            n_collectors = 1
        else:
            n_collectors = 2
        weights = None
        if policy is None and policy_factory is not None:
            policy_stateful = policy_factory()
            weights = TensorDict.from_module(policy_stateful)
        collector = self.distributed_class()(
            [env] * n_collectors,
            policy,
            policy_factory=policy_factory,
            collector_class=collector_class,
            total_frames=total_frames,
            frames_per_batch=frames_per_batch,
            sync=sync,
            **self.distributed_kwargs(),
        )
        total = 0
        first_batch = None
        last_batch = None
        try:
            for i, data in enumerate(collector):
                total += data.numel()
                assert data.numel() == frames_per_batch
                if i == 0:
                    first_batch = data
                    if policy is not None:
                        policy.weight.data.add_(1)
                    else:
                        assert weights is not None
                        weights.data.add_(1)
                    collector.update_policy_weights_(weights)
                elif total == total_frames - frames_per_batch:
                    last_batch = data
            assert first_batch is not None
            assert last_batch is not None
            assert (first_batch["action"] == 1).all(), first_batch["action"]
            assert (last_batch["action"] == 2).all(), last_batch["action"]
            assert total == total_frames
        finally:
            collector.shutdown()

    def test_ray_collector_policy_constructor(self):
        n_collectors = 2
        frames_per_batch = 50
        total_frames = 300
        env = CountingEnv

        def policy_constructor():
            return TensorDictSequential(
                TensorDictModule(
                    lambda x: x.float(),
                    in_keys=["observation"],
                    out_keys=["_obs_float"],
                ),
                TensorDictModule(
                    nn.Linear(1, 1), out_keys=["action"], in_keys=["_obs_float"]
                ),
                TensorDictModule(
                    lambda x: x.int(), in_keys=["action"], out_keys=["action"]
                ),
            )

        collector = self.distributed_class()(
            [env] * n_collectors,
            collector_class=Collector,
            policy_factory=policy_constructor,
            total_frames=total_frames,
            frames_per_batch=frames_per_batch,
            **self.distributed_kwargs(),
        )
        p = policy_constructor()
        # p(env().reset())
        weights = TensorDict.from_module(p)
        # `TensorDict.__getitem__` returns tensors; use in-place ops directly.
        with torch.no_grad():
            weights["module", "1", "module", "weight"].fill_(0)
            weights["module", "1", "module", "bias"].fill_(2)
        collector.update_policy_weights_(weights)
        try:
            for data in collector:
                assert (data["action"] == 2).all()
                collector.update_policy_weights_(weights)
        finally:
            collector.shutdown()


if __name__ == "__main__":
    args, unknown = argparse.ArgumentParser().parse_known_args()
    pytest.main([__file__, "--capture", "no", "--exitfirst"] + unknown)
