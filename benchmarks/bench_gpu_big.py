"""A model several times the GPU's memory, trained as its users would: a Llama-2-7B under a 24 GiB cap (issue 42).

    python benchmarks/bench_gpu_big.py --nvme /mnt/swap               # on a GPU: the 7B, then the 1.1B host sides
    python benchmarks/bench_gpu_big.py --smoke --nvme /tmp/swap       # the code path on a CPU, in seconds

The 7B: Llama-2-7B's shape (32 x 4096, MLP 11008, 32 heads, vocab 32000: 6.74 B parameters), random init, from a
folder holding only its config.json, trained by `tightfit train` in a process of its own: the model is built on the
meta device and its values are made one unit at a time straight into the tiers the plan chose (never whole in RAM),
bf16 compute with fp32 master weights and AdamW moments, clipping at 1.0 (the default), `--gpu-mem 24GiB` (the
CUDA allocator capped at it), 8 micro-batches of 1 x 4096 tokens (32k a step), the NVMe swap folder for what the
host's RAM cannot hold. Reported from the run's metrics.jsonl: the median step after the first, tokens/s, TFLOPS as
MegaTrain counts them (6 x parameters x tokens per second, recomputation not counted), MFU against the H200's 989
dense bf16 TFLOP/s, the plan's predicted step and peaks against the measured ones, the accumulation order it chose,
and the engine's counters per step.

Then the 1.1B Llama (TinyLlama's shape) with every state in host memory, clipped, at 32k and 128k tokens a step
(benchmarks/bench_gpu_llama.py's tightfit-host side at 8 and 32 micro-batches of 2 x 2048), against plain PyTorch
on the whole GPU (its plain-uncapped side), in processes of their own. Each part writes its figures to the JSON
as it ends; a part that fails or runs out of its time is reported with its error, and the next one still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H200_BF16_FLOPS = 989e12  # dense bf16, the datasheet's (issue 42's MFU denominator)
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
             "torch_dtype": "float32"}
SMOKE = {**LLAMA2_7B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 64}


def _params(config: dict) -> int:
    """Parameters of a Llama of this config (untied): embedding and head, per layer attention, MLP and two norms."""
    h, f, n, v = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    return 2 * v * h + h + n * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h)


def _log_path(args, part: str) -> Path:
    """Where a part's whole output goes: beside --json-out (gpu_check.sh packs that folder), else a temp folder."""
    folder = Path(args.json_out).parent if args.json_out else Path(tempfile.mkdtemp(prefix="tightfit-big-"))
    return folder / f"bench_gpu_big_{part}.log"


def _run_logged(cmd: list[str], timeout: float, log: Path) -> tuple[int | None, str]:
    """Run `cmd` with its output written to `log` as it comes, each line stamped with the seconds since the start;
    returns its exit status (None when it ran out of `timeout`) and the log.

    Why: a run that stalls before printing anything (set-up is minutes for a 7B) must still say where it stalled.
    On the timeout the child gets SIGABRT, which Python's faulthandler (PYTHONFAULTHANDLER) answers with every
    thread's stack, then it is killed."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}
    t0 = time.time()
    lines: list[str] = []
    fired = threading.Event()

    def stop() -> None:
        fired.set()
        proc.send_signal(signal.SIGABRT)

    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
        timer = threading.Timer(timeout, stop)
        timer.start()
        try:
            for line in proc.stdout:
                lines.append(f"[{time.time() - t0:7.1f}s] {line}")
                f.write(lines[-1])
                f.flush()
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            timer.cancel()
    return (None if fired.is_set() else proc.returncode), "".join(lines)


def run_7b(args, out: dict) -> None:
    """`tightfit train` on the 7B (or the smoke model) in a process of its own; its figures into `out["7b"]`."""
    config = SMOKE if args.smoke else LLAMA2_7B
    work = Path(tempfile.mkdtemp(prefix="tightfit-big-"))
    folder, run = work / "llama", work / "run"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    seq = 32 if args.smoke else 4096
    flags = ["--model", f"hf:{folder}", "--micro-batch", "1", "--seq-len", str(seq), "--grad-accum", str(args.accum),
             "--steps", str(args.steps), "--eval-interval", str(args.steps), "--eval-batches", "1",
             "--log-interval", "1", "--keep-checkpoints", "0", "--out-dir", str(run), "--grad-clip", "1.0",
             "--warmup-steps", "1", "--lr", "1e-4", "--min-lr", "1e-5"]
    if args.nvme:
        flags += ["--nvme", str(Path(args.nvme) / "big")]
    if not args.smoke:
        flags += ["--gpu-mem", f"{args.cap_gib}GiB", "--precision", "bf16"]
    cmd = [sys.executable, "-m", "tightfit.cli", "train", *flags]
    r = out["7b"] = {"config": config, "params": _params(config), "command": " ".join(cmd[2:]),
                     "tokens_per_step": args.accum * seq}
    t0 = time.time()
    status, log = _run_logged(cmd, args.timeout_7b, _log_path(args, "7b"))
    r["wall_s"], r["log_tail"] = time.time() - t0, log[-3000:]
    if status is None:
        r["error"] = f"timed out after {args.timeout_7b} s (every thread's stack at the end of its log)"
    else:
        r["exit_status"] = status
    # The plan's accumulation order, as its reasons say it (unit- or micro-batch-major, and why).
    said = next((line.split("accumulation: ", 1)[1] for line in log.splitlines() if "accumulation: " in line), None)
    if said is not None:
        r["accumulation"] = said.strip()
    metrics = run / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        r.update(_figures(records, r["params"], r["tokens_per_step"]))
    if r.get("exit_status") not in (0, None) and "error" not in r:
        r["error"] = f"tightfit train exited {r['exit_status']}: {r['log_tail'][-300:]}"


def _figures(records: list[dict], params: int, tokens: int) -> dict:
    """The run's figures from its metrics.jsonl: each step's engine record, the median step after the first."""
    steps = [rec for rec in records if rec.get("kind") == "train" and "engine" in rec]
    out: dict = {"steps_logged": len(steps)}
    times = [rec["engine"]["step_s"] for rec in steps[1:]] or [rec["engine"]["step_s"] for rec in steps]
    if times:
        step = statistics.median(times)
        flops = 6 * params * tokens / step
        out.update(median_step_s=step, step_s=times, tokens_per_s=tokens / step, tflops=flops / 1e12,
                   mfu=flops / H200_BF16_FLOPS, engine_per_step=steps[-1]["engine"],
                   losses=[rec["loss"] for rec in steps])
        eng = steps[-1]["engine"]
        out["optimizer_exposed_share"] = eng["optimizer_exposed_s"] / eng["optimizer_s"] if eng["optimizer_s"] else None
    plan = next((rec for rec in reversed(records) if rec.get("kind") == "plan_vs_measured"), None)
    if plan:
        out["plan_vs_measured"] = plan
        pred, meas = plan["predicted"], plan["measured"]
        out["plan_errors"] = {k: (pred[k] - meas[k]) / meas[k] for k in pred if meas.get(k)}
    summary = next((rec for rec in reversed(records) if rec.get("kind") == "summary"), None)
    if summary:
        out["peak_memory"] = summary.get("peak_memory")
    return out


def run_host(args, out: dict) -> None:
    """The 1.1B Llama, every state on host, clipped, at 32k and 128k tokens a step, and plain PyTorch."""
    bench = ROOT / "benchmarks" / "bench_gpu_llama.py"
    shape = (["--device", "cpu", "--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4",
              "--kv-heads", "2", "--vocab", "256", "--seq", "32", "--batch", "2", "--steps", "3", "--warmup", "1"]
             if args.smoke else ["--cap-gib", "24", "--steps", "4", "--warmup", "1"])
    for name, accum, sides in (("host_32k", 8, "plain-uncapped,tightfit-host"), ("host_128k", 32, "tightfit-host")):
        path = Path(tempfile.mkdtemp(prefix="tightfit-big-")) / f"{name}.json"
        cmd = [sys.executable, str(bench), *shape, "--sides", sides, "--host-accum", str(accum), "--clip", "1.0",
               "--json-out", str(path)]
        r = out[name] = {"command": " ".join(cmd[1:])}
        status, log = _run_logged(cmd, args.timeout_host, _log_path(args, name))
        tail = log[-3000:]
        if status is None:
            r["error"], r["log_tail"] = f"timed out after {args.timeout_host} s", tail
        else:
            r["exit_status"] = status
            if status:
                r["log_tail"] = tail
        if path.exists():
            r.update(json.loads(path.read_text()))
    plain = out.get("host_32k", {}).get("plain-uncapped", {})
    for name in ("host_32k", "host_128k"):
        side = out.get(name, {}).get("tightfit-host", {})
        if "tokens_per_s" in side and "tokens_per_s" in plain:
            out[name]["tokens_per_s_over_plain"] = side["tokens_per_s"] / plain["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme", default=None, help="a folder on the NVMe disk for the swap files")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap of the 7B run (--gpu-mem)")
    ap.add_argument("--accum", type=int, default=8, help="micro-batches of 1 x 4096 tokens a step of the 7B run")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout-7b", type=float, default=200.0)
    ap.add_argument("--timeout-host", type=float, default=45.0, help="seconds of each 1.1B run")
    ap.add_argument("--parts", default="7b,host", help="which parts to run: 7b, host")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: the code path, figures meaningless")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    out: dict = {"benchmark": "bench_gpu_big", "smoke": args.smoke, "h200_bf16_flops": H200_BF16_FLOPS}
    parts = args.parts.split(",")
    env = os.environ
    if args.smoke:
        env["TIGHTFIT_CPU_DEVICE"] = env.get("TIGHTFIT_CPU_DEVICE", "separate")  # the GPU's code path on the CPU
    for name, fn in (("7b", run_7b), ("host", run_host)):
        if name in parts:
            fn(args, out)
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: v for k, v in out.get("7b", {}).items() if k not in ("log_tail", "plan_vs_measured")},
                     indent=2))
    failed = [k for k in ("7b", "host_32k", "host_128k") if "error" in out.get(k, {})]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
