"""The ``weightsync`` command: ``demo`` (the main job) and ``bench`` (the speed tables)."""

from __future__ import annotations

import argparse
import logging
import sys


def _demo(args: argparse.Namespace) -> int:
    from weightsync.demo import run_demo

    result = run_demo(
        args.transport, args.workers, max_iterations=args.max_iterations,
        max_seconds=args.max_seconds, seed=args.seed, plot=args.plot or None,
        live=not args.no_live,
    )
    return 0 if result.solved or args.max_iterations < 100_000 or args.allow_unsolved else 1


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from weightsync.bench import (
        format_table,
        run_bench,
        run_directory_bench,
        write_json,
        write_plot,
    )

    n_local = len([t for t in args.transports if t in ("shm", "mp")]) * len(args.workers)
    total = len(args.sizes) * (n_local + ("ray" in args.transports) * len(args.workers)
                               + ("file" in args.transports) * 2)
    bar = Progress(transient=True, console=Console(stderr=True))
    task = bar.add_task("weightsync bench", total=total)
    done = 0

    def progress(what: str) -> None:  # called as each configuration starts
        nonlocal done
        bar.update(task, completed=done, description=f"measuring {what}")
        done += 1

    bar.start()
    local = [t for t in args.transports if t in ("shm", "mp")]
    rows = run_bench(local, args.sizes, args.workers, args.repeats, progress) if local else []
    if "ray" in args.transports:
        from weightsync.bench import run_ray_bench

        for size in args.sizes:
            rows += run_ray_bench(size, args.workers, args.repeats, progress)
    if "file" in args.transports:
        places = {"/dev/shm": "/dev/shm", "local disk": args.disk_dir}
        for size in args.sizes:
            rows += run_directory_bench(size, places, args.repeats, progress)
    bar.update(task, completed=total)
    bar.stop()
    print(format_table(rows))
    if args.json:
        write_json(rows, args.json)
    if args.plot:
        write_plot(rows, args.plot)
    return 0


def _available_transports() -> list[str]:
    import importlib.util

    ray = ["ray"] if importlib.util.find_spec("ray") is not None else []
    return ["shm", "mp", *ray, "file"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="learn CartPole with collectors kept in sync")
    demo.add_argument("--transport", choices=["shm", "mp", "file", "ray"], default="shm")
    demo.add_argument("--workers", type=int, default=2, help="collector processes (actors)")
    demo.add_argument("--max-iterations", type=int, default=100_000,
                      help="stop after this many training steps (a short run: e.g. 15)")
    demo.add_argument("--max-seconds", type=float, default=180.0)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--plot", default="weightsync-demo.png", help="PNG path ('' for none)")
    demo.add_argument("--no-live", action="store_true", help="plain log lines, no live table")
    demo.add_argument("--allow-unsolved", action="store_true", help="exit 0 even if unsolved")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="time send() against one memcpy of the same bytes")
    bench.add_argument("--transports", nargs="+", default=_available_transports(),
                       choices=["shm", "mp", "ray", "file"],
                       help="default: every transport available here (ray if installed)")
    bench.add_argument("--disk-dir", default=".", help="a directory on local disk (file transport)")
    bench.add_argument("--sizes", nargs="+", default=["1MB", "400MB"], choices=["1MB", "400MB"])
    bench.add_argument("--workers", nargs="+", type=int, default=[1, 2, 4])
    bench.add_argument("--repeats", type=int, default=10)
    bench.add_argument("--json", help="also write the rows to this JSON file")
    bench.add_argument("--plot", help="also draw the ratios to this PNG file")
    bench.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
