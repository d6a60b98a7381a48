"""benchmarks/RESULTS.md's summary is what benchmarks/summary.py makes of the benchmarks' JSON: edited by hand, or
left behind by a new figure, it fails here (`make results` regenerates it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_results_summary_is_generated_from_the_json():
    proc = subprocess.run([sys.executable, "benchmarks/summary.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
