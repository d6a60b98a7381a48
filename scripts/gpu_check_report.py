"""`make gpu-check`'s bookkeeping: the environment it ran in, and the one figures file (JSON + readable Markdown).

    python scripts/gpu_check_report.py env --out runs/gpu-check --install "how tightfit was installed"
    python scripts/gpu_check_report.py write --out runs/gpu-check [--no-gpu "why"]

`env` runs under the Python that holds the CUDA torch and records it (env.json). `write` needs nothing but the
standard library: it gathers what the stages left in the folder (stages.tsv: stage, exit status, seconds, limit,
time; cuda-tests.xml: pytest's JUnit report; bench_*.json: each benchmark's figures) into figures.json and
figures.md. A stage run again replaces its own files only, so stages run one at a time (GPU_CHECK_STAGES) end in the
same report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BENCHES = {"fsdp": "bench_offload_fsdp.json", "llama": "bench_gpu_llama.json"}
MODULES = ("pytest", "psutil", "numpy", "safetensors", "transformers", "setuptools")


def env(out: Path, install: str) -> None:
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


def _stages(out: Path) -> dict:
    stages = {}
    path = out / "stages.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds, limit, when = (line.split("\t") + [""] * 5)[:5]
            stages[name] = {"exit_status": int(rc), "seconds": int(seconds), "limit_s": int(limit), "ran_at": when,
                            "timed_out": int(rc) in (124, 137)}
    return stages


def _tests(out: Path) -> dict | None:
    path = out / "cuda-tests.xml"
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


def write(out: Path, no_gpu: str | None) -> int:
    if no_gpu:  # nothing ran: whatever an earlier run left here is not this run's
        figures = {"command": "make gpu-check", "stages": {}, "status": f"not run: {no_gpu}"}
        (out / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")
        (out / "figures.md").write_text(markdown(figures))
        print(f"gpu-check: {figures['status']}\ngpu-check: figures in {out / 'figures.json'}")
        return 1
    figures: dict = {"command": "make gpu-check", "stages": _stages(out)}
    if (out / "env.json").exists():
        figures["env"] = json.loads((out / "env.json").read_text())
    tests = _tests(out)
    if tests is not None:
        figures["cuda_tests"] = tests
    for stage, name in BENCHES.items():
        path = out / name
        if path.exists():
            figures[stage] = json.loads(path.read_text())
    ok = bool(figures["stages"]) and all(s["exit_status"] == 0 for s in figures["stages"].values())
    figures["status"] = "passed" if ok else "failed: see the stages' exit statuses and logs in this folder"
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
        return f"| {name} | failed: {r['error'][:160].replace('|', '/')} | | | | |"
    mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
    return (f"| {name} | {r['tokens_per_s']:,.0f} | {r['median_step_s']:.3f} | {mfu} | "
            f"{_gib(r.get('peak_cuda_allocated'))} | {_gib(r.get('peak_cuda_reserved'))} |")


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
    t = f.get("cuda_tests")
    if t:
        lines += ["## CUDA tests (`pytest -m cuda tests/test_offload_cuda.py`)", "",
                  f"{t['passed']} passed, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped.", ""]
        lines += [f"- {c['outcome']}: `{c['name']}`: {c.get('message', '')}" for c in t["cases"]
                  if c["outcome"] != "passed"]
        lines.append("")
    header = ["| side | tokens/s | median step (s) | MFU | peak CUDA allocated | peak CUDA reserved |",
              "| --- | --- | --- | --- | --- | --- |"]
    b = f.get("fsdp")
    if b:
        c = b["config"]
        lines += ["## tightfit vs FSDP2 + CPUOffloadPolicy (`benchmarks/bench_offload_fsdp.py`)", "",
                  f"GPT {c['layers']} layers x {c['embd']}, batch {c['batch']} x {c['seq']}, {c['dtype']}, cap "
                  f"{c['cap_gib']} GiB for both sides (set_per_process_memory_fraction).", ""] + header
        lines += [_side_row(s, b[s]) for s in ("fsdp2", "tightfit") if s in b]
        if "tokens_per_s_ratio" in b:
            lines += ["", f"tightfit / FSDP2 tokens/s: {b['tokens_per_s_ratio']:.2f}"]
        lines.append("")
    b = f.get("llama")
    if b:
        c, p = b["config"], b.get("peak", {})
        peak = (f"{p['peak_flops'] / 1e12:.4g} TFLOP/s ({p['peak_source']}; measured bf16 matmul "
                f"{p['measured_matmul_bf16_flops'] / 1e12:.4g} TFLOP/s)") if "peak_flops" in p else "-"
        lines += ["## ~1B model, states offloaded under a cap (`benchmarks/bench_gpu_llama.py`)", "",
                  f"Model: {b['model']} ({b['model_note']}); batch {c['batch']} x {c['seq']}, bf16, cap "
                  f"{c['cap_gib']} GiB. MFU against {peak}.", ""] + header
        lines += [_side_row(s, b[s]) for s in ("plain", "plain-uncapped", "tightfit", "tightfit-host") if s in b]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["env", "write"])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--install", default="")
    ap.add_argument("--no-gpu", default=None, help="write a report saying why nothing ran")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.what == "env":
        env(args.out, args.install)
    else:
        sys.exit(write(args.out, args.no_gpu))


if __name__ == "__main__":
    main()
