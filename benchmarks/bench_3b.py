"""Benchmark (issue 15): a 3B Llama trained with its states on NVMe; the plan's peak RSS and step time against the
process's own.

    python benchmarks/bench_3b.py --cpu-mem 12GiB --dir /tmp/tf3b          # the issue's case, ~15 min
    python benchmarks/bench_3b.py --size 1b --cpu-mem 5GiB --dir /tmp/tf1b  # the same mismatch, scaled down
    python benchmarks/bench_3b.py --size tiny --cpu-mem 1GiB                # a smoke run (~1 min)

What it does: writes a config-only Hugging Face folder (LlamaConfig; random init, unit by unit, never whole in
RAM), runs `tightfit train --model hf:FOLDER --micro-batch 1 --seq-len 128 --nvme SWAP --log-interval 1` as a
subprocess (plus `--cpu-mem`, `--offload` when given), samples the child's RSS every 20 ms, and once `--steps`
steps are done interrupts it (SIGINT: the trainer closes its engine, which deletes the swap files). It writes no
checkpoint (`--keep-checkpoints 0`): it measures the steps. (A 3B run's own last checkpoint, 38 GiB, takes the swap
files' place as it is written, so the disk needs the swap and one unit more: benchmarks/RESULTS.md, batch AC.)
Reported:
- predicted: the plan's process RSS (the line `tightfit train` prints) and step time;
- measured: the child's RSS high-water mark (the kernel's VmHWM, read just before the interrupt: every allocation
  counts, however short; the 20 ms samples give the time of the peak) and the median wall time of the steps after
  the first (from metrics.jsonl; the first includes the engine recording its order and the first disk reads);
- the engine's own meters at the peak sample (device in use, host tier + pool), and CPU pressure from
  /proc/pressure/cpu over the run (other processes on a shared machine slow the steps; PSI "some" says how much);
- where the steps after the first spent their time (`phases`, from /proc/PID/io and the child's CPU time sampled
  every 0.25 s): seconds per step with the cores busy (compute-bound), with the cores idle (waiting, here on the
  disk) and in between, and the disk's read and write rates in each. Held against the plan's time terms, this says
  which term a wrong prediction got wrong.

Disk: the swap folder holds 16 bytes per parameter (51 GB for 3B); `--dir` must have that free.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

GiB = 1024**3

SIZES = {
    # open_llama_3b's shape (the case): 3.43 B parameters, 26 blocks of 124 M.
    "3b": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    # TinyLlama's block width with full attention heads, vocab 32000: 1.3 B parameters, 22 blocks of 50 M.
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "tiny": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, vocab_size=32000),
}


def write_config(folder: str, size: str) -> None:
    os.makedirs(folder, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1,
           "eos_token_id": 2, "torch_dtype": "float32", **SIZES[size]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def _psi_some_us() -> int | None:
    try:
        with open("/proc/pressure/cpu") as f:
            return int(re.search(r"some .*total=(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return None


def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _faults_and_cpu(pid: int) -> tuple[int, float] | None:
    """The child's minor page faults and CPU seconds (user + system, all threads) so far, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[7]), (int(fields[11]) + int(fields[12])) / tick  # minflt, utime + stime


def _io_and_cpu(pid: int) -> tuple[int, int, float] | None:
    """The child's bytes read from and written to storage (/proc/PID/io) and its CPU seconds so far."""
    fc = _faults_and_cpu(pid)
    try:
        with open(f"/proc/{pid}/io") as f:
            io = dict(line.split(": ") for line in f.read().splitlines())
        return int(io["read_bytes"]), int(io["write_bytes"]), fc[1] if fc else 0.0
    except (OSError, KeyError, ValueError):
        return None


BUSY, IDLE = 0.7, 0.35
"""Shares of the cores (CPU seconds per wall second / threads) above which a second of a step counts as "cores
busy", and below which as "cores idle": the latter is time the step spends waiting (on the disk, here)."""


def phases(io_samples: list[tuple[float, int, int, float]], start: float, end: float, threads: int) -> dict:
    """Seconds between `start` and `end` in which the child kept the cores busy, left them idle, or neither, and the
    disk's bytes per second in each: where a step's time goes, which the plan's terms can be held against."""
    out = {k: {"s": 0.0, "read": 0, "written": 0} for k in ("cores busy", "cores idle", "between")}
    window = [s for s in io_samples if start <= s[0] <= end]
    for a, b in itertools.pairwise(window):
        dt = b[0] - a[0]
        if dt <= 0:
            continue
        share = (b[3] - a[3]) / dt / threads
        k = "cores busy" if share >= BUSY else "cores idle" if share <= IDLE else "between"
        out[k]["s"] += dt
        out[k]["read"] += b[1] - a[1]
        out[k]["written"] += b[2] - a[2]
    return {k: {"s": round(v["s"], 1), "read_GBps": round(v["read"] / v["s"] / 1e9, 2) if v["s"] else 0.0,
                "write_GBps": round(v["written"] / v["s"] / 1e9, 2) if v["s"] else 0.0} for k, v in out.items()}


def _bytes(text: str) -> int:
    from tightfit.utils.sizes import parse_size

    return parse_size(text.replace(" ", ""), "size")


def run(args) -> dict:
    import psutil

    model_dir, swap, out = (os.path.join(args.dir, x) for x in ("model", "swap", "out"))
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(swap, ignore_errors=True)
    write_config(model_dir, args.size)
    cmd = [sys.executable, "-c", "import sys; from tightfit.cli import main; sys.exit(main(sys.argv[1:]))",
           "train", "--model", f"hf:{model_dir}", "--micro-batch", "1", "--seq-len", "128", "--nvme", swap,
           "--steps", "1000", "--log-interval", "1", "--eval-interval", "1000", "--eval-batches", "1",
           "--out-dir", out, "--keep-checkpoints", "0"]
    if args.cpu_mem:
        cmd += ["--cpu-mem", args.cpu_mem]
    if args.offload:
        cmd += ["--offload", args.offload]
    print("$", " ".join(cmd[3:]), flush=True)
    psi0, t0 = _psi_some_us(), time.time()
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"},
                             # A shell's background job starts with SIGINT ignored, and Python then keeps it so:
                             # the child must see the interrupt that ends it below.
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    proc = psutil.Process(child.pid)
    samples: list[tuple[float, int]] = []
    io_samples: list[tuple[float, int, int, float]] = []  # (s, bytes read, bytes written, CPU s), every 0.25 s
    stop = threading.Event()

    def sample() -> None:
        n = 0
        while not stop.is_set():
            try:
                samples.append((time.time() - t0, proc.memory_info().rss))
            except psutil.Error:
                return
            if n % 12 == 0:
                io = _io_and_cpu(child.pid)
                if io:
                    io_samples.append((time.time() - t0, *io))
            n += 1
            time.sleep(0.02)

    threading.Thread(target=sample, daemon=True).start()
    lines, steps_seen, hwm, at_steps, step_ends = [], 0, None, [], []
    for line in child.stdout:
        lines.append(line.rstrip())
        print(f"  [{time.time() - t0:7.1f}s] {line.rstrip()}", flush=True)
        if line.startswith("step "):
            steps_seen += 1
            step_ends.append(time.time() - t0)
            at_steps.append(_faults_and_cpu(child.pid))
            if steps_seen >= args.steps:
                hwm = _vm_hwm(child.pid)
                child.send_signal(signal.SIGINT)  # the trainer closes its engine (swap files go), no checkpoint
                break
    try:
        child.wait(timeout=600)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    stop.set()
    wall = time.time() - t0
    psi1 = _psi_some_us()
    shutil.rmtree(swap, ignore_errors=True)

    text = "\n".join(lines)
    res: dict = {"size": args.size, "cpu_mem": args.cpu_mem, "offload": args.offload or "auto",
                 "steps_done": steps_seen, "returncode": child.returncode, "wall_s": round(wall, 1)}
    m = re.search(r"predicted peak: (.*)", text)
    res["plan_peaks"] = m.group(1) if m else None
    m = re.search(r"process RSS ([\d.]+ [KMGT]?i?B)", text)
    res["predicted_rss"] = _bytes(m.group(1)) if m else None
    m = re.search(r"predicted step: ([\d,.]+) ms", text)
    res["predicted_step_s"] = float(m.group(1).replace(",", "")) / 1e3 if m else None
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    if len(step_ends) >= 2:  # the steps after the first, as one stretch: where their time went
        res["phases"] = phases(io_samples, step_ends[0], step_ends[-1], threads)
        res["phases_steps"], res["phases_cores"] = len(step_ends) - 1, threads
    res["measured_rss_hwm"] = hwm
    res["measured_rss_sampled"] = max((r for _, r in samples), default=None)
    peak_t = max(samples, key=lambda s: s[1])[0] if samples else None
    res["peak_at_s"] = round(peak_t, 1) if peak_t is not None else None
    metrics = os.path.join(out, "metrics.jsonl")
    recs = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            recs = [json.loads(x) for x in f if '"train"' in x]
    elapsed = [r["elapsed_s"] for r in recs]
    step_s = [b - a for a, b in itertools.pairwise(elapsed)]
    res["step_times_s"] = [round(elapsed[0], 1)] + [round(s, 1) for s in step_s] if elapsed else []
    res["measured_step_s"] = statistics.median(step_s) if step_s else None
    # Per step after the first: minor page faults (each a first touch of a 4 KiB page, or of a 2 MiB one with
    # transparent huge pages) and CPU seconds; both count work, not waiting, so load on the machine moves them little.
    per = [(b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(at_steps) if a and b]
    res["minflt_per_step"] = statistics.median(f for f, _ in per) if per else None
    res["cpu_s_per_step"] = round(statistics.median(c for _, c in per), 1) if per else None
    res["thp_env"] = os.environ.get("THP_MEM_ALLOC_ENABLE")
    res["engine_memory_last"] = recs[-1]["memory"] if recs else None
    if psi0 is not None and psi1 is not None:
        res["cpu_pressure_some"] = round((psi1 - psi0) / 1e6 / wall, 3)  # fraction of the run with a task waiting
    return res


def _gib(b: int | None) -> str:
    return f"{b / GiB:.2f} GiB" if b else "-"


def report(res: dict) -> None:
    print("\nresult:", json.dumps(res))
    pr, meas = res["predicted_rss"], res["measured_rss_hwm"] or res["measured_rss_sampled"]
    if pr and meas:
        print(f"peak RSS: predicted {_gib(pr)}, measured {_gib(meas)} (VmHWM; sampled "
              f"{_gib(res['measured_rss_sampled'])} at {res['peak_at_s']} s): {(pr - meas) / meas * 100:+.0f}%")
    ps, ms = res["predicted_step_s"], res["measured_step_s"]
    if ps and ms:
        print(f"step time: predicted {ps:.1f} s, measured {ms:.1f} s (median of steps 2..{res['steps_done']}): "
              f"{(ps - ms) / ms * 100:+.0f}%")
    if res.get("minflt_per_step") is not None:
        print(f"per step: {res['minflt_per_step']:,.0f} minor page faults, {res['cpu_s_per_step']} CPU s")
    if res.get("phases"):
        n = res["phases_steps"]
        print(f"where the steps after the first went ({n} steps, {res['phases_cores']} cores; per step):")
        for k, v in res["phases"].items():
            print(f"  {k:<11} {v['s'] / n:6.1f} s   disk {v['read_GBps']:.2f} GB/s read, {v['write_GBps']:.2f} GB/s "
                  "written")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="3b")
    ap.add_argument("--cpu-mem", default=None, help="the trainer's --cpu-mem (default: none, the machine's RAM)")
    ap.add_argument("--offload", default=None, help="the trainer's --offload (default: auto)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps to measure (the first is warm-up)")
    ap.add_argument("--dir", default="/tmp/tightfit-bench-3b", help="folder for the config, swap and run")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    report(run(args))


if __name__ == "__main__":
    main()
