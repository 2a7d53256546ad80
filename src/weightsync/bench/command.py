"""``weightsync bench`` itself: run the chosen transports, show progress, print the table
(and any skipped configuration), write the JSON and the chart if asked."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from weightsync.bench.rows import BenchRow, format_table, write_json


def _progress(total: int) -> tuple[Callable[[str], None], Callable[[], None]]:
    """A progress bar on stderr (rich, if installed; plain lines otherwise) and its stop."""
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        done = 0

        def line(what: str) -> None:
            nonlocal done
            done += 1
            print(f"[{done}/{total}] measuring {what}...", file=sys.stderr, flush=True)

        return line, lambda: None
    bar = Progress(transient=True, console=Console(stderr=True))
    task = bar.add_task("weightsync bench", total=total)
    count = 0

    def update(what: str) -> None:
        nonlocal count
        bar.update(task, completed=count, description=f"measuring {what}")
        count += 1

    bar.start()
    return update, bar.stop


def run_bench_command(args: argparse.Namespace) -> int:
    from weightsync.bench.local import run_bench
    from weightsync.units import parse_size

    args.sizes = [(text, parse_size(text)) for text in args.sizes]

    local = [t for t in args.transports if t in ("shm", "mp", "net")]
    modes = len(args.shm_modes) if "shm" in local else 0
    total = len(args.sizes) * (len(args.workers) * (len(local) - ("shm" in local) + modes
                                                    + 2 * ("ray" in args.transports))
                               + 2 * ("file" in args.transports)
                               + ("sharded" in args.transports)
                               + 2 * (len(args.workers) + 1) * ("ray-delta" in args.transports)
                               + 4 * len(args.link_rates) * ("vllm-serve" in args.transports)
                               + len(args.hosts) * len(args.link_rates)
                               * ("net-pool" in args.transports))
    total += (args.repeats + 3) * ("lora" in args.transports)
    progress, stop = _progress(total)
    notes: list[str] = []
    rows: list[BenchRow] = []
    tables: list[str] = []
    try:
        if local:
            rows += run_bench(local, args.sizes, args.workers, args.repeats, progress,
                              shm_modes=args.shm_modes, step_s=args.worker_step_ms / 1e3,
                              device=args.device, notes=notes)
        if "ray" in args.transports:
            from weightsync.bench.ray_actors import run_ray_bench

            for size, nbytes in args.sizes:
                rows += run_ray_bench(size, nbytes, args.workers, args.repeats, progress)
        if "file" in args.transports:
            from weightsync.bench.directory import run_directory_bench

            places = {"/dev/shm": "/dev/shm", "local disk": args.disk_dir}
            for size, nbytes in args.sizes:
                rows += run_directory_bench(size, nbytes, places, args.repeats, progress)
        if "sharded" in args.transports:
            from weightsync.bench.sharded import run_sharded_bench

            for size, nbytes in args.sizes:
                rows += run_sharded_bench(size, nbytes, args.repeats, progress,
                                          world=args.trainer_ranks)
        if "ray-delta" in args.transports:
            from weightsync.bench.ray_delta import run_delta_bench

            for size, nbytes in args.sizes:
                delta_rows, table = run_delta_bench(size, nbytes, args.workers, args.repeats,
                                                    progress, link_rate=args.link_rate)
                rows += delta_rows
                link = f", link capped at {args.link_rate}" if args.link_rate else ""
                tables.append(f"Delta updates across hosts, {size} fp32 sent as bf16{link}:"
                              f"\n{table}")
        if "lora" in args.transports:
            from weightsync.bench.lora import run_lora_bench

            rows += run_lora_bench(args.lora_ranks, args.repeats, progress, notes)
        if "vllm-serve" in args.transports:
            from weightsync.bench.vllm_serve import run_vllm_serve_bench

            for size, nbytes in args.sizes:
                serve_rows, table = run_vllm_serve_bench(size, nbytes, args.link_rates,
                                                         args.repeats, progress)
                rows += serve_rows
                tables.append(f"vllm serve on another host, {size} fp32 sent as bf16:\n{table}")
        if "net-pool" in args.transports:
            from weightsync.bench.net_pool import run_pool_bench

            for size, nbytes in args.sizes:
                pool_rows, table = run_pool_bench(size, nbytes, args.hosts, args.link_rates,
                                                  args.repeats, progress)
                rows += pool_rows
                tables.append(f"A pool of hosts relaying, {size} fp32 sent as bf16:\n{table}")
    finally:
        stop()
    print(format_table(rows))
    for table in tables:
        print(f"\n{table}")
    for note in notes:
        print(f"note: {note}")
    if args.json:
        write_json(rows, args.json)
        print(f"rows written to {args.json}")
    if args.plot:
        from weightsync.bench.plot import write_plot

        write_plot(rows, args.plot)
        print(f"chart written to {args.plot}")
    return 0
