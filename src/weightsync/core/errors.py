"""The exceptions weightsync raises: one base class and one subclass per way a sync can fail."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class WeightSyncError(RuntimeError):
    """Base class of every error weightsync raises on purpose."""


class SchemaMismatchError(WeightSyncError, ValueError):
    """Two sides disagree on the layout (names, shapes or dtypes) of the weights.

    Raised before any byte is written on either side. ``key`` names the first offending
    entry, ``expected`` and ``got`` say what each side has (``None`` where a key is absent).
    """

    def __init__(
        self, message: str, *, key: str | None = None, expected: Any = None, got: Any = None
    ) -> None:
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.got = got


class WorkerLostError(WeightSyncError):
    """One or more workers died or dropped their connection; ``worker_ids`` names them."""

    def __init__(self, message: str, *, worker_ids: Iterable[int] = (), version: int | None = None):
        super().__init__(message)
        self.worker_ids = tuple(sorted(set(worker_ids)))
        self.version = version


    @classmethod
    def naming(cls, why: dict[int, str], version: int) -> WorkerLostError:
        """One error naming every worker in ``why`` (worker -> reason) that did not get
        ``version``; the others did."""
        ids = sorted(why)
        detail = "; ".join(f"worker {w}: {why[w]}" for w in ids)
        return cls(
            f"lost worker(s) {ids} while sending version {version} ({detail}); the other "
            "workers got it, and a restarted worker with the same index gets the current "
            "version when it connects",
            worker_ids=ids, version=version,
        )


class WorkerDroppedError(WorkerLostError):
    """Raised on a worker: the live trainer dropped this worker (it stopped answering, e.g.
    a stopped or starved process, past a send's deadline). Not a :class:`SenderLostError`:
    the trainer is alive, and the worker's next ``receive()``, ``poll()`` or ``connect()``
    joins again and takes the current version. ``version`` is the one in flight, if any."""


class WeightSyncTimeoutError(WeightSyncError, TimeoutError):
    """A blocking call ran past its deadline; ``worker_ids`` names who did not answer, if known."""

    def __init__(self, message: str, *, worker_ids: Iterable[int] = ()):
        super().__init__(message)
        self.worker_ids = tuple(sorted(set(worker_ids)))


class TrainerRankLostError(WeightSyncError):
    """A rank of a sharded trainer died, hung up or did not write its part of a version in
    time; ``rank`` names it. The version was not committed: workers keep the last whole one."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class IntegrityError(WeightSyncError):
    """Bytes that arrived or lie on disk do not match their checksum or manifest."""


class SenderLostError(WeightSyncError):
    """The trainer a receiver was connected to died or closed the connection."""


class UnsafeDirectoryError(WeightSyncError, PermissionError):
    """A sync directory belongs to, or is writable by, another user; nothing was touched."""


class UnsafeFileError(IntegrityError):
    """A file of the sync directory is a symlink, a FIFO or another non-regular file."""


class BaseWeightChangedError(WeightSyncError):
    """An adapter-only sender found a base (frozen) weight changed since it connected: the
    workers' base would no longer be the trainer's, so nothing was sent. ``key`` names it."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


class AdapterRankError(WeightSyncError, ValueError):
    """An adapter's rank exceeds what the engine was started for (vLLM's ``max_lora_rank``);
    refused before anything was loaded."""

    def __init__(self, message: str, *, rank: int, max_rank: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.max_rank = max_rank


class TrainerSessionEndedError(WeightSyncError):
    """A vLLM server refused a trainer's update because another trainer session initialised
    it since (one trainer per server at a time: the newer init takes the server over, the
    older session ends). ``session`` is the ended one, ``taken_by`` the one that took over
    ("" where that was an init without a session). Raised in the server and, naming it, by
    the ended trainer's ``send_weights()``."""

    def __init__(self, message: str, *, session: str = "", taken_by: str = "") -> None:
        super().__init__(message)
        self.session = session
        self.taken_by = taken_by
