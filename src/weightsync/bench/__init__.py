"""``weightsync bench``: each transport timed as a user feels it, until ``send()`` returns
and until every worker's model holds the version, beside the machine's own floor (one
memcpy, or one device-to-device copy) measured in the same run."""

from weightsync.bench.floors import copy_times, memcpy_floor, socket_times
from weightsync.bench.local import LocalTimes, bench_local, make_model, run_bench
from weightsync.bench.rows import BenchRow, format_table, make_row, write_json

__all__ = [
    "BenchRow",
    "LocalTimes",
    "bench_local",
    "copy_times",
    "format_table",
    "make_model",
    "make_row",
    "memcpy_floor",
    "run_bench",
    "socket_times",
    "write_json",
]
