"""`make gpu-check`'s bookkeeping: the environment it ran in, and the one figures file (JSON + readable Markdown).

    python scripts/gpu_check_report.py env --out runs/gpu-check --parts runs/gpu-check/parts --install "how"
    python scripts/gpu_check_report.py write --out runs/gpu-check --parts runs/gpu-check/parts [--no-gpu "why"]

`env` runs under the Python that holds the CUDA torch and records it (parts/env.json). `write` needs nothing but the
standard library: it gathers what the stages left in the parts folder (stages.tsv: stage, exit status, seconds,
limit, time; cuda-tests.xml: pytest's JUnit report; bench_*.json: each benchmark's figures; train/metrics.jsonl)
into figures.json and figures.md in the output folder, and puts each offloaded step against the machine's floors:
max(compute: plain PyTorch's step on the whole GPU, per token; transfers: its bytes to and from the device at the
measured rates with both directions in flight, and to and from the disk; CPU optimizer: its parameters at the
measured AdamW rate). A stage run again replaces its own files only, so stages run one at a time
(GPU_CHECK_STAGES) end in the same report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BENCHES = {"floors": "bench_gpu_floors.json", "fsdp": "bench_offload_fsdp.json", "llama": "bench_gpu_llama.json",
           "big": "bench_gpu_big.json"}
MODULES = ("pytest", "psutil", "numpy", "safetensors", "transformers", "setuptools")


def env(out: Path, install: str) -> None:  # `out`: the parts folder
    import importlib.util
    import platform

    import torch

    info = {"python": sys.executable, "python_version": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "install": install,
            "modules": {m: importlib.util.find_spec(m) is not None for m in MODULES}}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=torch.cuda.get_device_name(0), gpu_memory=props.total_memory,
                    gpu_count=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}")
    try:
        import importlib.metadata as md

        info["transformers"] = md.version("transformers") if info["modules"]["transformers"] else None
    except Exception:  # noqa: BLE001 - metadata is a nicety
        pass
    (out / "env.json").write_text(json.dumps(info, indent=2) + "\n")
    missing = [m for m, ok in info["modules"].items() if not ok]
    print(f"gpu-check: {info.get('gpu', 'no GPU')}, torch {info['torch']} (CUDA {info['torch_cuda']}), "
          f"{info['python']}; tightfit: {install}" + (f"; missing: {', '.join(missing)}" if missing else ""))


def _stages(parts: Path) -> dict:
    stages = {}
    path = parts / "stages.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds, limit, when = (line.split("\t") + [""] * 5)[:5]
            stages[name] = {"exit_status": int(rc), "seconds": int(seconds), "limit_s": int(limit), "ran_at": when,
                            "timed_out": int(rc) in (124, 137)}
    return stages


def _tests(parts: Path) -> dict | None:
    path = parts / "cuda-tests.xml"
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = tag
                message = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else ""
                break
        entry = {"name": case.get("name"), "outcome": outcome, "seconds": round(float(case.get("time", 0)), 2)}
        if outcome != "passed":
            entry["message"] = message
        cases.append(entry)
    return {**counts, "cases": cases}


def _train(parts: Path) -> dict | None:
    """The default run's summary record (tightfit train's metrics.jsonl), and its plan comparison if logged."""
    path = parts / "train" / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    summary = next((r for r in reversed(records) if r.get("kind") == "summary"), None)
    plan = next((r for r in reversed(records) if r.get("kind") == "plan_vs_measured"), None)
    return {"summary": summary, "plan_vs_measured": plan, "records": len(records)}


def floors_bound(side: dict, floors: dict, compute_s_per_token: float | None) -> dict | None:
    """max(compute, transfers, CPU optimizer) of one offloaded side's step on the machine's floors, and the step's
    ratio to it."""
    moved = side.get("moved_per_step")
    if not moved or "median_step_s" not in side:
        return None
    both_up, both_down = floors["both_h2d_bytes_per_s"], floors["both_d2h_bytes_per_s"]
    parts = {"transfers_s": max(moved["bytes_to_device"] / both_up, moved["bytes_to_host"] / both_down),
             "cpu_optimizer_s": moved.get("cpu_optimizer_params", 0) / floors["adamw_params_per_s"]}
    if "nvme_read" in moved and floors.get("nvme_read_bytes_per_s"):
        parts["disk_s"] = (moved["nvme_read"] / floors["nvme_read_bytes_per_s"]
                           + moved["nvme_written"] / floors["nvme_write_bytes_per_s"])
    if compute_s_per_token is not None:
        parts["compute_s"] = compute_s_per_token * side.get("tokens_per_step", side["tokens_per_s"]
                                                           * side["median_step_s"])
    bound = max(parts.values())
    return {**parts, "bound_s": bound, "bounded_by": max(parts, key=parts.get)[:-2],
            "step_over_bound": side["median_step_s"] / bound if bound else None}


def _bounds(figures: dict) -> None:
    floors = figures.get("floors")
    if not floors or "error" in floors:
        return
    llama = figures.get("llama") or {}
    plain = llama.get("plain-uncapped") or llama.get("plain") or {}
    per_token = 1 / plain["tokens_per_s"] if "tokens_per_s" in plain else None
    for side in ("tightfit", "tightfit-host", "tightfit-nvme"):
        if side in llama:
            b = floors_bound(llama[side], floors, per_token)
            if b:
                llama[side]["floors"] = b
    fsdp = figures.get("fsdp") or {}
    for side in ("tightfit", "tightfit-at-fsdp2-peak", "tightfit-cpu-casts"):
        if side in fsdp:
            b = floors_bound(fsdp[side], floors, None)
            if b:
                fsdp[side]["floors"] = b


def write(out: Path, parts: Path, no_gpu: str | None) -> int:
    if no_gpu:  # nothing ran: whatever an earlier run left here is not this run's
        figures = {"command": "make gpu-check", "stages": {}, "status": f"not run: {no_gpu}"}
        (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
        (out / "figures.md").write_text(markdown(figures))
        print(f"gpu-check: {figures['status']}\ngpu-check: figures in {out / 'figures.json'}")
        return 1
    figures: dict = {"command": "make gpu-check", "stages": _stages(parts)}
    if (parts / "env.json").exists():
        figures["env"] = json.loads((parts / "env.json").read_text())
    tests = _tests(parts)
    if tests is not None:
        figures["cuda_tests"] = tests
    train = _train(parts)
    if train is not None:
        figures["train"] = train
    for stage, name in BENCHES.items():
        path = parts / name
        if path.exists():
            figures[stage] = json.loads(path.read_text())
    _bounds(figures)
    ok = bool(figures["stages"]) and all(s["exit_status"] == 0 for s in figures["stages"].values())
    figures["status"] = "passed" if ok else "failed: see the stages' exit statuses and gpu-check.log"
    if os.environ.get("GPU_CHECK_SMOKE") == "1":
        figures["status"] = (f"smoke run of the script (GPU_CHECK_SMOKE=1, no GPU): {figures['status']}; "
                             "figures meaningless")
    (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
    (out / "figures.md").write_text(markdown(figures))
    print(f"gpu-check: {figures['status']}\ngpu-check: figures in {out / 'figures.json'} and {out / 'figures.md'}")
    return 0 if ok else 1


def _gib(n) -> str:
    return f"{n / 2**30:.2f} GiB" if isinstance(n, (int, float)) else "-"


def _side_row(name: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | failed: {r['error'][:160].replace('|', '/')} | | | | | |"
    mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
    fl = r.get("floors")
    bound = (f"{fl['step_over_bound']:.2f}x ({fl['bounded_by']} {fl['bound_s']:.3f} s)"
             if fl and fl.get("step_over_bound") else "-")
    return (f"| {name} | {r['tokens_per_s']:,.0f} | {r['median_step_s']:.3f} | {mfu} | "
            f"{_gib(r.get('peak_cuda_allocated'))} | {_gib(r.get('peak_cuda_reserved'))} | {bound} |")


def markdown(f: dict) -> str:
    lines = ["# make gpu-check", "", f"Status: **{f['status']}**", ""]
    e = f.get("env")
    if e:
        lines += [f"GPU: {e.get('gpu', '-')} ({_gib(e.get('gpu_memory'))}), torch {e['torch']} (CUDA "
                  f"{e['torch_cuda']}), Python {e['python_version']} at `{e['python']}`; tightfit: {e['install']}.",
                  "Missing modules: " + (", ".join(m for m, ok in e["modules"].items() if not ok) or "none") + ".", ""]
    if f["stages"]:
        lines += ["| stage | exit status | seconds | limit (s) | ran at |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {n} | {s['exit_status']}{' (timed out)' if s['timed_out'] else ''} | {s['seconds']} | "
                  f"{s['limit_s']} | {s['ran_at']} |" for n, s in f["stages"].items()]
        lines.append("")
    fl = f.get("floors")
    if fl and "error" not in fl:
        disk = (f"; disk {fl['nvme_read_bytes_per_s'] / 1e9:.2f} GB/s read, "
                f"{fl['nvme_write_bytes_per_s'] / 1e9:.2f} GB/s write" if fl.get("nvme_read_bytes_per_s") else "")
        lines += ["## Floors (`benchmarks/bench_gpu_floors.py`)", "",
                  f"CPU AdamW {fl['adamw_params_per_s'] / 1e9:.2f} Gparam/s on {fl['torch_threads']} threads; H2D "
                  f"{fl['h2d_bytes_per_s'] / 1e9:.1f} GB/s, D2H {fl['d2h_bytes_per_s'] / 1e9:.1f} GB/s alone, "
                  f"{fl['both_h2d_bytes_per_s'] / 1e9:.1f} + {fl['both_d2h_bytes_per_s'] / 1e9:.1f} GB/s both at "
                  f"once{disk}.", ""]
        by = dict(fl.get("adamw_by_threads") or {})
        if by:
            probe = by.pop("probe_size", None)
            lines += ["CPU AdamW by intra-op threads (the engine's step thread: beside the gradient worker, alone, "
                      "every thread): " + ", ".join(f"{n}: {r / 1e9:.2f}" for n, r in by.items()) + " Gparam/s"
                      + (f"; at the probe's 4 M elements {probe / 1e9:.2f}" if probe else "") + ".", ""]
        c = fl.get("contention")
        if c:
            g = 1e9
            lines += [f"Contention (the gradient worker's widening add on {c['widen_threads']} threads, AdamW on "
                      f"{c['adam_threads']}): widening {c['widen_alone_bytes_per_s'] / g:.1f} GB/s alone, "
                      f"{c['widen_beside_adam_bytes_per_s'] / g:.1f} beside AdamW; AdamW "
                      f"{c['adam_alone_params_per_s'] / g:.2f} Gparam/s alone, "
                      f"{c['adam_beside_widen_params_per_s'] / g:.2f} beside the widening, "
                      f"{c['adam_cast_alone_params_per_s'] / g:.2f} with the cast to bf16 in spans"
                      + (f"; widening on every core but one {c['widen_alone_all_threads_bytes_per_s'] / g:.1f} GB/s "
                         f"alone, {c['widen_beside_copies_bytes_per_s'] / g:.1f} beside both-way copies"
                         if "widen_beside_copies_bytes_per_s" in c else "") + ".", ""]
    tr = (f.get("train") or {}).get("summary")
    if tr:
        lines += ["## Default `tightfit train`", "",
                  f"{tr.get('steps')} steps in {tr.get('seconds', 0):.1f} s, {tr.get('tokens_per_s', 0):,.0f} tok/s, "
                  f"val loss {tr.get('val_loss')}; peaks {tr.get('peak_memory')}.", ""]
    pv = (f.get("train") or {}).get("plan_vs_measured")
    if pv:
        lines += ["| figure | predicted | measured | error |", "| --- | --- | --- | --- |"]
        for key, pred in pv["predicted"].items():
            meas = pv["measured"].get(key)
            if meas is None:
                continue
            unit = (lambda x: f"{x * 1e3:.1f} ms") if key == "step_s" else (lambda x: f"{x / 2**20:.1f} MiB")
            err = f"{(pred - meas) / meas:+.0%}" if meas else "-"
            lines.append(f"| {key} | {unit(pred)} | {unit(meas)} | {err} |")
        hw, terms = pv.get("hardware", {}), pv.get("step_terms", {})
        lines += ["", f"Step terms: compute {terms.get('compute_s', 0) * 1e3:.1f} ms (host issuing "
                      f"{terms.get('host_s', 0) * 1e3:.1f}), optimizer {terms.get('optim_s', 0) * 1e3:.1f} ms, "
                      f"host passes {terms.get('passes_s', 0) * 1e3:.1f} ms, "
                      f"bottleneck {terms.get('bottleneck')}; the probe's host "
                      f"figures: {hw.get('op_overhead_s', 0) * 1e6:.1f} us per op, "
                      f"{hw.get('unit_overhead_s', 0) * 1e3:.2f} ms per unit, "
                      f"+{hw.get('stream_overhead_s', 0) * 1e3:.2f} ms streamed, "
                      f"{hw.get('step_overhead_s', 0) * 1e3:.2f} ms per step; both-ways copies "
                      f"{hw.get('duplex_bw', 0) / 1e9:.1f} GB/s; host passes "
                      f"{hw.get('host_pass_bw', 0) / 1e9:.1f} GB/s; workspace "
                      f"{hw.get('device_workspace', 0) / 2**20:.0f} MiB.",
                  ""]
        rates = [(what, hw.get(key) or {}) for what, key in (("matmul", "matmul_flops"),
                                                               ("fused attention", "attention_flops"))]
        lines += [f"The probe's {what} TFLOP/s by size: " + ", ".join(
            f"{size}: {float(rate) / 1e12:.1f}" for size, rate in sorted(table.items(), key=lambda kv: int(kv[0])))
            + "." for what, table in rates if table]
        if pv.get("run_seconds_per_step"):
            lines.append(f"Measured step: the median step; the run's seconds per step, evaluation included: "
                         f"{pv['run_seconds_per_step'] * 1e3:.1f} ms.")
        lines.append("")
    t = f.get("cuda_tests")
    if t:
        lines += ["## CUDA tests (`pytest -m cuda tests/test_offload_cuda.py`)", "",
                  f"{t['passed']} passed, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped.", ""]
        lines += [f"- {c['outcome']}: `{c['name']}`: {c.get('message', '')}" for c in t["cases"]
                  if c["outcome"] != "passed"]
        lines.append("")
    header = ["| side | tokens/s | median step (s) | MFU | peak CUDA allocated | peak CUDA reserved | step / floors |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    b = f.get("fsdp")
    if b:
        c = b["config"]
        lines += ["## tightfit vs FSDP2 + CPUOffloadPolicy (`benchmarks/bench_offload_fsdp.py`)", "",
                  f"GPT {c['layers']} layers x {c['embd']}, batch {c['batch']} x {c['seq']}, {c['dtype']}, cap "
                  f"{c['cap_gib']} GiB for both sides (set_per_process_memory_fraction).", ""] + header
        lines += [_side_row(s, b[s]) for s in ("fsdp2", "tightfit", "zero3", "tightfit-at-fsdp2-peak",
                                                "tightfit-cpu-casts") if s in b]
        lines += _plan_lines(b, ("tightfit",))
        if "tokens_per_s_ratio" in b:
            lines += ["", f"tightfit / FSDP2 tokens/s: {b['tokens_per_s_ratio']:.2f} under the cap"
                      + (f", {b['tokens_per_s_ratio_at_fsdp2_peak']:.2f} with tightfit's budget at FSDP2's peak"
                         if "tokens_per_s_ratio_at_fsdp2_peak" in b else "")
                      + (f"; `--strategy zero3` in a world of one (FSDP2 over tightfit's split, its optimizer): "
                         f"{b['zero3_vs_engine_step']:.2f}x the engine's step, {b['zero3_vs_fsdp2_tokens_per_s']:.2f}x "
                         f"FSDP2's tokens/s ({(b['zero3'].get('split') or 'every unit on the GPU')[:120]})"
                         if "zero3_vs_engine_step" in b else "")
                      + (f"; the GPU casting the masters / the CPU's step casting them: "
                         f"{b['tokens_per_s_ratio_device_casts']:.2f}" if "tokens_per_s_ratio_device_casts" in b
                         else "")]
        lines.append("")
    b = f.get("llama")
    if b:
        c, p = b["config"], b.get("peak", {})
        peak = (f"{p['peak_flops'] / 1e12:.4g} TFLOP/s ({p['peak_source']}; measured bf16 matmul "
                f"{p['measured_matmul_bf16_flops'] / 1e12:.4g} TFLOP/s)") if "peak_flops" in p else "-"
        lines += ["## ~1B model, states offloaded under a cap (`benchmarks/bench_gpu_llama.py`)", "",
                  f"Model: {b['model']} ({b['model_note']}); batch {c['batch']} x {c['seq']}, bf16, cap "
                  f"{c['cap_gib']} GiB. MFU against {peak}.", ""] + header
        lines += [_side_row(s, b[s]) for s in ("plain", "plain-uncapped", "tightfit", "tightfit-host", "tightfit-nvme")
                  if s in b]
        lines += _plan_lines(b, ("tightfit", "tightfit-host", "tightfit-nvme"))
        host = b.get("tightfit-host", {})
        if "tokens_per_s_over_plain" in host:
            lines += ["", f"Every state on host, {host.get('tokens_per_step', 0):,} tokens per step: "
                      f"{host['tokens_per_s_over_plain']:.2f}x plain PyTorch's tokens/s on the whole GPU."]
        lines.append("")
    lines += _big_lines(f.get("big"))
    return "\n".join(lines)


def _big_lines(b: dict | None) -> list[str]:
    """The 7B under a 24 GiB cap, and the 1.1B with every state on the host at 32k and 128k tokens a step."""
    if not b:
        return []
    lines = ["## A model several times the GPU: Llama-2-7B under 24 GiB (`benchmarks/bench_gpu_big.py`)", ""]
    r = b.get("7b", {})
    if "median_step_s" in r:
        pe = r.get("plan_errors", {})
        peak = (r.get("peak_memory") or {}).get("cuda_allocated")
        eng = r.get("engine_per_step", {})
        lines += [f"{r['params'] / 1e9:.2f} B parameters, {r['tokens_per_step']:,} tokens a step: step "
                  f"{r['median_step_s']:.2f} s (median after the first), {r['tokens_per_s']:,.0f} tokens/s, "
                  f"{r['tflops']:.0f} TFLOPS (6 x N x tokens/s), MFU {100 * r['mfu']:.1f}% of 989 TFLOP/s; CUDA "
                  f"peak allocated {_gib(peak)}; the plan's step {pe.get('step_s', 0):+.0%}, device peak "
                  f"{pe.get('device_peak', 0):+.0%}, RSS {pe.get('rss_peak', 0):+.0%} off the measured; "
                  f"accumulation: {r.get('accumulation', 'not said')}.",
                  "", "Engine per step: " + ", ".join(
                      f"{k} {v / 1e9:.2f} GB" if k.endswith("bytes") else f"{k} {v:.3g}" for k, v in eng.items()),
                  ""]
    elif r:
        lines += [f"7B: {r.get('error', 'no step logged')}", ""]
    for name, label in (("host_32k", "32k"), ("host_128k", "128k")):
        h = b.get(name, {})
        side = h.get("tightfit-host", {})
        if "tokens_per_s" in side:
            ratio = h.get("tokens_per_s_over_plain")
            lines.append(f"1.1B, every state on host, {label} tokens a step ({side.get('accumulation', '?')}-major): "
                         f"{side['tokens_per_s']:,.0f} tokens/s"
                         + (f", {ratio:.2f}x plain PyTorch on the whole GPU" if ratio else ""))
        elif h:
            lines.append(f"1.1B host side at {label}: {h.get('error', 'no figures')}")
    return lines + [""]


def _plan_lines(bench: dict, sides: tuple[str, ...]) -> list[str]:
    """Per tightfit side: its plan's step against the measured one, the step model's terms, and what the engine's
    threads measured per step (where the benchmark recorded them): which term a wrong prediction got wrong."""
    lines = []
    for side in sides:
        r = bench.get(side, {})
        pv = r.get("plan_vs_measured")
        if not (pv and pv["predicted"].get("step_s") and pv["measured"].get("step_s")):
            continue
        terms, timers = pv.get("step_terms", {}), r.get("engine_s_per_step", {})
        pred, meas = pv["predicted"]["step_s"], pv["measured"]["step_s"]
        lines += ["", f"{side}'s plan: step {pred * 1e3:.1f} ms predicted, {meas * 1e3:.1f} ms measured "
                      f"({(pred - meas) / meas:+.0%}); terms: compute {terms.get('compute_s', 0) * 1e3:.1f}, "
                      f"copies {terms.get('copy_s', 0) * 1e3:.1f}, CPU optimizer "
                      f"{terms.get('optim_s', 0) * 1e3:.1f} ({terms.get('optim_after_s', 0) * 1e3:.1f} of it "
                      f"after the backward) of which host passes besides AdamW in both phases "
                      f"{terms.get('passes_s', 0) * 1e3:.1f} ms (probe: "
                      f"{pv.get('hardware', {}).get('host_pass_bw', 0) / 1e9:.1f} GB/s); bottleneck "
                      f"{terms.get('bottleneck')}."
                  + (" Measured on the engine's threads per step: "
                     + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(timers.items())) + "."
                     if timers else "")]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["env", "write"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--parts", required=True, type=Path, help="where the stages left their files")
    ap.add_argument("--install", default="")
    ap.add_argument("--no-gpu", default=None, help="write a report saying why nothing ran")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.parts.mkdir(parents=True, exist_ok=True)
    if args.what == "env":
        env(args.parts, args.install)
    else:
        sys.exit(write(args.out, args.parts, args.no_gpu))


if __name__ == "__main__":
    main()
