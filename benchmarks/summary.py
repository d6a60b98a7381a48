"""RESULTS.md's summary and the README's pictures, regenerated from the JSON the benchmarks wrote.

    .venv/bin/python benchmarks/summary.py           # rewrite the summary block of benchmarks/RESULTS.md and the PNGs
    .venv/bin/python benchmarks/summary.py --check   # exit 1 if the block is not what the JSON says (make test runs it)

Why generated: a summary typed by hand drifts from the figures it summarises (RESULTS.md's opening once said no
CUDA figure existed, five GPU runs after the first). Sources, newest first within each table:
- benchmarks/gpu-runs/*/figures.json: what `make gpu-check` wrote on a lent GPU (FSDP2 comparison, the default run's
  plan against its measurement);
- benchmarks/results/*.json: CPU figures, each file naming its command, machine, date and the RESULTS section it
  comes from (some transcribed from a section's table where the run's own JSON was not kept: their "source" says so).
The block sits between the markers below in RESULTS.md; the journal after it is written by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "RESULTS.md"
BEGIN, END = "<!-- summary:begin (benchmarks/summary.py writes this block) -->", "<!-- summary:end -->"
IMAGES = ROOT / "docs" / "img"


def _fsdp(d: dict) -> bool:
    return bool(d.get("fsdp", {}).get("tokens_per_s_ratio"))


def _planned(d: dict) -> bool:
    return bool((d.get("train") or {}).get("plan_vs_measured"))


def gpu_runs(has=lambda d: True) -> list[tuple[str, dict]]:
    """(run, figures) of the GPU runs that measured what `has` asks for, of the newest such date (older ones
    measured code changed since), oldest first; a run without figures.json gives what its train-metrics.jsonl
    holds. Per question: a run that did not measure the FSDP2 comparison leaves the last one that did."""
    out = []
    for folder in sorted(p for p in (HERE / "gpu-runs").iterdir() if p.is_dir()):
        d = json.loads((folder / "figures.json").read_text()) if (folder / "figures.json").is_file() else {}
        metrics = folder / "train-metrics.jsonl"
        if not (d.get("train") or {}).get("plan_vs_measured") and metrics.is_file():
            for line in metrics.read_text().splitlines():
                record = json.loads(line)
                if record.get("kind") == "plan_vs_measured":
                    d.setdefault("train", {})["plan_vs_measured"] = record
        if d and has(d):
            out.append((folder.name, d))
    newest = max((name[:10] for name, _ in out), default="")
    return [(name, d) for name, d in out if name[:10] == newest]


def results(prefix: str) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted((HERE / "results").glob(f"{prefix}*.json"))]


def _link(section: str, text: str) -> str:
    return f"[{text}](#{section})"


def _where(d: dict) -> str:
    """Machine, date, commit (where the benchmark recorded it) and the section, for a table's caption."""
    commit = f", commit {d['commit']}" if d.get("commit") else ", commit not recorded"
    return f"{d['machine']}, {d['date']}{commit}; {_link(d['section'], 'the section')}"


def fsdp_table(runs) -> list[str]:
    lines = ["| GPU run (its torch) | FSDP2 CPU offload | tightfit (its plan) | ratio | tightfit at FSDP2's peak memory "
             "| ratio |", "| --- | --- | --- | --- | --- | --- |"]
    for name, d in reversed(runs):
        f = d.get("fsdp")
        if not f or "tokens_per_s_ratio" not in f:
            continue
        c = f["config"]
        gib = lambda side: (f"{f[side]['peak_cuda_allocated'] / 2**30:.2f} GiB"
                            if "peak_cuda_allocated" in f[side] else "-")
        lines.append(
            f"| {name} ({d.get('env', {}).get('torch', '?')}; {c['layers']} layers x {c['embd']}, {c['dtype']}, "
            f"cap {c['cap_gib']:g} GiB) | "
            f"{f['fsdp2']['tokens_per_s']:,.0f} tok/s, {gib('fsdp2')} | {f['tightfit']['tokens_per_s']:,.0f} tok/s, "
            f"{gib('tightfit')} | **{f['tokens_per_s_ratio']:.2f}x** | "
            f"{f['tightfit-at-fsdp2-peak']['tokens_per_s']:,.0f} tok/s, {gib('tightfit-at-fsdp2-peak')} | "
            f"**{f['tokens_per_s_ratio_at_fsdp2_peak']:.2f}x** |")
    return lines


def deepspeed_table() -> list[str]:
    lines = []
    for d in reversed(results("deepspeed")):
        ratios = [p["tightfit_step_s"] / p["deepspeed_step_s"] for p in d["pairs"]]
        rss = [p["tightfit_rss_gb"] / p["deepspeed_rss_gb"] for p in d["pairs"]]
        lines += _table(f"{d['figure']} ({_where(d)}):",
                        ["pair", "tightfit step", "DeepSpeed step", "ratio", "peak RSS tightfit / DeepSpeed"],
                        [[str(i), f"{p['tightfit_step_s']:.2f} s", f"{p['deepspeed_step_s']:.2f} s", f"{ratio:.2f}",
                          f"{p['tightfit_rss_gb']:.2f} / {p['deepspeed_rss_gb']:.2f} GB"]
                         for i, (p, ratio) in enumerate(zip(d["pairs"], ratios), 1)])
        lines += [f"Step time {min(ratios):.2f}-{max(ratios):.2f}x DeepSpeed's, peak RSS {min(rss):.2f}-"
                  f"{max(rss):.2f}x. Source: {d['source']}.", ""]
    return lines


def plan_table(runs) -> list[str]:
    lines = ["| GPU run | quantity | predicted | measured | error |", "| --- | --- | --- | --- | --- |"]
    for name, d in reversed(runs):
        pvm = (d.get("train") or {}).get("plan_vs_measured")
        if not pvm:
            continue
        p, m = pvm["predicted"], pvm["measured"]
        for key, what, fmt in (("device_peak", "default run: device peak", lambda v: f"{v / 2**20:.1f} MiB"),
                               ("step_s", "default run: step", lambda v: f"{v * 1e3:.1f} ms")):
            if key in p and key in m and m[key]:
                lines.append(f"| {name} | {what} | {fmt(p[key])} | {fmt(m[key])} | {(p[key] - m[key]) / m[key]:+.1%} |")
    return lines


def _table(caption: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A captioned Markdown table, with the blank lines around it."""
    return [caption, "", "| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def ddp_table() -> list[str]:
    lines = []
    for d in reversed(results("ddp-engine")):
        lines += _table(f"{d['figure']} ({_where(d)}):", ["run", "loop seconds (two rounds)"],
                        [[r["run"], " / ".join(f"{s:.2f}" for s in r["seconds"])] for r in d["runs"]])
    return lines


def tokenize_table() -> list[str]:
    lines = []
    for d in reversed(results("sft-tokenize")):
        lines += _table(f"{d['figure']} (`{d['command']}`; {_where(d)}):",
                        ["tokenizer of the records", "seconds", "MB/s", "peak RSS"],
                        [[name, f"{r['wall_s']:.1f}", f"{d['mb'] / r['wall_s']:.2f}", f"{r['peak_rss_mib']:.0f} MiB"]
                         for name, r in d["rows"].items()])
    return lines


def block() -> str:
    parts = [
        BEGIN, "",
        "## Summary: the latest figure for each question",
        "",
        "Generated by `benchmarks/summary.py` from the JSON each benchmark wrote (`benchmarks/gpu-runs/*/figures."
        "json`, `benchmarks/results/*.json`); the sections after this one are the journal, oldest first.",
        "",
        "### How fast against FSDP2's CPU offload (a lent H200; 1.2 B GPT, bf16, `GPU_CHECK_STAGES=fsdp make "
        "gpu-check`)",
        "", *fsdp_table(gpu_runs(_fsdp)), "",
        "![tightfit against FSDP2's CPU offload](../docs/img/fsdp2.png)", "",
        "### How fast against DeepSpeed ZeRO-3 with every state on NVMe", "", *deepspeed_table(),
        "![tightfit against DeepSpeed ZeRO-3 on NVMe](../docs/img/deepspeed.png)", "",
        "### Several ranks with the offload engine", "", *ddp_table(),
        "### Fine-tuning records: tokenizing", "", *tokenize_table(),
        "### The plan against the run (lent H200)", "", *plan_table(gpu_runs(_planned)), "",
        "![predicted against measured](../docs/img/plan_vs_measured.png)", "",
        END,
    ]
    return "\n".join(parts)


def plots() -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMAGES.mkdir(parents=True, exist_ok=True)
    written = []
    runs = [(n, d["fsdp"]) for n, d in gpu_runs(_fsdp)]
    if runs:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        sides = [("fsdp2", "FSDP2 CPU offload"), ("tightfit", "tightfit, its plan"),
                 ("tightfit-at-fsdp2-peak", "tightfit at FSDP2's peak memory")]
        width = 0.8 / len(sides)
        for i, (key, label) in enumerate(sides):
            ax.bar([j + i * width for j in range(len(runs))], [f[key]["tokens_per_s"] for _, f in runs], width,
                   label=label)
        ax.set_xticks([j + width for j in range(len(runs))], [n for n, _ in runs])
        ax.set_ylabel("tokens/s")
        ax.set_title("1.2 B GPT under an 8 GiB cap, H200 (higher is better)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(IMAGES / "fsdp2.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    deepspeed = results("deepspeed")
    if deepspeed:
        d = deepspeed[-1]
        fig, ax = plt.subplots(figsize=(7, 3.2))
        pairs = d["pairs"]
        xs = range(len(pairs))
        ax.bar([x - 0.2 for x in xs], [p["deepspeed_step_s"] for p in pairs], 0.4, label="DeepSpeed ZeRO-3, NVMe")
        ax.bar([x + 0.2 for x in xs], [p["tightfit_step_s"] for p in pairs], 0.4, label="tightfit, NVMe")
        ax.set_xticks(list(xs), [f"pair {i + 1}" for i in xs])
        ax.set_ylabel("seconds a step")
        ax.set_ylim(0, 1.3 * max(p["deepspeed_step_s"] for p in pairs))
        ax.set_title(f"GPT-2-small, every state on NVMe, 2-core CPU VM, {d['date']} (lower is better)")
        ax.legend(fontsize=8, loc="upper center", ncol=2)
        fig.tight_layout()
        written.append(IMAGES / "deepspeed.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    points = []
    for n, d in gpu_runs(_planned):
        pvm = (d.get("train") or {}).get("plan_vs_measured")
        if pvm and pvm["measured"].get("device_peak"):
            points.append((n, pvm["predicted"], pvm["measured"]))
    if points:
        fig, axes = plt.subplots(1, 2, figsize=(7, 3.2))
        for ax, key, scale, unit, title in ((axes[0], "device_peak", 2**-20, "MiB", "device peak"),
                                            (axes[1], "step_s", 1e3, "ms", "step time")):
            xs = [m[key] * scale for _, _, m in points]
            ys = [p[key] * scale for _, p, _ in points]
            ax.scatter(xs, ys)
            lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
            ax.set_xlabel(f"measured ({unit})")
            ax.set_ylabel(f"predicted ({unit})")
            ax.set_title(f"default run, H200: {title}")
        fig.tight_layout()
        written.append(IMAGES / "plan_vs_measured.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exit 1 if RESULTS.md's block is not the regenerated one")
    args = ap.parse_args()
    text = RESULTS.read_text()
    if BEGIN not in text or END not in text:
        print(f"{RESULTS}: no summary markers", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = head + block() + tail
    if args.check:
        if new != text:
            print("benchmarks/RESULTS.md's summary is not what benchmarks/summary.py makes of the JSON: run it",
                  file=sys.stderr)
            return 1
        return 0
    RESULTS.write_text(new)
    for f in plots():
        print(f"wrote {f.relative_to(ROOT)}")
    print(f"wrote the summary of {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
