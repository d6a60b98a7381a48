"""The two ZeRO-3s with the offload side by side: `tightfit train --strategy zero3 --offload host` with
`--zero3-params fsdp2` (FSDP2's all-gathers from each rank's host memory) and `exchange` (each unit's owner sending it),
alternating, and what `--zero3-params auto` predicted and chose ([Note: two ZeRO-3s with the offload] in
tightfit/parallel/zero3_path.py).

Why: the plan runs FSDP2's only where it predicts it at most `FSDP2_BY` of the exchange's step; this checks the
prediction's ratio against the measured one on the machine at hand, for each `--grad-accum` given (FSDP2 gathers for
each micro-batch, the exchange once per pass in unit-major order). Each run is a fresh `tightfit train`; its tokens/s
is the median of its progress lines after the first step's (a line a step). Prints one JSON object.

    .venv/bin/python benchmarks/bench_zero3_paths.py --accum 1 4 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args, accum: int, path: str, out: Path) -> tuple[float, str]:
    """(median tokens/s over the progress lines after the first, stdout) of one 2-rank run."""
    cmd = [sys.executable, "-m", "tightfit.cli", "train", "--nproc-per-node", str(args.ranks), "--strategy", "zero3",
           "--offload", "host", "--zero3-params", path, "--n-layer", str(args.layers), "--n-embd", str(args.embd),
           "--n-head", str(args.heads), "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len),
           "--grad-accum", str(accum), "--steps", str(args.steps), "--log-interval", "1", "--eval-interval", "1000",
           "--keep-checkpoints", "0", "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"bench_zero3_paths: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    rates = [json.loads(line)["tokens_per_s"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    return statistics.median(rates[1:]), proc.stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accum", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    args = p.parse_args()
    report = {"model": vars(args), "accum": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for accum in args.accum:
            _, said = run(args, accum, "auto", Path(tmp) / f"auto{accum}")
            line = re.search(r"ZeRO-3 with --offload: (FSDP2's|the offload engine's exchange) .*: predicted step: "
                             r"FSDP2's all-gathers ([0-9,]+) ms, the exchange ([0-9,]+) ms", said)
            fsdp2_ms, exchange_ms = (float(g.replace(",", "")) for g in line.groups()[1:])
            sides = {"fsdp2": [], "exchange": []}
            for r in range(args.rounds):
                for path in ("exchange", "fsdp2") if r % 2 == 0 else ("fsdp2", "exchange"):
                    sides[path].append(run(args, accum, path, Path(tmp) / f"{path}{accum}-{r}")[0])
            best = {k: max(v) for k, v in sides.items()}
            report["accum"][accum] = {
                "tokens_per_s": sides, "measured_fsdp2_over_exchange": best["fsdp2"] / best["exchange"],
                "predicted_step_ms": {"fsdp2": fsdp2_ms, "exchange": exchange_ms},
                "predicted_fsdp2_over_exchange": exchange_ms / fsdp2_ms,  # as tokens/s: the inverse of the steps'
                "auto_ran": "fsdp2" if line.group(1) == "FSDP2's" else "exchange",
                "faster_measured": max(best, key=best.get)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
