"""The trainer's predicted process RSS against its measured peak on a CPU-only machine, over GPT shapes whose
activations run from 72 MiB (the default run) to over 500 MiB; with glibc's heap statistics at the peak.

    .venv/bin/python benchmarks/bench_cpu_rss.py [--steps 40] [--code DIR ...] [--env VAR=VALUE ...]

Why: on a CPU the activations are the process heap's, and glibc keeps what they free ([Note: the heap at the step's
peak] in tightfit/planner/costs.py). Each case is `tightfit train` in a fresh process (`train(cfg)` on the
default corpus, no checkpoints, no evaluation); its own "process RSS predicted / measured" line (the kernel's
high-water mark) is read back, and a sampler thread records the heap's free bytes (`mallinfo2`) at the RSS peak.
Each `--code` folder (a worktree of another commit) is measured in turn; `--env` sets glibc's tunables for a run
(`MALLOC_MMAP_THRESHOLD_=131072`: every large block a fresh mapping, freed at once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4, 128, 4, 16, 128), (4, 256, 4, 8, 128), (6, 384, 6, 8, 128), (8, 512, 8, 8, 128), (4, 128, 4, 64, 128),
          (4, 256, 4, 16, 512)]  # n_layer, n_embd, n_head, micro_batch, seq_len; the first is the default run

CHILD = r"""
import contextlib, ctypes, io, json, re, shutil, sys, tempfile, threading, time
import psutil
from tightfit.config import Config
from tightfit.train.loop import train

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
n_layer, n_embd, n_head, micro_batch, seq_len, steps = map(int, sys.argv[1:7])
cfg = Config()
cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head = n_layer, n_embd, n_head
cfg.train.micro_batch, cfg.train.seq_len, cfg.train.steps = micro_batch, seq_len, steps
cfg.train.keep_checkpoints, cfg.train.eval_interval = 0, 10**9
out = tempfile.mkdtemp()
cfg.train.out_dir = out + "/run"
peak = {"rss": 0, "free": 0}
stop = threading.Event()

def sample():
    proc = psutil.Process()
    while not stop.is_set():
        rss = proc.memory_info().rss
        if rss > peak["rss"]:
            peak["rss"], peak["free"] = rss, libc.mallinfo2().fordblks
        time.sleep(0.001)

threading.Thread(target=sample, daemon=True).start()
text = io.StringIO()
with contextlib.redirect_stdout(text):
    summary = train(cfg)
stop.set()
shutil.rmtree(out, ignore_errors=True)
line = next(x for x in text.getvalue().splitlines() if "process RSS  predicted" in x)
step = re.search(r"step time\s+predicted\s+([0-9.]+) ms\s+measured\s+([0-9.]+) ms", text.getvalue())
print(json.dumps({"rss_line": line.strip(), "heap_free_at_peak_mib": peak["free"] / 2**20,
                  "step_ms": [float(step.group(1)), float(step.group(2))] if step else None,
                  "train_loss": summary.train_loss}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--code", action="append", default=[], help="a folder whose tightfit to measure (default: this)")
    ap.add_argument("--env", action="append", default=[], help="VAR=VALUE for the runs (glibc's tunables)")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env)
    for code in args.code or [str(ROOT)]:
        env = dict(os.environ, PYTHONPATH=code, **extra)
        for shape in SHAPES:
            out = subprocess.run([sys.executable, "-c", CHILD, *map(str, shape), str(args.steps)], env=env,
                                 cwd="/tmp", capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps({"code": code, "env": extra, "shape": shape, **row}), flush=True)


if __name__ == "__main__":
    main()
