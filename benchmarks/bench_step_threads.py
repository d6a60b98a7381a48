"""Where a training step's CPU goes, per thread: the thread that runs forward/backward against the engine's own.

    .venv/bin/python benchmarks/bench_step_threads.py --steps 30            # every state on NVMe, step during backward
    .venv/bin/python benchmarks/bench_step_threads.py --steps 30 --device   # every state on the device tier

Why: on a 2-core machine the all-NVMe step is slower than compute-only by the engine's CPU work beside the compute,
not by I/O (benchmarks/RESULTS.md, overlap). This prints, per step, forward / backward / optimizer wall times and the
main thread's wait for parameter fetches; then, over the steps after `--skip`, each thread's CPU time (user, sys),
its time runnable but not running (run-queue wait, /proc/<pid>/task/<tid>/schedstat) and its context switches
(voluntary: it blocked; involuntary: it was preempted), grouped by thread name. The model is the overlap
benchmark's (24 blocks of width 384, every block checkpointed, 1 torch thread).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import bench_offload as bo  # noqa: E402
from tightfit import Placement, Tier  # noqa: E402
from tightfit.offload.step.engine import engine_of  # noqa: E402


def _threads() -> dict[str, list[float]]:
    """Thread name -> [user s, sys s, run-queue wait s, voluntary switches, involuntary switches], summed."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {str(t.native_id): t.name.rstrip("0123456789-_") for t in threading.enumerate()}
    out: dict[str, list[float]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            wait_ns = int(open(f"/proc/self/task/{tid}/schedstat").read().split()[1])
            status = dict(line.split(":\t") for line in open(f"/proc/self/task/{tid}/status").read().splitlines()
                          if ":\t" in line)
        except OSError:  # the thread ended
            continue
        row = out.setdefault(names.get(tid, "other"), [0.0] * 5)
        for i, v in enumerate((int(stat[11]) / tick, int(stat[12]) / tick, wait_ns / 1e9,
                               int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))):
            row[i] += v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default="/tmp/tf_bench")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the per-thread totals")
    ap.add_argument("--device", action="store_true", help="every state on the device tier: compute only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bo._warm_up()
    cfg = bo._config(args)
    ckpt = [f"blocks.{i}" for i in range(cfg.n_layer)]
    folder = Path(args.folder) / "threads"
    shutil.rmtree(folder, ignore_errors=True)
    if args.device:
        placement = Placement.everywhere(Tier.DEVICE, checkpoint_units=ckpt)
    else:
        placement = Placement.everywhere(Tier.NVME, nvme_dir=str(folder), prefetch_depth=2, checkpoint_units=ckpt)
    model, opt = bo._build(cfg, placement)
    engine = engine_of(model)
    times, start, t_start = [], None, 0.0
    for step in range(args.steps):
        if step == args.skip:
            start, t_start = _threads(), time.perf_counter()
        engine.reset_timings()
        t0 = time.perf_counter()
        x, y = bo._batch(cfg, 1, step)
        loss = model(x, y)
        t1 = time.perf_counter()
        if not args.device:
            opt.step_during_backward()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        wait = engine.timings().get("params_wait_s", 0.0)
        print(f"step {step:2d}: {t3 - t0:.3f} s  forward {t1 - t0:.3f}  backward {t2 - t1:.3f}  optimizer {t3 - t2:.3f}"
              f"  params wait {wait:.3f}  loss {loss.item():.4f}", flush=True)
    wall = time.perf_counter() - t_start
    end = _threads()
    median = statistics.median(times[args.skip:])
    print(f"steps {args.skip}..{args.steps - 1}: median {median:.3f} s, wall {wall:.2f} s")
    for name, row in sorted(end.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        d = [a - b for a, b in zip(row, start.get(name, [0.0] * 5))]
        if d[0] + d[1] > 0.01:
            print(f"  {name:16s} cpu {d[0]:6.2f} user {d[1]:5.2f} sys | run-queue wait {d[2]:5.2f} s | "
                  f"switches: {int(d[3]):6d} blocked {int(d[4]):5d} preempted")
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
