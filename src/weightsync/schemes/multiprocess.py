"""MultiProcessWeightSyncScheme: versions stream as raw bytes to each worker process."""

from __future__ import annotations

from weightsync.schemes.local import LocalScheme
from weightsync.schemes.receiver import WeightReceiver
from weightsync.schemes.sender import WeightSender
from weightsync.transports.mp.endpoints import StreamReader, StreamWriter


class MultiProcessWeightSyncScheme(LocalScheme):
    """Sync by streaming each version's bytes to every worker (no shared memory needed):
    packed once into a snapshot, written to each worker by its own streamer thread, so a
    send ends at its deadline with only the workers that did not answer blamed."""

    def create_sender(self) -> WeightSender:
        c = self.config
        writer = StreamWriter(c.address, c.token, c.uid, c.num_workers, timeout=self.peer_timeout)
        return WeightSender(self, writer, c.num_workers)

    def create_receiver(self, worker_idx: int = 0) -> WeightReceiver:
        return WeightReceiver(self, worker_idx, StreamReader(self._link(worker_idx)))
