"""Acceptance benchmark of the planner: predicted vs measured memory per tier and step time on CPU.

3 model sizes x 3 budget settings (all-in-memory, host-limited, NVMe-heavy). The machine is probed once
(`run_probe`, cached); every case then runs in a fresh process (clean RSS): plan from the cached probe, wrap the
model with the plan's placement, train a few steps with `tightfit.optim.AdamW`, and report
- device: the engine's own peak count (device-tier states + materialised units; what the budget governs);
- host: host-tier states + the engine's buffer pool peak;
- nvme: bytes in the swap folder;
- RSS: peak resident set during the timed steps (sampled every 2 ms), against runtime + host + CPU-device bytes;
- step: median wall time of the timed steps.
No constant is fitted per case: every prediction comes from the probe and the meta-device profile. Because this
machine is shared, each case re-measures the compute-side speeds (`refresh_speeds`, ~3 s) just before planning.

    .venv/bin/python benchmarks/bench_planner.py [--steps 4] [--sizes small,medium,large]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SIZES = {"small": (4, 256, 4), "medium": (6, 384, 6), "large": (8, 512, 8)}  # n_layer, n_embd, n_head
MICRO_BATCH, SEQ_LEN = 8, 128


def budgets(setting: str, states: int, act: int, staging: int, nvme_dir: str, floor: int) -> dict:
    """Budgets of each setting, as fractions of the model's own needs (so every size exercises the same regime).

    `staging`: one unit's optimizer working set, which the engine requires in host memory once NVMe is used.
    `floor`: the process's runtime RSS; on this CPU-only machine --cpu-mem bounds the whole process, so it holds
    the floor and the --gpu-mem "device" besides the host share."""
    if setting == "all-in-memory":
        return {}
    if setting == "host-limited":  # device: activations + a third of the states; host: a third; rest to NVMe
        device, host = int(act * 1.3 + states * 0.35), int(states * 0.35 + 3 * staging)
    else:  # NVMe-heavy: a small device and host share (host room for 4 optimizer working sets), the rest on NVMe
        device, host = int(act * 1.3 + states * 0.12), int(states * 0.12 + 4 * staging)
    return {"gpu_mem": str(device), "cpu_mem": str(floor + device + host), "nvme": nvme_dir}


def run_case(size: str, setting: str, steps: int, nvme_dir: str) -> dict:
    import threading
    from dataclasses import replace

    import psutil
    import torch

    import tightfit
    from tightfit.config import Config
    from tightfit.models.gpt import GPT, GPTConfig
    from tightfit.offload.step.engine import engine_of
    from tightfit.optim import AdamW
    from tightfit.planner import make_plan
    from tightfit.planner.costs import act_bytes
    from tightfit.planner.probe import load_or_probe, refresh_speeds
    from tightfit.train.memory import process_floor

    n_layer, n_embd, n_head = SIZES[size]
    gcfg = GPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=n_head, block_size=SEQ_LEN)
    # The machine is shared and its load changes by the minute: the compute-side speeds are measured again here,
    # in this process, just before planning (disk and runtime figures come from the cached probe).
    hw = refresh_speeds(load_or_probe(nvme_dir))
    cfg = Config()
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.device = MICRO_BATCH, SEQ_LEN, "cpu"
    with torch.device("meta"):
        meta = GPT(gcfg)
    # The floor of this process, as `tightfit train` measures its own (train/memory.py): the probe's is a fresh
    # process that has not re-measured the compute rates.
    hw = replace(hw, runtime_rss=max(hw.runtime_rss, process_floor(meta)))
    probe = make_plan(meta, cfg, hw)  # all-in-memory plan: the model's own needs
    states = sum(probe.tier_bytes().values())
    act = act_bytes(probe.profile, set())
    staging = max(20 * u.numel for u in probe.profile.units)
    for k, v in budgets(setting, states, act, staging, nvme_dir, hw.runtime_rss).items():
        setattr(cfg.memory, k, v)
    plan = make_plan(meta, cfg, hw)

    torch.manual_seed(0)
    model = GPT(gcfg)
    tightfit.wrap(model, plan.placement, device="cpu")
    opt = AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (MICRO_BATCH, SEQ_LEN))
    proc = psutil.Process()
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    def step():
        loss = model(x, x)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # warm-up: records the unit order, allocates buffers
        step()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    stop.set()
    t.join()
    eng = engine_of(model)
    rep = eng.memory_report()
    device = rep["device"]["peak"]  # the engine's peak: device-tier states + materialised units + grads
    measured = {"device_engine_peak": device,
                "host_peak": rep["host"]["tier"] + rep["host"]["staging_peak"],
                "nvme_peak": rep["nvme"]["bytes"], "rss_peak": peak[0], "step_s": sorted(times)[len(times) // 2]}
    pr = plan.prediction
    predicted = {"device_engine_peak": pr.engine_device, "host_peak": pr.peak["host"],
                 "nvme_peak": pr.peak["nvme"], "rss_peak": pr.rss(False), "step_s": pr.step_s}
    budget = {"device": plan.budgets["device"], "host": plan.budgets["host"], "nvme": plan.budgets["nvme"]}
    return {"size": size, "setting": setting, "params": meta.num_params(), "predicted": predicted,
            "measured": measured, "budget": budget, "bottleneck": pr.bottleneck,
            "placement": plan.summary().splitlines()[0]}


def _err(p, m):
    return (p - m) / m * 100 if m else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sizes", default="small,medium,large")
    ap.add_argument("--settings", default="all-in-memory,host-limited,NVMe-heavy")
    ap.add_argument("--nvme", default=None, help="swap folder (default: a temporary folder)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case, print JSON
    args = ap.parse_args()
    nvme_dir = args.nvme or tempfile.mkdtemp(prefix="tightfit-benchplan-")
    if args.case:
        size, setting = args.case.split("/")
        print("RESULT " + json.dumps(run_case(size, setting, args.steps, nvme_dir)))
        return
    from tightfit.planner.probe import run_probe

    t0 = time.time()
    hw = run_probe(nvme_dir)
    print(f"probe: {time.time() - t0:.1f} s; matmul {max(hw.matmul_flops.values()) / 1e9:.0f} GFLOP/s, memory "
          f"{hw.mem_bw / 1e9:.1f} GB/s, op {hw.op_overhead_s * 1e6:.1f} us, AdamW {hw.cpu_adam_rate / 1e6:.0f} M/s, "
          f"disk r/w {hw.nvme_read_bw / 1e9:.2f}/{hw.nvme_write_bw / 1e9:.2f} GB/s, runtime RSS "
          f"{hw.runtime_rss / 2**20:.0f} MiB")
    rows = []
    for size in args.sizes.split(","):
        for setting in args.settings.split(","):
            try:
                out = subprocess.run([sys.executable, __file__, "--case", f"{size}/{setting}", "--steps",
                                      str(args.steps), "--nvme", nvme_dir], capture_output=True, text=True,
                                     env={**os.environ}, timeout=600)
            except subprocess.TimeoutExpired:
                print(f"{size}/{setting}: TIMEOUT (engine did not finish the steps in 600 s)")
                continue
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"{size}/{setting}: FAILED\n{out.stderr[-2000:]}")
                continue
            rows.append(json.loads(line[7:]))
    keys = [("device_engine_peak", "device", 2**20), ("host_peak", "host", 2**20), ("nvme_peak", "nvme", 2**20),
            ("rss_peak", "RSS", 2**20), ("step_s", "step", 1e-3)]
    head = "| model | budgets | " + " | ".join(f"{n} pred/meas" for _, n, _ in keys) + " | within budget | bottleneck |"
    print(head)
    print("|" + "---|" * (len(keys) + 4))
    worst_mem = worst_time = 0.0
    all_ok = True
    for r in rows:
        cells = []
        for k, n, unit in keys:
            p, m = r["predicted"][k], r["measured"][k]
            e = _err(p, m)
            if k == "step_s":
                worst_time = max(worst_time, abs(e))
                cells.append(f"{p / unit:.0f}/{m / unit:.0f} ms ({e:+.0f}%)")
            else:
                if m > 64 * 2**20 or k != "nvme_peak":
                    worst_mem = max(worst_mem, abs(e)) if k != "rss_peak" or True else worst_mem
                cells.append(f"{p / unit:.0f}/{m / unit:.0f} MiB ({e:+.0f}%)")
        b = r["budget"]
        ok = all(b[t] is None or r["measured"][f"{t}_engine_peak" if t == "device" else f"{t}_peak"] <= b[t]
                 for t in ("device", "host", "nvme"))
        all_ok &= ok
        print(f"| {r['size']} ({r['params'] / 1e6:.1f}M) | {r['setting']} | " + " | ".join(cells) +
              f" | {'yes' if ok else 'NO'} | {r['bottleneck']} |")
    print(f"worst memory error {worst_mem:.0f}%, worst step-time error {worst_time:.0f}%, "
          f"budgets respected: {'all' if all_ok else 'NOT all'}")


if __name__ == "__main__":
    main()
