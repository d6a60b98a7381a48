"""The run as a picture: loss and memory per tier over the steps, read back from metrics.jsonl, as a PNG.

Why from metrics.jsonl: it is the run's one record of what was measured (the printed lines and TensorBoard show the
same records), so the picture can also be drawn later for any run folder (`plot_run(folder)`), and the training
loop draws nothing while it trains. The plan's pictures (predicted memory over one step, where each unit's states
live) are drawn by planner/trace.py; this is the measured side.

Drawn at the end of `tightfit train --plot` (not by default: a figure costs about a second of CPU, which a short
run, or a test suite of many, should not pay unasked). Needs matplotlib (`pip install tightfit[plot]`): `--plot`
without it is refused before any work; `plot_run` itself returns None without it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tightfit.errors import UsageError

PNG_NAME = "run.png"


def matplotlib_pyplot():
    """pyplot on the file-only Agg backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def require() -> None:
    """`--plot` without matplotlib: one line, before any work (config.validate calls it)."""
    if matplotlib_pyplot() is None:
        raise UsageError("--plot: matplotlib is not installed; pip install 'tightfit[plot]' (or matplotlib), "
                         "or leave out --plot")


def plot_run(folder: str | Path) -> Path | None:
    """Draw `folder/metrics.jsonl` into `folder/run.png`: train/val loss (top), memory per tier in MiB (bottom)."""
    plt = matplotlib_pyplot()
    folder = Path(folder)
    metrics = folder / "metrics.jsonl"
    if plt is None or not metrics.is_file():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if not train:
        return None
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="val loss")
    ax_loss.set_ylabel("loss (nats/token)")
    ax_loss.legend()
    steps = [r["step"] for r in train]
    tiers = list(dict.fromkeys(t for r in train for t in r.get("memory", {})))  # in the order Progress reports
    # The process RSS (offloaded runs report it beside the tiers) includes the runtime's hundreds of MiB: on its
    # own axis, so the tiers' MiB stay readable.
    for tier in (t for t in tiers if t != "rss"):
        ax_mem.plot(steps, [r["memory"].get(tier, 0) / 2**20 for r in train], label=tier)
    ax_mem.set_xlabel("step")
    ax_mem.set_ylabel("MiB in use")
    ax_mem.set_title("measured memory per tier at each report")
    handles, labels = ax_mem.get_legend_handles_labels()
    if "rss" in tiers:
        ax_rss = ax_mem.twinx()
        ax_rss.plot(steps, [r["memory"]["rss"] / 2**20 for r in train], "k--", label="process RSS (right)")
        ax_rss.set_ylabel("process RSS (MiB)")
        ax_rss.set_ylim(bottom=0)
        more_h, more_l = ax_rss.get_legend_handles_labels()
        handles, labels = handles + more_h, labels + more_l
    ax_mem.legend(handles, labels)
    fig.tight_layout()
    path = folder / PNG_NAME
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path
