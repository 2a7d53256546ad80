"""What the demo shows: a live table in a terminal (a line every few seconds elsewhere) and,
at the end, a plot of return, send latency and version lag over training time."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from weightsync.units import format_duration

SOLVED_RETURN = 475.0


class Display:
    """A live rich table in a terminal; one plain line every few seconds elsewhere (CI)."""

    def __init__(self, live: bool, log: Callable[[str], None]) -> None:
        self.log = log
        self.live = None
        self.last_line = 0.0
        if live:
            from rich.console import Console

            console = Console()
            if console.is_terminal:
                from rich.live import Live

                self.live = Live(console=console, refresh_per_second=8)

    def start(self) -> None:
        if self.live is not None:
            self.live.start()

    def update(self, iteration: int, version: int, mean_return: float, lag: float,
               send_seconds: float, seconds: float) -> None:
        if self.live is not None:
            from rich.table import Table

            table = Table(title="weightsync demo: CartPole-v1")
            for name in ("time", "iteration", "version", "mean return (last 20)",
                         "version lag", "send"):
                table.add_column(name, justify="right")
            table.add_row(format_duration(seconds), str(iteration), str(version),
                          f"{mean_return:.1f}", f"{lag:.2f}", format_duration(send_seconds))
            self.live.update(table)
        elif iteration == 1 or time.monotonic() - self.last_line > 2.0:
            self.last_line = time.monotonic()
            self.log(f"{format_duration(seconds):>7}  iteration {iteration:4d}  version "
                     f"{version:4d}  mean return {mean_return:6.1f}  lag {lag:.2f}  send "
                     f"{format_duration(send_seconds)}")

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def plot_history(history: Sequence[dict[str, float]], episodes: int, path: str, title: str,
                 solved_at: float | None) -> str:
    """Return, send latency and version lag against seconds of training, to PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    fig, (top, middle, bottom) = plt.subplots(
        3, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1.4, 1]})
    t = [h["t"] for h in history]
    top.plot(t, [h["mean_return"] for h in history], color="tab:blue",
             label="mean return of the last 20 episodes")
    top.axhline(SOLVED_RETURN, color="grey", linestyle="--", linewidth=1,
                label=f"solved ({SOLVED_RETURN:.0f})")
    if solved_at is not None:
        top.axvline(solved_at, color="tab:green", linewidth=1)
        top.text(solved_at, 25, f"solved at {format_duration(solved_at)} ", ha="right",
                 va="bottom", color="tab:green",
                 bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    top.set_ylabel("return")
    top.set_ylim(0, 520)
    top.legend(loc="upper left", fontsize=8)
    top.set_title(f"{title} ({episodes} episodes)")

    middle.plot(t, [h["send_ms"] for h in history], ".", markersize=3, color="tab:orange")
    middle.set_yscale("log")
    middle.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    middle.yaxis.set_minor_locator(LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    middle.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    middle.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))
    middle.set_ylabel("send (ms, log)")
    middle.grid(True, which="major", axis="y", alpha=0.3)

    bottom.plot(t, [h["lag"] for h in history], color="tab:purple", linewidth=1)
    bottom.set_ylabel("version lag\nof each batch")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("seconds of training (after the collectors started)")
    bottom.set_xlim(left=0)
    fig.align_ylabels()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
