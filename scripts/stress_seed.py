"""Run the engine's randomised stress (tests/test_offload_deadlock.py's STRESS) many times for the given seeds.

Why: a race shows in one run of several; the test runs each seed once. This counts the runs that fail (a hang, an
error, or a loss that is not bit-equal to the unbudgeted run's) and keeps each failure's output.

    .venv/bin/python scripts/stress_seed.py --runs 30 --seeds 41 [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--seeds", default="41", help="comma-separated seeds, one subprocess runs them all")
    ap.add_argument("--keep", default=tempfile.gettempdir(), help="where a failing run's output goes")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_offload_deadlock import STRESS

    env = {**os.environ, "HANG_S": "250", "TIGHTFIT_STRICT_MOVER": "1", "PYTHONPATH": str(ROOT)}
    failed = 0
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as cwd:
            proc = subprocess.run([sys.executable, "-c", STRESS, args.seeds], capture_output=True, text=True,
                                  timeout=300, cwd=cwd, env=env)
        if proc.returncode:
            failed += 1
            out = Path(args.keep) / f"stress-{args.seeds.replace(',', '_')}-{i}.txt"
            out.write_text(proc.stdout + "\n----\n" + proc.stderr)
            print(f"run {i}: failed ({out})", flush=True)
    print(f"{failed} of {args.runs} runs failed (seeds {args.seeds})")


if __name__ == "__main__":
    main()
