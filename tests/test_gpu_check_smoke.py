"""`make gpu-check`'s code on a machine without a GPU: each GPU benchmark's `--device cpu` smoke mode, the report
that gathers their figures into one file, and the script's answer where there is no GPU.

The benchmarks' GPU runs cannot happen here; these runs go through the same code with tiny models (the sides in
this process instead of one process each), so what breaks on the GPU is what only a GPU has. Each benchmark runs
in its own subprocess, all at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FSDP_SMOKE = ["--device", "cpu", "--layers", "2", "--embd", "64", "--batch", "2", "--seq", "32", "--steps", "3",
              "--warmup", "1"]
LLAMA_SMOKE = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4",
               "--kv-heads", "2", "--vocab", "256", "--seq", "32", "--batch", "2", "--steps", "3", "--warmup", "1",
               "--host-accum", "2"]
FLOORS_SMOKE = ["--device", "cpu", "--numel", "65536", "--mib", "4", "--reps", "1", "--disk-mib", "8"]


def _start(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **kw.pop("env", {})}
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            **kw)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU answer of gpu_check.sh; a GPU machine would run it")
def test_benchmarks_smoke_and_one_figures_file(tmp_path):
    out, parts = tmp_path / "gpu-check", tmp_path / "gpu-check" / "parts"
    parts.mkdir(parents=True)
    fsdp = _start([sys.executable, "benchmarks/bench_offload_fsdp.py", *FSDP_SMOKE, "--json-out",
                   str(parts / "bench_offload_fsdp.json")])
    llama = _start([sys.executable, "benchmarks/bench_gpu_llama.py", *LLAMA_SMOKE, "--nvme", str(tmp_path / "swap"),
                    "--json-out", str(parts / "bench_gpu_llama.json")])
    floors = _start([sys.executable, "benchmarks/bench_gpu_floors.py", *FLOORS_SMOKE, "--nvme",
                     str(tmp_path / "disk"), "--json-out", str(parts / "bench_gpu_floors.json")])
    nogpu = _start(["bash", "scripts/gpu_check.sh"], env={"GPU_CHECK_OUT": str(tmp_path / "nogpu")})
    for proc in (fsdp, llama, floors):
        rc, log = _finish(proc)
        assert rc == 0, log[-3000:]

    b = json.loads((parts / "bench_offload_fsdp.json").read_text())
    assert b["fsdp2"]["optimizer"].startswith("torch.optim.AdamW(fused=True)")
    for side in ("fsdp2", "tightfit"):
        assert len(b[side]["losses"]) == 3 and b[side]["tokens_per_s"] > 0
    # The same model, seed and batches on both sides: the first losses agree to bf16 rounding.
    assert abs(b["fsdp2"]["losses"][0] - b["tightfit"]["losses"][0]) < 0.05
    assert b["tokens_per_s_ratio"] > 0
    # tightfit train's ZeRO-3 in a world of one: the same model and batches, its optimizer's units stepped
    assert len(b["zero3"]["losses"]) == 3 and abs(b["zero3"]["losses"][0] - b["fsdp2"]["losses"][0]) < 0.05
    assert "units_stepped_in_backward" in b["zero3"]["optimizer"] and b["zero3_vs_engine_step"] > 0
    # tightfit's side carries its plan's prediction beside the measurement, and its threads' times.
    pv = b["tightfit"]["plan_vs_measured"]
    assert pv["predicted"]["step_s"] > 0 and pv["measured"]["step_s"] == b["tightfit"]["median_step_s"]
    assert "passes_s" in pv["step_terms"] and "optim_after_s" in pv["step_terms"] and "host_pass_bw" in pv["hardware"]
    assert b["tightfit"]["engine_s_per_step"]["optimizer_s"] > 0
    # ... and the placement it trained with, which benchmarks/replay_gpu_plans.py predicts again.
    from tightfit.offload.placement import Placement

    assert Placement.from_dict(b["tightfit"]["placement"]).to_dict() == b["tightfit"]["placement"]

    b = json.loads((parts / "bench_gpu_llama.json").read_text())
    assert b["model"] in ("llama", "gpt") and b["model_note"] and b["failed_sides"] == []
    assert b["peak"]["peak_flops"] > 0 and b["peak"]["peak_source"] == "measured bf16 matmul"
    for side in ("plain", "tightfit", "tightfit-host", "tightfit-nvme"):
        r = b[side]
        assert r["step_flops"] > 6 * r["linear_params"] * 2 * 32 and 0 < r["mfu"]
    assert abs(b["plain"]["losses"][0] - b["tightfit"]["losses"][0]) < 0.05
    assert b["tightfit-host"]["tokens_per_s_over_plain"] > 0 and b["tightfit-host"]["tokens_per_step"] == 2 * 2 * 32
    assert b["tightfit-nvme"]["moved_per_step"]["nvme_read"] > 0
    assert b["tightfit-host"]["placement"]["default"]["master"] == "host"

    # The report gathers the stages' files into one figures file, with each offloaded step against the floors.
    (parts / "stages.tsv").write_text("tests\t0\t60\t480\tT\nfsdp\t0\t9\t420\tT\nllama\t1\t12\t540\tT\n")
    (parts / "cuda-tests.xml").write_text(
        '<testsuites><testsuite tests="2" failures="1" errors="0" skipped="0">'
        '<testcase name="test_a" time="1.5"/><testcase name="test_b" time="2"><failure message="boom"/></testcase>'
        "</testsuite></testsuites>")
    proc = subprocess.run([sys.executable, "scripts/gpu_check_report.py", "write", "--out", str(out), "--parts",
                           str(parts)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr  # the llama stage's exit status 1
    assert "figures.json" in proc.stdout
    figures = json.loads((out / "figures.json").read_text())
    assert figures["status"].startswith("failed") and figures["stages"]["fsdp"]["seconds"] == 9
    assert figures["cuda_tests"]["passed"] == 1 and figures["cuda_tests"]["cases"][1]["message"] == "boom"
    assert figures["fsdp"]["tightfit"]["tokens_per_s"] > 0 and figures["llama"]["plain"]["mfu"] > 0
    assert figures["floors"]["adamw_params_per_s"] > 0 and figures["floors"]["nvme_read_bytes_per_s"] > 0
    for side in ("tightfit", "tightfit-host", "tightfit-nvme"):
        fl = figures["llama"][side]["floors"]
        assert fl["bound_s"] == max(v for k, v in fl.items() if k.endswith("_s") and k != "bound_s") > 0
        assert fl["step_over_bound"] > 0 and "compute_s" in fl
    assert "disk_s" in figures["llama"]["tightfit-nvme"]["floors"]
    md = (out / "figures.md").read_text()
    assert "tightfit's plan: step" in md and "host passes besides AdamW" in md
    assert "FSDP2" in md and "| tightfit-nvme |" in md and "`test_b`: boom" in md and "Floors" in md
    assert "probe_size" in figures["floors"]["adamw_by_threads"] and "CPU AdamW by intra-op threads" in md
    contention = figures["floors"]["contention"]
    assert contention["adam_beside_widen_params_per_s"] > 0 and contention["widen_beside_adam_bytes_per_s"] > 0
    assert "Contention (the gradient worker's widening add" in md

    # Where no Python has a CUDA torch, gpu_check.sh says so, in its figures file too, and fails.
    rc, log = _finish(nogpu)
    assert rc == 1 and "no CUDA GPU" in log, log
    assert json.loads((tmp_path / "nogpu" / "figures.json").read_text())["status"].startswith("not run: no CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real stages")
def test_the_script_leaves_at_most_eight_files(tmp_path):
    """`make gpu-check` on a GPU is one short call whose files come back: four of them (the figures, the log, the
    stages' parts in one tarball). Here its smoke mode, with the stages that need no GPU for real (floors, a tiny
    train run)."""
    out = tmp_path / "gpu-check"
    proc = _start(["bash", "scripts/gpu_check.sh"], env={"GPU_CHECK_OUT": str(out), "GPU_CHECK_SMOKE": "1",
                                                         "GPU_CHECK_STAGES": "floors train"})
    rc, log = _finish(proc, timeout=240)
    assert rc == 0, log[-3000:]
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["figures.json", "figures.md", "gpu-check.log", "parts.tar.gz"], files
    figures = json.loads((out / "figures.json").read_text())
    assert figures["floors"]["adamw_params_per_s"] > 0 and figures["train"]["summary"]["steps"] == 3
    # The default run's plan against its measurement, as data: what a GPU check is for (issue 26).
    pv = figures["train"]["plan_vs_measured"]
    assert pv["predicted"]["step_s"] > 0 and pv["measured"]["step_s"] > 0 and pv["hardware"]["probe_version"] > 0
    md = (out / "figures.md").read_text()
    assert "| step_s |" in md and "the probe's host figures" in md, md
    # The probe's attention rate beside its matmul rate, and the run's own seconds per step beside the median step.
    assert "The probe's fused attention TFLOP/s by size: 64:" in md and "evaluation included" in md, md
    assert set(figures["stages"]) == {"floors", "train"}


def test_a_failing_side_is_reported_and_the_others_still_run(tmp_path):
    """On a GPU every side runs in its own process (bench_gpu_util.run_side); here with a child that needs no torch."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_gpu_util as util
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    script = tmp_path / "side.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "benchmarks")!r})
        import bench_gpu_util as util
        side, result = sys.argv[2], sys.argv[4]
        def run():
            print("working on", side, file=sys.stderr)
            if side == "bad":
                raise RuntimeError("CUDA out of memory (pretend)")
            return {{"tokens_per_s": 1.0}}
        util.child_main(result, run)
    """))
    good = util.run_side(str(script), "good", [], None)
    bad = util.run_side(str(script), "bad", [], None)
    assert good["tokens_per_s"] == 1.0 and "error" not in good
    assert bad["error"] == "RuntimeError: CUDA out of memory (pretend)"
    assert "working on bad" in bad["log_tail"] and bad["wall_s"] > 0
    here = util.run_side("unused", "here", [], lambda: 1 / 0)
    assert here["error"].startswith("ZeroDivisionError")
    assert util.step_flops(10, 2, 4, 3, 5) == 6 * 10 * 15 + 12 * 2 * 4 * 5 * 15
    assert util.table_peak("NVIDIA H100 80GB HBM3") == 989e12 and util.table_peak("NVIDIA H100 PCIe") == 756e12
    assert util.table_peak("NVIDIA GeForce RTX 3050") is None


def test_a_benchmark_stopped_midway_keeps_what_its_finished_sides_measured(tmp_path):
    """A gpu-check stage that runs past its limit is killed mid-side (the second H200 check lost every benchmark
    figure so): each side's figures are in the JSON file as soon as it ends, marked partial."""
    out = tmp_path / "fsdp.json"
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "benchmarks")
        import bench_offload_fsdp as bench
        def killed(args):
            raise SystemExit(124)  # the stage's time limit, while the second side runs
        bench.run_tightfit = killed
        sys.argv = ["bench_offload_fsdp.py", *sys.argv[1:]]
        bench.main()
    """)
    rc, log = _finish(_start([sys.executable, "-c", code, *FSDP_SMOKE, "--json-out", str(out)]))
    assert rc == 124, log
    r = json.loads(out.read_text())
    assert r["partial"] is True and "tightfit" not in r
    assert r["fsdp2"]["median_step_s"] > 0 and len(r["fsdp2"]["losses"]) == 3
    assert "fsdp2: median" in log  # the side's figures in the log too


def test_a_gpu_runs_plans_are_predicted_again_against_what_it_measured():
    """benchmarks/replay_gpu_plans.py: the third H200 run's tightfit sides and default run planned again on this
    machine for that machine's figures (its folder's hardware file), each beside the step and device peak the run
    measured."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import replay_gpu_plans as replay
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    rows = {r["case"]: r for r in replay.replay(replay.RUN, as_run=False, save=None, load=None)}
    assert rows["fsdp-tightfit"]["measured_step_s"] == pytest.approx(0.351381229000026)
    assert rows["fsdp-tightfit"]["measured_device"] == 7328172544
    default = rows["train-default"]  # from the run's train-metrics.jsonl
    assert default["measured_step_s"] == pytest.approx(0.013601716500005523)
    assert default["measured_device"] == 134066688
    assert default["predicted_device"] == pytest.approx(default["measured_device"], rel=0.10)
    for r in rows.values():
        assert r["predicted_step_s"] > 0 and r["predicted_device"] > 0 and " on " in r["placement"]
    if "llama-tightfit-host" in rows:  # transformers installed
        assert rows["llama-tightfit-host"]["placement"] == "92 on host"
        assert rows["llama-tightfit-host"]["measured_step_s"] == pytest.approx(3.5365521100000024)
