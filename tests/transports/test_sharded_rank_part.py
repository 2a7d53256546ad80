"""A sharded trainer rank's write into a directory slot (``RankPart.write``): blocks of whole
rows are copied and summed in one fused pass, column blocks copied then summed; every
rank's shares still add up to the checksums a reader computes, cast or not."""

from __future__ import annotations

import pytest
import torch

from weightsync import LocalShard
from weightsync.core import checksum as ck
from weightsync.core.shards import global_layout, local_pieces
from weightsync.transports.directory.partial_sums import combine
from weightsync.transports.directory.sharded import RankPart
from weightsync.transports.directory.slots import SlotFile, bucket_checksums

RANKS = 3


def _flat(rank: int, full: dict[str, torch.Tensor]) -> dict[str, object]:
    """Rank ``rank``'s part: ``w`` split by rows (uneven), ``r`` by columns, ``b`` on rank 0."""
    rows = [0, 30, 31, 67]
    cols = [0, 2, 3, 5]
    flat: dict[str, object] = {
        "w": LocalShard(full["w"][rows[rank]:rows[rank + 1]].clone(), (67, 33), (rows[rank], 0)),
        "r": LocalShard(full["r"][:, cols[rank]:cols[rank + 1]].clone(), (41, 5), (0, cols[rank])),
    }
    if rank == 0:
        flat["b"] = full["b"]
    return flat


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
def test_rank_shares_add_up_to_the_slot_checksums(tmp_path, monkeypatch, dtype, threads):
    monkeypatch.setattr(ck, "PARALLEL_BYTES", 1000)  # stretches that end inside the row blocks
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(threads)
        full = {"w": torch.randn(67, 33, generator=generator),
                "r": torch.randn(41, 5, generator=generator),
                "b": torch.randn(7, generator=generator)}
        flats = [_flat(rank, full) for rank in range(RANKS)]
        layout = global_layout(flats[0])
        parts = [RankPart(local_pieces(flats[rank], rank), layout, dtype, None)
                 for rank in range(RANKS)]
        slot = SlotFile.create(tmp_path / "slot-0.safetensors", parts[0].file_layout, {}, 0o600)
        try:
            shares = [part.write(slot) for part in parts]
            assert combine(shares) == bucket_checksums(slot.layout, slot.data)
            views = slot.layout.tensor_views(slot.buffers)
            for name, tensor in full.items():
                assert torch.equal(views[name], tensor.to(views[name].dtype)), name
        finally:
            slot.close()
    finally:
        torch.set_num_threads(before)
