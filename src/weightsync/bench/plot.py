"""The bench chart: one bar per row, its median as a multiple of the floor measured beside
it, a colour per transport, the median itself in a column of its own right of the bars."""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.bench.rows import BenchRow
from weightsync.units import format_duration

#: transport (the label's first words) -> colour; anything else is grey
COLOURS = {
    "shm zero-copy": "tab:green", "shm": "tab:blue", "mp floor": "tab:gray", "mp": "tab:orange",
    "ray node-local": "tab:purple", "ray broadcast": "tab:red", "file": "tab:brown",
}


def transport_of(label: str) -> str:
    """The colour key of a row label: ``"shm zero-copy publish"`` -> ``"shm zero-copy"``."""
    for key in sorted(COLOURS, key=len, reverse=True):
        if label == key or label.startswith(key + " ") or label.startswith(key + ":"):
            return key
    return label.split(" ")[0]


def write_plot(rows: Sequence[BenchRow], path: str, title: str = "weightsync bench") -> str:
    """Draw ``rows`` to the PNG ``path``; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    labels = [f"{r.transport.removeprefix(transport_of(r.transport)).strip(' :') or 'send'}"
              f"  ({transport_of(r.transport)}, {r.size}, {r.workers} worker"
              f"{'s' if r.workers > 1 else ''})" for r in rows]
    colours = [COLOURS.get(transport_of(r.transport), "tab:gray") for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(rows) + 1.8))
    bars = ax.barh(range(len(rows)), [r.ratio for r in rows], color=colours)
    for bar, r in zip(bars, rows, strict=True):  # the phase: light, full or hatched
        if r.transport.endswith("publish") or r.transport.endswith("send"):
            bar.set_alpha(0.55)
        elif r.transport.endswith("apply in worker"):
            bar.set_hatch("///")
            bar.set_edgecolor("white")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}x"))
    ax.set_xlabel("median as a multiple of the floor measured in the same run (dashed line: "
                  "1x; memcpy, or gloo p2p for ray), log scale")
    medians_at = ax.get_yaxis_transform()  # x in axes fraction, y in rows
    ax.text(1.01, -1, "median", transform=medians_at, fontsize=8, fontweight="bold", va="center")
    for i, r in enumerate(rows):
        ax.text(1.01, i, format_duration(r.median_ms / 1e3), transform=medians_at, fontsize=8,
                va="center")
    used = list(dict.fromkeys(transport_of(r.transport) for r in rows))
    handles = [Patch(color=COLOURS.get(t, "tab:gray"), label=t) for t in used]
    handles += [Patch(facecolor="black", alpha=0.55, label="publish / send"),
                Patch(facecolor="black", label="applied everywhere"),
                Patch(facecolor="black", hatch="///", edgecolor="white", label="apply in worker")]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8,
               frameon=False)
    ax.set_title(title)
    height = fig.get_figheight()
    fig.tight_layout(rect=(0, 0.55 / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
