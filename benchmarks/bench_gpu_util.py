"""What the GPU benchmarks share (bench_offload_fsdp.py, bench_gpu_llama.py); not a benchmark itself.

- Sides: each configuration a benchmark compares (FSDP2, tightfit, plain PyTorch) runs in its own process on a GPU,
  so each has a clean CUDA context, its own memory cap (`torch.cuda.set_per_process_memory_fraction`, set before
  anything is allocated) and its own peaks. A side that fails (out of memory under the cap, say) is recorded with
  its error, and the others still run. On the CPU (the `--device cpu` smoke mode) the sides run in the calling
  process, one after the other: the smoke checks the code, and a second torch import per side would be most of its
  time.
- FLOPs: the model FLOPs of a training step and the GPU's peak, for MFU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from typing import Callable

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, from NVIDIA's datasheets, by a substring of
# torch.cuda.get_device_name(); the first match wins, so specific names come before the generic ones.
PEAK_BF16 = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),   # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),   # also GH200
    ("A100", 312e12),
    ("L40S", 362e12),
]


def table_peak(device_name: str) -> float | None:
    return next((flops for key, flops in PEAK_BF16 if key in device_name), None)


def measured_matmul_flops(device) -> float:
    """FLOP/s of a large bf16 matrix product on `device` (median of several): what a GEMM reaches there."""
    import torch

    n, reps = (8192, 10) if device.type == "cuda" else (256, 3)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times = []
    for i in range(reps + 3):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i >= 3:  # the first products warm the kernels and clocks up
            times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def peak_flops(device) -> dict:
    """The peak MFU is computed against: the datasheet's where the device is in the table, else the measured GEMM."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = table_peak(name) if device.type == "cuda" else None
    measured = measured_matmul_flops(device)
    return {"device_name": name, "table_bf16_flops": table, "measured_matmul_bf16_flops": measured,
            "peak_flops": table or measured, "peak_source": "datasheet table" if table else "measured bf16 matmul"}


def step_flops(linear_params: int, n_layer: int, attn_width: int, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (forward + backward), without recomputation (MFU, not HFU).

    6 per weight of every matrix product per token (2 forward, 4 backward), over the parameters of the Linear layers
    (embedding lookups are no products; the LM head is), plus attention's two [T, T] products per layer counted in
    full as PaLM's appendix B and Megatron do: 12 * n_layer * attn_width * seq per token (causal kernels skip about
    half of it, so this counts the work of a non-causal kernel).
    """
    tokens = batch * seq
    return 6 * linear_params * tokens + 12 * n_layer * attn_width * seq * tokens


def linear_params(model) -> int:
    import torch.nn as nn

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def cap_device(device_name: str, cap_gib: float | None):
    """The side's device, made current and capped (before anything is allocated on it); None: no cap."""
    import torch

    device = torch.device(device_name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # set_device refuses a device without an index (torch 2.11)
        torch.cuda.set_device(device)
        if cap_gib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)
    return device


def moved_per_step(model, steps: int) -> dict:
    """A wrapped model's bytes per step to and from the device (the mover's counters) and the disk (the NVMe
    store's), averaged over the run, and the parameters its CPU optimizer steps: what the floors' bound is computed
    from (bench_gpu_floors.py, scripts/gpu_check_report.py)."""
    from tightfit.offload import Tier, engine_of

    engine = engine_of(model)
    out = {k: engine.mover.stats[k] / steps for k in ("bytes_to_device", "bytes_to_host")}
    if Tier.NVME in engine.stores:
        st = engine.stores[Tier.NVME].stats()
        out.update(nvme_read=st["bytes_read"] / steps, nvme_written=st["bytes_written"] / steps)
    out["cpu_optimizer_params"] = sum(u.spec.train_numel for u in engine.units.values()
                                      if u.placement.optim != Tier.DEVICE)
    counted = engine.counters()  # [Note: engine counters]: the same figures tightfit train logs per step
    out["engine_counters"] = {k: v / steps for k, v in counted.items()}
    return out


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peaks(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed_steps(device, steps: int, warmup: int, batch_of: Callable, step_fn: Callable, tokens: int,
                timers=None) -> dict:
    """Run `steps` steps; median step time over those after `warmup`, tokens/s, losses, CUDA peaks; with an
    engine's `timers`, what its threads spent per step over the steps after `warmup` ("engine_s_per_step")."""
    import statistics

    import torch

    times, losses = [], []
    for step in range(steps):
        if timers is not None and step == warmup:
            timers.clear()
        x, y = batch_of(step)
        _sync(device)
        t0 = time.perf_counter()
        loss = step_fn(x, y)
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        print(f"  step {step}: loss {loss:.4f}  {times[-1]:.3f} s", file=sys.stderr, flush=True)
    step_s = statistics.median(times[warmup:])
    out = {"step_s": times, "median_step_s": step_s, "tokens_per_s": tokens / step_s, "losses": losses}
    if timers is not None:
        out["engine_s_per_step"] = {k: v / max(1, steps - warmup) for k, v in timers.snapshot().items()}
    if device.type == "cuda":
        # The cap (set_per_process_memory_fraction) bounds reserved bytes: the caching allocator's segments,
        # which hold the allocated bytes plus fragmentation. Both peaks are reported.
        out["peak_cuda_allocated"] = torch.cuda.max_memory_allocated(device)
        out["peak_cuda_reserved"] = torch.cuda.max_memory_reserved(device)
    return out


def run_side(script: str, side: str, argv: list[str], in_process: Callable[[], dict] | None) -> dict:
    """One side's result dict; on failure {"error": ..., "log_tail": [...]} instead of raising.

    `in_process`: run it here (CPU smoke) instead of in a child `script --side SIDE --result FILE argv...`.
    """
    print(f"{side}:", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if in_process is not None:
        try:
            out = in_process()
        except Exception as e:  # noqa: BLE001 - a failing side is a figure to report, not a crash
            out = _error_record(e)
        out["wall_s"] = time.perf_counter() - t0
        print(f"{side}: {summary(out)}", file=sys.stderr, flush=True)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, script, "--side", side, "--result", result] + argv
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        tail: deque[str] = deque(maxlen=15)
        for line in proc.stderr:  # passed through live, the last lines kept for the report
            sys.stderr.write(line)
            tail.append(line.rstrip())
        rc = proc.wait()
        try:
            with open(result) as f:
                out = json.load(f)
        except (OSError, ValueError):
            out = {"error": f"exit status {rc}, no result written"}
        if rc != 0 and "error" not in out:
            out["error"] = f"exit status {rc}"
        if "error" in out:
            out["log_tail"] = list(tail)
    out["wall_s"] = time.perf_counter() - t0
    print(f"{side}: {summary(out)}", file=sys.stderr, flush=True)
    return out


def summary(out: dict) -> str:
    """One side's figures in a line, for the log: a run stopped at its time limit keeps what the sides before it
    measured there as well as in the partial JSON (`save_partial`)."""
    if "error" in out:
        return f"failed after {out.get('wall_s', 0):.0f} s: {out['error'][:200]}"
    gib = 2.0**30
    parts = [f"median {out['median_step_s']:.3f} s/step"] if "median_step_s" in out else []
    parts += [f"{out['tokens_per_s']:,.0f} tok/s"] if "tokens_per_s" in out else []
    if "peak_cuda_allocated" in out:
        parts.append(f"peak allocated {out['peak_cuda_allocated'] / gib:.2f} GiB, "
                     f"reserved {out['peak_cuda_reserved'] / gib:.2f} GiB")
    return ", ".join(parts or ["done"]) + f" ({out.get('wall_s', 0):.0f} s in all)"


def child_main(result_path: str, fn: Callable[[], dict]) -> None:
    """A side's process: run it, write its result (or its error) to `result_path`; exit 1 on error."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001
        out = _error_record(e)
    with open(result_path, "w") as f:
        json.dump(out, f)
    sys.exit(1 if "error" in out else 0)


def _error_record(e: Exception) -> dict:
    traceback.print_exc()
    out = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:500]}
    if type(e).__name__ == "OutOfMemoryError":
        out["out_of_memory"] = True
    return out


def placement_of(mem) -> dict | None:
    """The placement a tightfit side trained with (its plan's), as JSON data; None where it made no plan."""
    plan = getattr(mem, "plan", None)
    return plan.placement.to_dict() if plan is not None else None


def save_partial(path: str | None, results: dict) -> None:
    """The figures so far, written to `path` (atomically) after each side: a benchmark stopped at its time limit
    leaves what its finished sides measured."""
    if path:
        _write(path, json.dumps({**results, "partial": True}, indent=2))


def write_json(path: str | None, results: dict) -> None:
    """The figures, printed, and written to `path` where one is given (replacing a partial file)."""
    text = json.dumps(results, indent=2)
    print(text)
    if path:
        _write(path, text)
        print(f"figures written to {path}", file=sys.stderr)


def _write(path: str, text: str) -> None:
    """`text` into `path` atomically, its folder made."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        f.write(text + "\n")
    os.replace(path + ".tmp", path)
