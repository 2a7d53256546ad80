"""The rank key of every sharded scheme (``schemes/ranks.py``): the scheme's pickle carries
it (every trainer rank is handed the scheme), the workers' copy's pickle leaves it out, and
a rank's sender needs it. SharedMem's own checks: ``test_sharded_shared_mem.py``."""

from __future__ import annotations

import pickle

import pytest

import weightsync as ws


@pytest.fixture(params=["shared_mem", "directory", "ray", "net"])
def make(request, tmp_path):
    def made(trainer_ranks):
        if request.param == "shared_mem":
            return ws.SharedMemWeightSyncScheme(num_workers=1, trainer_ranks=trainer_ranks)
        if request.param == "directory":
            return ws.VLLMDoubleBufferSyncScheme(tmp_path / "d", trainer_ranks=trainer_ranks)
        if request.param == "net":
            return ws.NetWeightSyncScheme(num_workers=1, trainer_ranks=trainer_ranks)
        return ws.RayWeightSyncScheme(num_workers=1, trainer_ranks=trainer_ranks)
    return made


def test_the_rank_key_stays_out_of_the_workers_copy(make):
    scheme = make(2)
    key = scheme.config.rank_key
    assert key and key not in repr(scheme.config) and key not in repr(scheme)
    assert pickle.loads(pickle.dumps(scheme)).config.rank_key == key
    assert pickle.loads(pickle.dumps(scheme.for_trainer_ranks())).config.rank_key == key
    as_worker = pickle.loads(pickle.dumps(scheme.for_workers()))
    assert as_worker.config.rank_key == ""
    assert scheme.config.rank_key == key  # the scheme in this process keeps it
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"workers' copy.*for_workers\(\)"):
            as_worker.create_sender(rank=rank)
    with pytest.raises(ValueError, match="workers' copy"):
        as_worker.for_trainer_ranks()
    again = make(2)
    if isinstance(scheme, ws.VLLMDoubleBufferSyncScheme):
        assert again.config.rank_key == key  # the directory's own key, read again
    else:
        assert again.config.rank_key != key  # each scheme draws its own


def test_the_workers_copy_holds_no_key_without_pickling(make):
    """Handed to a thread or a fork (no pickle), the workers' copy refuses to be a rank in
    every form: rank 0 or another, keyword or positional, or made a rank's copy again."""
    import dataclasses
    import threading

    scheme = make(2)
    key = scheme.config.rank_key
    as_worker = scheme.for_workers()
    assert as_worker.config.rank_key == ""
    assert key not in [getattr(as_worker.config, f.name)
                       for f in dataclasses.fields(as_worker.config)]
    assert scheme.config.rank_key == key  # the scheme itself keeps it
    forms = [lambda: as_worker.create_sender(rank=0), lambda: as_worker.create_sender(rank=1)]
    if not isinstance(scheme, ws.RayWeightSyncScheme):  # Ray's first argument is the actors
        forms += [lambda: as_worker.create_sender(0), lambda: as_worker.create_sender(1)]
    for form in forms:
        with pytest.raises(ValueError, match=r"workers' copy.*for_workers\(\)"):
            form()
    with pytest.raises(ValueError, match="workers' copy"):
        as_worker.for_trainer_ranks()
    errors: list[BaseException] = []

    def in_a_thread() -> None:
        try:
            as_worker.create_sender(rank=1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(30)
    assert len(errors) == 1 and isinstance(errors[0], ValueError), errors
    assert as_worker.for_workers().config.rank_key == ""


def test_an_unsharded_scheme_has_no_key_and_hands_workers_itself(make):
    scheme = make(1)
    assert scheme.config.rank_key == ""
    assert pickle.loads(pickle.dumps(scheme.for_workers())).config == scheme.config
