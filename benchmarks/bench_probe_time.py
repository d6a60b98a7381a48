"""What a first run on a new machine pays for the probe: seconds per measurement of `run_probe`, as `tightfit train`
runs it when the cache holds no profile of this machine (`probe_apart`: the quick probe, no sustained disk figure).

    .venv/bin/python benchmarks/bench_probe_time.py [--nvme DIR] [--json-out PATH]

Each `measure_*` function of tightfit/planner/probe.py is timed where `run_probe` calls it (the wrapper adds a
clock read per call), so the parts sum to the probe's time; the profile is cached as `tightfit probe` caches it, so
the runs after this one on the same machine reuse it. Printed: the parts, slowest first, and the whole.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu_util as util  # noqa: E402


def timed_probe(folder: str | None) -> tuple[float, dict[str, float]]:
    """(the probe's seconds, seconds by measurement) of one `run_probe(folder, sustained=False)`."""
    from tightfit.planner import probe

    parts: dict[str, float] = {}

    def clocked(name, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
        return run

    originals = {n: getattr(probe, n) for n in dir(probe) if n.startswith("measure_")}
    try:
        for name, fn in originals.items():
            setattr(probe, name, clocked(name, fn))
        t0 = time.perf_counter()
        probe.run_probe(folder, sustained=False)
        total = time.perf_counter() - t0
    finally:
        for name, fn in originals.items():
            setattr(probe, name, fn)
    # measure_engine_overhead runs inside _engine_overhead; the rest of the probe is its own line.
    parts["(outside the measurements)"] = max(0.0, total - sum(parts.values()))
    return total, parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme", default=None, help="swap folder whose disk the probe measures (default: none)")
    ap.add_argument("--json-out", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    import torch

    t0 = time.perf_counter()
    torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu")
    init = time.perf_counter() - t0
    total, parts = timed_probe(args.nvme)
    for name, s in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"{name:32s} {s:7.2f} s", file=sys.stderr)
    print(f"{'probe':32s} {total:7.2f} s (device start before it: {init:.2f} s)", file=sys.stderr)
    out = {"benchmark": "bench_probe_time", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
           else "cpu", "threads": torch.get_num_threads(), "probe_s": total, "device_init_s": init, "parts_s": parts}
    util.write_json(args.json_out, out)


if __name__ == "__main__":
    main()
