"""The step-time model where the host bounds the step: predicted vs measured, with and without the engine's floor.

A small model's step is the host issuing ops, not the kernels: on the first GPU run the default model's step was
predicted at 2.9 ms from its kernels and measured at 16.0 ms. On this CPU the same happens at small shapes (the
default model at 1 x 8 tokens: 1.6 ms predicted, 7.2 ms measured). The model now adds the engine's own host time
per unit (more for a unit that streams) and per step, which the probe measures by running the engine ([Note: the
host floor] in tightfit/planner/costs.py). Each case here is planned twice from the same probed profile, side by side:
- before: the profile with the engine's figures zeroed (the model as it was: kernels + traced ops);
- after: the profile as probed.
and trained by `tightfit train`'s own loop (in process, every state on the device tier or the plan's placement),
its step measured as the difference of a short and a longer run (so set-up and the first steps do not count).

    .venv/bin/python benchmarks/bench_host_floor.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

CASES = [  # (label, extra flags)
    ("default model, 1 x 8 tokens", ["--micro-batch", "1", "--seq-len", "8"]),
    ("default model, 2 x 32 tokens", ["--micro-batch", "2", "--seq-len", "32"]),
    ("2 blocks x 64, 1 x 8", ["--micro-batch", "1", "--seq-len", "8", "--n-layer", "2", "--n-embd", "64"]),
    ("8 blocks x 64, 1 x 8", ["--micro-batch", "1", "--seq-len", "8", "--n-layer", "8", "--n-embd", "64"]),
    ("16 blocks x 64, 1 x 8", ["--micro-batch", "1", "--seq-len", "8", "--n-layer", "16", "--n-embd", "64"]),
    ("8 blocks x 64, grad-accum 2", ["--micro-batch", "1", "--seq-len", "8", "--n-layer", "8", "--n-embd", "64",
                                     "--grad-accum", "2"]),
    ("default model, host tier", ["--micro-batch", "1", "--seq-len", "8", "--offload", "host"]),
    ("default run (16 x 128)", []),
]
SHORT, LONG = 30, 130


def _cfg(extra: list[str], steps: int):
    from tightfit.cli import _parser
    from tightfit.config import config_from_args

    argv = ["train", "--steps", str(steps), "--keep-checkpoints", "0", "--eval-interval", "100000",
            "--log-interval", "100000", "--out-dir", "/tmp/bench-host-floor", "--warmup-steps", "1", *extra]
    return config_from_args(_parser().parse_args(argv))


def measured_step(extra: list[str]) -> float:
    from tightfit.train.loop import train

    short = train(_cfg(extra, SHORT), quiet=True).seconds
    long = train(_cfg(extra, LONG), quiet=True).seconds
    return (long - short) / (LONG - SHORT)


def predicted_steps(extra: list[str]) -> tuple[float, float, float]:
    """(before, after, after's host part) seconds per step, from this machine's probed profile."""
    from tightfit.planner import make_plan
    from tightfit.planner.probe import load_or_probe
    from tightfit.train.loop import build_meta_model

    cfg = _cfg(extra, LONG)
    model = build_meta_model(cfg)
    hw = load_or_probe()
    after = make_plan(model, cfg, hw).prediction
    before = make_plan(model, cfg, replace(hw, unit_overhead_s=0.0, stream_overhead_s=0.0,
                                           step_overhead_s=0.0)).prediction
    return before.step_s, after.step_s, after.host_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    from tightfit.planner.probe import load_or_probe

    hw = load_or_probe()
    print(f"profile: op {hw.op_overhead_s * 1e6:.2f} us, engine {hw.unit_overhead_s * 1e3:.3f} ms per unit and "
          f"micro-batch (+{hw.stream_overhead_s * 1e3:.3f} ms streamed), {hw.step_overhead_s * 1e3:.3f} ms per step; "
          f"{hw.threads} threads; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print("| case | measured | before | after (host part) | before vs measured | after vs measured |")
    print("|---|---|---|---|---|---|")
    rows = []
    for label, extra in CASES:
        before, after, host = predicted_steps(extra)
        measured = measured_step(extra)
        row = {"case": label, "flags": extra, "measured_s": measured, "before_s": before, "after_s": after,
               "after_host_s": host}
        rows.append(row)
        print(f"| {label} | {measured * 1e3:.2f} ms | {before * 1e3:.2f} ms | {after * 1e3:.2f} ms "
              f"({host * 1e3:.2f}) | {before / measured - 1:+.0%} | {after / measured - 1:+.0%} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": hw.to_dict(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
