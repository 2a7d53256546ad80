"""The weightsync command: demo (learn CartPole with collectors kept in sync) and bench
(each transport timed against the machine's own floor)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from collections.abc import Sequence

from weightsync import __version__
from weightsync.units import parse_size

DESCRIPTION = """\
Keep many workers' weights in sync with one trainer.

  weightsync demo     learn CartPole-v1 while collector processes play with synced weights
  weightsync bench    time each transport against one memcpy of the same bytes

Run 'weightsync demo --help' or 'weightsync bench --help' for their options."""

#: what each command needs beyond the core, as (module, extra) pairs
DEMO_NEEDS = [("gymnasium", "demo"), ("rich", "demo"), ("matplotlib", "demo")]
TRANSPORT_NEEDS = {"ray": [("ray", "ray")], "ray-delta": [("ray", "ray"), ("zstandard", "delta")],
                   "lora": [("vllm", "vllm"), ("peft", "lora"), ("transformers", "hf")],
                   "vllm-serve": [("vllm", "vllm"), ("zstandard", "delta")]}

#: exit status for a missing extra (as argparse uses for a usage error) and after Ctrl-C
EXIT_MISSING_EXTRA = 2
EXIT_INTERRUPTED = 130


class MissingExtra(Exception):
    """A module the command needs is not installed; the message says what to install."""


def require(needs: Sequence[tuple[str, str]], command: str) -> None:
    """Raise :class:`MissingExtra` naming every missing module and the one install line."""
    missing = [(module, extra) for module, extra in needs if not _installed(module)]
    if missing:
        extras = ",".join(dict.fromkeys(extra for _, extra in missing))
        modules = ", ".join(module for module, _ in missing)
        raise MissingExtra(f"{command} needs {modules}: pip install 'weightsync[{extras}]'")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module set to None
        return False


def _link_rate(text: str) -> str:
    """A tc link rate (``10gbit``), checked here so that a typo fails before a cluster."""
    from weightsync.bench.multihost import parse_link_rate

    try:
        parse_link_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _size(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _llm_demo(args: argparse.Namespace) -> int:
    """``weightsync demo --llm``: a policy-gradient loop between a trainer and vLLM."""
    if not (_installed("vllm") and _installed("transformers")):
        raise MissingExtra("weightsync demo --llm needs vLLM and transformers: pip install "
                           "'weightsync[vllm,hf]' (on CPU: bash scripts/env.sh installs vLLM's CPU build)")
    if args.lora:
        require([("peft", "lora")], "weightsync demo --llm --lora")
    from weightsync.demo.llm import LLMDemoOptions, PromiseBroken, run_llm_demo

    options = LLMDemoOptions(
        steps=args.steps, max_seconds=args.max_seconds, model_size=args.model_size,
        sync=args.sync, tensor_parallel=args.tensor_parallel, seed=args.seed,
        lora=args.lora, lora_rank=args.lora_rank,
        output_dir=args.output_dir, plot=not args.no_plot,
        log=lambda line: print(line, flush=True),
    )
    try:
        result = run_llm_demo(options)
    except PromiseBroken as exc:
        print(f"weightsync demo --llm: {exc}", file=sys.stderr)
        return 1
    return EXIT_INTERRUPTED if result.interrupted else 0


def _demo(args: argparse.Namespace) -> int:
    if args.llm:
        return _llm_demo(args)
    if args.collector == "torchrl":
        try:
            from weightsync.demo.torchrl import run_demo as run_torchrl_demo
        except ImportError as exc:
            raise MissingExtra(f"weightsync demo --collector torchrl needs TorchRL ({exc}): "
                               "pip install 'weightsync[torchrl]'") from None
        outcome = run_torchrl_demo(args)
        return outcome if isinstance(outcome, int) else 0
    require(DEMO_NEEDS + TRANSPORT_NEEDS.get(args.transport, []), "weightsync demo")
    from weightsync.demo.trainer import CollectorError, run_demo

    try:
        result = run_demo(
            args.transport, args.workers, max_iterations=args.max_iterations,
            max_seconds=args.max_seconds, seed=args.seed, output_dir=args.output_dir,
            plot=not args.no_plot, live=not args.no_live,
        )
    except CollectorError as exc:
        print(f"weightsync demo: {exc}", file=sys.stderr)
        return 1
    if result.interrupted:
        return EXIT_INTERRUPTED
    return 0 if result.solved or args.max_iterations < 100_000 or args.allow_unsolved else 1


def _bench(args: argparse.Namespace) -> int:
    needs = [need for t in args.transports for need in TRANSPORT_NEEDS.get(t, [])]
    require(needs + ([("matplotlib", "demo")] if args.plot else []), "weightsync bench")
    from weightsync.bench.command import run_bench_command

    return run_bench_command(args)


def _available_transports() -> list[str]:
    return ["shm", "mp", *(["ray"] if _installed("ray") else []), "file"]


class _DefaultsShown(argparse.HelpFormatter):
    """Help that ends each option with its default, lists written as they are typed."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; building it imports nothing heavy."""
    fmt = _DefaultsShown
    parser = argparse.ArgumentParser(prog="weightsync", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"weightsync {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log what weightsync does (INFO level)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench}")

    demo = sub.add_parser("demo", formatter_class=fmt,
                          help="learn CartPole with collector processes kept in sync",
                          description="Learn CartPole-v1 with REINFORCE while collector "
                          "processes play episodes with weights synced after every step.")
    demo.add_argument("--transport", choices=["shm", "mp", "file", "ray"], default="shm",
                      help="how weights reach the collectors")
    demo.add_argument("--collector", choices=["weightsync", "torchrl"], default="weightsync",
                      help="weightsync's own collector processes, or TorchRL's collectors")
    demo.add_argument("--workers", type=_positive_int, default=2,
                      help="collector processes (Ray actors with --transport ray)")
    demo.add_argument("--max-iterations", type=_positive_int, default=100_000,
                      help="stop after this many training steps (e.g. 15 for a short run)")
    demo.add_argument("--max-seconds", type=float, default=180.0,
                      help="stop after this many seconds of training")
    demo.add_argument("--seed", type=int, default=0, help="seed of the trainer and collectors")
    demo.add_argument("--output-dir", default="demo-output",
                      help="where the plot (weightsync-demo-TRANSPORT.png) is written")
    demo.add_argument("--no-plot", action="store_true", help="write no plot")
    demo.add_argument("--no-live", action="store_true",
                      help="plain log lines instead of a live table")
    demo.add_argument("--allow-unsolved", action="store_true",
                      help="exit 0 even if CartPole was not solved")
    llm = demo.add_argument_group("the LLM demo (--llm)")
    llm.add_argument("--llm", action="store_true",
                     help="instead of CartPole: RL post-training of a small LM served by vLLM")
    llm.add_argument("--steps", type=_positive_int, default=1000,
                     help="policy-gradient steps (each: generate, train, sync)")
    llm.add_argument("--model-size", choices=["tiny", "small"], default="tiny",
                     help="tiny (0.3 M parameters) or small (~100 M: the sync cost shows)")
    llm.add_argument("--sync", choices=["weightsync", "reload"], default="weightsync",
                     help="weightsync's directory + update_engine, or a checkpoint + vLLM's "
                     "reload_weights (what users write today)")
    llm.add_argument("--tensor-parallel", type=_positive_int, default=1,
                     help="vLLM tensor-parallel size")
    llm.add_argument("--lora", action="store_true",
                     help="train a LoRA adapter (peft) and sync it alone into vLLM")
    llm.add_argument("--lora-rank", type=_positive_int, default=16,
                     help="--lora only: the adapter's rank")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", formatter_class=fmt,
                           help="time each transport against one memcpy of the same bytes",
                           description="Time each transport until send() returns and until "
                           "every worker's model holds the version, beside one memcpy of the "
                           "same bytes measured in the same run.")
    bench.add_argument("--transports", nargs="+", default=_available_transports(),
                       choices=["shm", "mp", "net", "ray", "file", "sharded", "ray-delta",
                                "lora", "vllm-serve", "net-pool"],
                       help="transports to time (ray only if installed; net: the network "
                       "scheme on loopback, one host's workers sharing its fetch; sharded: an FSDP2 "
                       "trainer of --trainer-ranks ranks into SharedMem, beside the gather "
                       "baseline, with 2 zero-copy workers; ray-delta: full vs delta=True "
                       "bf16 sends to a second host, two network namespaces this command "
                       "builds, root only; lora: LoRA adapter-only sync vs the full merged "
                       "sync into a vLLM engine, on the LLM demo's small model; vllm-serve: a "
                       "Llama-shaped model of each size sent as bf16 to a real vllm serve on "
                       "a second host, beside a bare TCP transfer and the naive checkpoint "
                       "copy, at each --link-rates, root only; net-pool: the network scheme "
                       "over --hosts hosts that relay, the trainer's uplink capped at each "
                       "--link-rates, root only)")
    bench.add_argument("--sizes", nargs="+", type=_size, default=["1MB", "400MB"],
                       metavar="SIZE", help="model sizes: 512KB, 100MB, 2GB, 1GiB, ...")
    bench.add_argument("--workers", nargs="+", type=_positive_int, default=[1, 2, 4],
                       help="numbers of workers")
    bench.add_argument("--repeats", type=_positive_int, default=10,
                       help="sends timed per configuration (medians are reported)")
    bench.add_argument("--shm-modes", nargs="+", choices=["copy", "zero-copy"],
                       default=["copy", "zero-copy"],
                       help="SharedMem receivers that copy each version, or view it in place")
    bench.add_argument("--worker-step-ms", type=float, default=1.0,
                       help="each worker's simulated environment step between two poll()s")
    bench.add_argument("--device", default="cpu", help="where the weights live (cpu, cuda)")
    bench.add_argument("--disk-dir", default=".",
                       help="a directory on local disk (file transport)")
    bench.add_argument("--trainer-ranks", type=_positive_int, default=2,
                       help="FSDP2 ranks of the sharded trainer (sharded transport)")
    bench.add_argument("--link-rate", type=_link_rate, default=None, metavar="RATE",
                       help="ray-delta only: cap the link between the two hosts at RATE "
                       "(tc syntax: 10gbit, 1gbit, 500mbit; default: uncapped, memory speed)")
    bench.add_argument("--lora-ranks", nargs="+", type=_positive_int, default=[8, 16, 32, 64],
                       help="lora only: adapter ranks (on every attention and MLP projection)")
    bench.add_argument("--link-rates", nargs="+", type=_link_rate, default=["1gbit", "10gbit"],
                       metavar="RATE", help="vllm-serve and net-pool only: the link caps to "
                       "measure at (net-pool: the trainer's uplink)")
    bench.add_argument("--hosts", nargs="+", type=_positive_int, default=[1, 2, 4, 6],
                       help="net-pool only: numbers of hosts (one worker each)")
    bench.add_argument("--json", help="also write the rows to this JSON file")
    bench.add_argument("--plot", help="also draw the ratios to this PNG file")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s: %(message)s")
        logging.getLogger("weightsync").setLevel(logging.INFO)
    try:
        return int(args.func(args))
    except MissingExtra as exc:
        print(exc, file=sys.stderr)  # it names the command already
        return EXIT_MISSING_EXTRA
    except KeyboardInterrupt:
        print("weightsync: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
