"""A GPU run's plans, predicted again on any machine by the code on the path, against what that run measured.

    PYTHONPATH=. .venv/bin/python benchmarks/replay_gpu_plans.py [--run benchmarks/gpu-runs/2026-11-27]
        [--as-run] [--save-placements DIR | --placements DIR]

Why: a GPU is lent for minutes; the step model changes between loans. The run folder holds what the tightfit sides
of `bench_offload_fsdp.py` and `bench_gpu_llama.py` measured (their JSON) and `h200-measured.json`, that machine's
figures as a hardware file. Each side's model is built on the meta device with the benchmark's own configuration
and planned for that hardware as `tightfit train` plans it; printed: the plan, its predicted step and device peak,
and the run's measured ones.
- `--as-run`: the hardware as the run's own probe saw it (`h200-as-run.json`: the figures the probe of the code
  that ran measured differently, such as AdamW over states that fitted the host's caches).
- A side whose JSON holds its placement (the benchmarks record it since this run) is predicted at that placement.
- `--save-placements DIR`: write each plan's placement there (JSON); `--placements DIR`: predict those placements
  instead of planning. With `--as-run --save-placements` under the code that ran (a worktree of its commit on
  PYTHONPATH) the placements the run trained with are saved; `--placements` then predicts them with this code, the
  prediction beside the measurement of the same placement.
Transformers is needed for the Llama sides (skipped without it).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

RUN = BENCH / "gpu-runs" / "2026-11-27"
SIDES = (("fsdp", "tightfit"), ("llama", "tightfit"), ("llama", "tightfit-host"))


def _hardware(run: Path, as_run: bool):
    from tightfit.planner.hardware_file import load_hardware

    path = run / "h200-measured.json"
    hw = load_hardware(str(path))
    if as_run:
        data = json.loads((run / "h200-as-run.json").read_text())
        hw = replace(hw, cpu_adam_rate=data.get("cpu_adam_rate", hw.cpu_adam_rate),
                     attention_flops={int(k): v for k, v in data.get("attention_flops", {}).items()})
    return hw


def _case(bench: str, side: str, config: dict):
    """(model on meta, Config) of one benchmark side, as the benchmark configured it."""
    import torch

    from tightfit.config import Config

    cfg = Config()
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.device = config["batch"], config["seq"], "cuda"
    cfg.train.precision = "bf16"
    cfg.optim.grad_clip, cfg.optim.lr, cfg.optim.weight_decay = 0.0, 1e-4, 0.1
    cfg.memory.gpu_mem = f"{config.get('gpu_mem_gib') or config['cap_gib']}GiB"
    with torch.device("meta"):
        if bench == "fsdp":
            import bench_offload_fsdp as b
            from tightfit.models.gpt import GPT

            model = GPT(b._config(SimpleNamespace(**config)))
            cfg.model.n_layer, cfg.model.n_embd = config["layers"], config["embd"]
            cfg.memory.offload = "auto"
        else:
            import bench_gpu_llama as b

            model = b.build_model(SimpleNamespace(**config))[0]
            cfg.memory.offload = {"tightfit": "auto", "tightfit-host": "host"}[side]
            if side == "tightfit-host":
                cfg.train.grad_accum = config["host_accum"]
    return model, cfg


def _default_run(run: Path, hw) -> dict | None:
    """The default `tightfit train` (the README's `make train`) on the GPU, where the run folder holds its metrics
    (train-metrics.jsonl, from 2026-11-27 on): planned again for `hw`, beside the run's measured step and CUDA peak."""
    path = run / "train-metrics.jsonl"
    if not path.exists():
        return None
    import torch

    from tightfit.config import Config
    from tightfit.models.build import build_model
    from tightfit.planner import make_plan
    from tightfit.planner.plan import states_by_tier

    records = (json.loads(line) for line in path.read_text().splitlines())
    measured = next(r for r in records if r.get("kind") == "plan_vs_measured")["measured"]
    cfg = Config()
    cfg.train.device = "cuda"
    model = build_model(cfg.model, 256, cfg.train.seq_len, device=torch.device("meta"))  # byte-level tokens
    plan = make_plan(model, cfg, hw, what_if=True)
    pred = plan.prediction
    return {"case": "train-default", "placement": states_by_tier(plan.placement, plan.profile),
            "predicted_step_s": pred.step_s, "bottleneck": pred.bottleneck, "optim_after_s": pred.optim_after_s,
            "compute_s": pred.compute_s, "predicted_device": pred.peak.get("device"),
            "measured_step_s": measured["step_s"], "measured_device": measured["device_peak"]}


def replay(run: Path, as_run: bool, save: Path | None, load: Path | None) -> list[dict]:
    from tightfit.offload.placement import Placement
    from tightfit.planner import make_plan
    from tightfit.planner.costs import predict
    from tightfit.planner.plan import states_by_tier

    hw = _hardware(run, as_run)
    rows = []
    for bench, side in SIDES:
        result = json.loads((run / f"rerun-{bench}.json").read_text())
        measured = result.get(side)
        if bench == "llama" and side == "tightfit-host" and measured is None:
            measured = json.loads((run / "first-call-llama-host.json").read_text())
        try:
            model, cfg = _case(bench, side, result["config"])
        except ImportError as e:
            print(f"{bench}/{side}: skipped ({e})", file=sys.stderr)
            continue
        # The FSDP2 benchmark's loop runs bf16 as given; the Llama benchmark's under autocast, as `tightfit train`.
        plan = make_plan(model, cfg, hw, what_if=True, autocast=bench != "fsdp")
        name = f"{bench}-{side}"
        placement, pred = plan.placement, plan.prediction
        if load or measured.get("placement"):  # a run that recorded its placement: that one
            placement = (Placement.from_json((load / f"{name}.json").read_text()) if load
                         else Placement.from_dict(measured["placement"]))
            pred = predict(plan.profile, placement, plan.hardware, plan.shape)
        if save:
            save.mkdir(parents=True, exist_ok=True)
            (save / f"{name}.json").write_text(placement.to_json())
        m_step = measured.get("median_step_s")
        m_dev = measured.get("peak_cuda_allocated")
        rows.append({"case": name, "placement": states_by_tier(placement, plan.profile),
                     "predicted_step_s": pred.step_s, "bottleneck": pred.bottleneck,
                     "optim_after_s": pred.optim_after_s, "compute_s": pred.compute_s,
                     "predicted_device": pred.peak.get("device"), "measured_step_s": m_step, "measured_device": m_dev})
    default = _default_run(run, hw)
    return rows + ([default] if default else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default=str(RUN), help="the GPU run's folder (default: %(default)s)")
    ap.add_argument("--as-run", action="store_true", help="the hardware as that run's probe measured it")
    ap.add_argument("--save-placements", default=None, help="write each plan's placement to this folder")
    ap.add_argument("--placements", default=None, help="predict the placements in this folder instead of planning")
    args = ap.parse_args()
    rows = replay(Path(args.run), args.as_run, Path(args.save_placements) if args.save_placements else None,
                  Path(args.placements) if args.placements else None)
    for r in rows:
        err = (r["predicted_step_s"] / r["measured_step_s"] - 1) * 100 if r["measured_step_s"] else float("nan")
        dev = (f"device {r['predicted_device'] / 2**30:.2f} GiB predicted, "
               + (f"{r['measured_device'] / 2**30:.2f} measured" if r["measured_device"] else "not measured"))
        print(f"{r['case']:20s} {r['placement']}: step {r['predicted_step_s'] * 1e3:.0f} ms predicted "
              f"({r['bottleneck']}; compute {r['compute_s'] * 1e3:.0f} ms, CPU after backward "
              f"{r['optim_after_s'] * 1e3:.0f} ms), {r['measured_step_s'] * 1e3:.0f} measured ({err:+.0f}%); {dev}")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
