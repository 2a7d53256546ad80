"""Parts of a sharded trainer's tensors cover each element exactly once, wherever they are
put together (``core/shards.cover_problem``): rank 0 before any byte moves
(``check_cover``: ``SchemaMismatchError``), and every receiver that assembles the ranks'
parts itself (``check_parts``: ``IntegrityError``): the network host's ``assemble`` and the
Ray relay's ``receive_pieces``. Counting elements is not enough."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
import torch

from weightsync.core.errors import IntegrityError, SchemaMismatchError
from weightsync.core.layout import Layout, TensorSpec
from weightsync.core.shards import ShardPiece, check_cover, check_parts, cover_problem

#: regions of a tensor of 4 elements that do not tile it, and what the error names
NOT_COVERING = {
    # counts 2 + 1 + 1 = 4 elements: the old check took it, element 2 was never written
    "issue": ([[0, 2], [1, 2], [3, 4]], r"trainer ranks 0 and 1 both write elements \[1:2\]"),
    "gap": ([[0, 1], [2, 4]], r"no trainer rank writes elements \[1:2\]"),
    "duplicate": ([[0, 2], [0, 2], [2, 4]], r"trainer ranks 0 and 1 both write elements \[0:2\]"),
    # a duplicate that makes up for a gap: again 4 elements counted
    "duplicate_and_gap": ([[0, 2], [0, 2]], r"trainer ranks 0 and 1 both write elements \[0:2\]"),
}


def _by_rank(regions: list[list[int]]) -> dict[int, dict[str, list[int]]]:
    return {rank: {"w": bounds} for rank, bounds in enumerate(regions)}


@pytest.mark.parametrize("case", sorted(NOT_COVERING))
def test_parts_that_do_not_tile_a_tensor_are_refused_naming_the_block(case):
    regions, match = NOT_COVERING[case]
    with pytest.raises(IntegrityError, match=match) as info:
        check_parts({"w": (4,)}, _by_rank(regions), "host h")
    assert "key 'w'" in str(info.value) and "host h" in str(info.value)
    layout = Layout([TensorSpec("w", (4,), torch.float32, "cpu")])
    with pytest.raises(SchemaMismatchError, match=match) as mismatch:
        check_cover(layout, _by_rank(regions))
    assert mismatch.value.key == "w"


def test_a_tiling_passes_in_rows_columns_and_blocks():
    assert cover_problem("w", (4, 6), [(0, [0, 2, 0, 6]), (1, [2, 4, 0, 6])]) is None
    assert cover_problem("w", (4, 6), [(0, [0, 4, 0, 3]), (1, [0, 4, 3, 6])]) is None
    blocks = [(r, [lo, lo + 2, c, c + 3]) for r, (lo, c) in
              enumerate([(0, 0), (0, 3), (2, 0), (2, 3)])]
    assert cover_problem("w", (4, 6), blocks) is None
    assert cover_problem("s", (), [(0, [])]) is None
    assert cover_problem("e", (0, 3), []) is None  # an empty tensor needs no writer


@pytest.mark.parametrize(("parts", "match"), [
    ([(0, [0, 2, 0, 6]), (1, [2, 4, 0, 3])], r"no trainer rank writes elements \[2:4, 3:6\]"),
    ([(0, [0, 4, 0, 3]), (1, [1, 3, 2, 6])], r"trainer ranks 0 and 1 both write elements \[1:3, 2:3\]"),
    ([(0, [0, 4, 0, 3]), (1, [0, 4, 4, 6])], r"no trainer rank writes elements \[0:4, 3:4\]"),
    ([(0, [0, 4, 0, 6]), (1, [0, 4, 0, 7])], r"region \[0, 4, 0, 7\] does not fit shape \(4, 6\)"),
    ([(0, [0, 4])], r"region \[0, 4\] does not fit shape \(4, 6\)"),
    ([(0, []), (1, [])], r"trainer ranks 0 and 1 both write"),
])
def test_a_two_dimensional_gap_or_overlap_is_named(parts, match):
    shape = () if parts[0][1] == [] else (4, 6)
    problem = cover_problem("w", shape, parts)
    assert problem is not None and re.search(match, problem), problem


def test_a_split_of_many_ranks_is_checked_quickly():
    """Rows of 4096 parts, and columns of 4096: the sweep compares neighbours (every pair
    would be 8 million comparisons each)."""
    import time

    started = time.monotonic()
    rows = [(r, [r, r + 1, 0, 8]) for r in range(4096)]
    columns = [(r, [0, 8, r, r + 1]) for r in range(4096)]
    assert cover_problem("w", (4096, 8), rows) is None
    assert cover_problem("w", (8, 4096), columns) is None
    assert time.monotonic() - started < 2.0


def test_regions_that_passed_before_and_then_changed_in_place_are_checked_again():
    """A receiver is sent the same regions each version, and a pass is remembered: what is
    remembered is a copy, so regions changed in place since are checked again."""
    regions = _by_rank([[0, 2], [2, 4]])
    check_parts({"w": (4,)}, regions, "host h")
    check_parts({"w": (4,)}, regions, "host h")
    regions[1]["w"][0] = 1  # now [0,2) and [1,4)
    with pytest.raises(IntegrityError, match=r"both write elements \[1:2\]"):
        check_parts({"w": (4,)}, regions, "host h")
    with pytest.raises(IntegrityError, match=r"no trainer rank writes elements \[4:5\]"):
        check_parts({"w": (5,)}, _by_rank([[0, 2], [2, 4]]), "host h")  # another shape


# ---------------------------------------------------------------- the network host
def _part(version: int, tensor: torch.Tensor, bounds: list[int]) -> Any:
    from weightsync.transports.net.packed import plan

    packed = plan({"w": tensor}, version)
    packed.regions = {"w": bounds}
    packed.fill({"w": tensor})
    return packed


@pytest.mark.parametrize("case", sorted(NOT_COVERING))
def test_the_network_host_refuses_parts_that_do_not_tile(case):
    from weightsync.transports.net.sharded_fetch import assemble

    regions, match = NOT_COVERING[case]
    parts = [_part(1, torch.full((hi - lo,), float(r + 1)), [lo, hi])
             for r, (lo, hi) in enumerate(regions)]
    with pytest.raises(IntegrityError, match=match):
        assemble(parts, "host-b")
    good = assemble([_part(1, torch.ones(2), [0, 2]), _part(1, torch.zeros(2), [2, 4])], "h")
    assert good["w"].tolist() == [1.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------- the Ray relay
def test_the_ray_relay_refuses_a_plan_that_does_not_tile_and_still_takes_every_stream():
    """Trainer ranks 0 and 1 stream [0,2) and [1,2) of a 4-element tensor to a relay
    (group rank 2, gloo, threads of this process): the relay takes both streams (no rank is
    left waiting) and writes nothing."""
    import datetime

    import torch.distributed as dist

    from weightsync.transports.ray.shard_stream import receive_pieces, send_pieces

    layout = Layout([TensorSpec("w", (4,), torch.float32, "cpu")])
    regions = {0: {"w": [0, 2]}, 1: {"w": [1, 2]}}
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=20)
    groups: dict[int, Any] = {}
    ready = threading.Barrier(3, timeout=30)
    out: dict[int, Any] = {}

    class Group:  # what send_pieces and receive_pieces use of a WeightGroup
        def __init__(self, pg: Any) -> None:
            self.pg = pg

    def run(rank: int) -> None:
        try:
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            groups[rank] = Group(dist.ProcessGroupGloo(store, rank, 3, options))
            ready.wait()
            if rank == 2:
                views = {"w": torch.full((4,), -1.0)}
                try:
                    receive_pieces(groups[2], layout, views, regions, 7, 20.0)
                except IntegrityError as exc:
                    out[2] = (exc, views["w"].tolist())
            else:
                lo, hi = regions[rank]["w"]
                piece = ShardPiece("w", torch.arange(lo, hi, dtype=torch.float32), ((lo, hi),))
                out[rank] = send_pieces(groups[rank], [piece], layout, regions[rank], [2], 7,
                                        20.0)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert out[0] == 8 and out[1] == 4, out  # both streams were taken whole
    error, written = out[2]
    assert "version 7: key 'w': trainer ranks 0 and 1 both write elements [1:2]" in str(error)
    assert written == [-1.0] * 4


def test_the_network_host_refuses_parts_missing_the_last_block():
    """The ranks declare each tensor's global shape in the part's header: parts that stop
    short of it leave a gap, which the bounding shape alone could not show."""
    from weightsync.transports.net.packed import parse_shapes
    from weightsync.transports.net.sharded_fetch import assemble
    from weightsync.transports.net.wire import ProtocolError

    first, second = _part(1, torch.ones(2), [0, 2]), _part(1, torch.zeros(2), [2, 4])
    for part in (first, second):
        part.shapes = {"w": [6]}
    with pytest.raises(IntegrityError, match=r"'w'.*\[4:6\]|\[4:6\].*'w'"):
        assemble([first, second], "host-b")
    second.shapes = {"w": [4]}
    with pytest.raises(IntegrityError, match="different global shapes"):
        assemble([first, second], "host-b")
    first.shapes = {"w": [4]}
    assert assemble([first, second], "host-b")["w"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert parse_shapes({"shapes": {"w": [4]}}, {"w": [2, 4]}) == {"w": [4]}
    for bad in ({}, {"w": [3]}, {"w": [4, 1]}, {"w": ["4"]}):
        with pytest.raises(ProtocolError, match="global shape"):
            parse_shapes({"shapes": bad}, {"w": [2, 4]})
