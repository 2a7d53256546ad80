"""The ray-delta bench's table, without a cluster: each delta row beside the full send of
the same update and actor count."""

from __future__ import annotations

from weightsync.bench.ray_delta import DeltaCase, delta_table
from weightsync.cli import build_parser


def test_delta_table_compares_each_delta_with_its_full_send():
    cases = [
        DeltaCase("full", "AdamW", 1, times=[0.2, 0.2], wire_bytes=[1000, 1000], chunks=4,
                  unchanged=[0.96]),
        DeltaCase("delta", "AdamW", 1, times=[0.1, 0.1], wire_bytes=[50, 50], delta_chunks=4,
                  chunks=4, unchanged=[0.96]),
    ]
    table = delta_table(cases, bf16_bytes=1000, floor=0.01)
    delta_row = next(line for line in table.splitlines() if "| delta |" in line)
    assert "| AdamW | 1 | delta | 96.00% |" in delta_row
    assert "(5.0%)" in delta_row and "| 4/4 |" in delta_row
    assert "| 0.50 | 10.0 |" in delta_row  # x full, x memcpy
    assert "memcpy of the bf16 version" in table


def test_bench_offers_ray_delta():
    args = build_parser().parse_args(["bench", "--transports", "ray-delta", "--sizes", "400MB"])
    assert args.transports == ["ray-delta"]


def test_link_rate_is_parsed_and_checked_before_any_cluster():
    import pytest

    from weightsync.bench.multihost import link_burst_bytes, parse_link_rate

    assert parse_link_rate("10gbit") == 10**10
    assert parse_link_rate("1Gbit") == 10**9
    assert parse_link_rate("500mbit") == 5 * 10**8
    assert link_burst_bytes("10gbit") == 12_500_000  # 10 ms of traffic
    assert link_burst_bytes("1mbit") == 64 * 1024  # never below one GSO packet
    with pytest.raises(ValueError, match="link rate"):
        parse_link_rate("10 gigs")
    args = build_parser().parse_args(["bench", "--transports", "ray-delta", "--link-rate", "1gbit"])
    assert args.link_rate == "1gbit"
    assert build_parser().parse_args(["bench"]).link_rate is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--link-rate", "fast"])
