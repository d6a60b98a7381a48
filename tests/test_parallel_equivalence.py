"""Acceptance: every strategy trains 5 steps to the same losses (rel <= 1e-5) and weights as one process; resume
from a full-state checkpoint continues exactly; `tightfit train --nproc-per-node 2` runs and its checkpoint is
resumed by the one-process trainer.

One torchrun launch per world size checks many strategies in one process group (tests/parallel_worker.py), so
the process start-up and imports are paid once. CPU, gloo, one thread per rank.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from parallel_launch import ROOT, check_cases, free_port, rank_env, torchrun_worker

HAS_HF = importlib.util.find_spec("transformers") is not None

# `:accum=2` accumulates gradients over 2 calls (dp sync on the last only).
# `:resume=1` cases also save the full state after 3 steps, rebuild everything from it and continue (state.py).
TWO = ["ddp", "zero1", "zero2", "zero3", "zero3:offload=1", "zero3:offload=1,resume=1", "zero3:offload=1,accum=2",
       "zero3:offload=1,kept=2,resume=1", "zero3:bf16=1,accum=2", "tp", "pp:sched=gpipe", "pp:sched=1f1b",
       "zero1:resume=1", "zero3:resume=1", "tp:resume=1", "pp:resume=1", "ddp:accum=2", "zero3:accum=2",
       "zero3:ac=1,resume=1", "pp:ac=1", "tp:ac=1"]
TWO_HF = ["tp:model=hf-gpt2,strided=refuse", "tp:model=hf-llama", "tp:model=hf-gpt2,resume=1,strided=refuse",
          "zero3:model=hf-llama,ac=1", "zero3:model=hf-llama,offload=1,kept=2,resume=1"]
FOUR = ["dp_tp", "zero2_tp", "zero1_tp", "pp_tp", "dp_pp:sched=gpipe", "dp_pp:sched=1f1b", "zero1_pp",
        "zero3_pp", "ddp", "zero3", "pp:pp=4,mb=4,sched=1f1b", "tp:tp=4",
        "zero1_tp:resume=1", "zero1_pp:resume=1", "dp_pp:resume=1", "pp_tp:resume=1", "dp_tp:accum=2"]
# FSDP2 over HF GPT-2's packed c_attn: its bias is sharded twice on one dim (FSDP2's _StridedShard and the packing's).
FOUR_HF = ["zero2_tp:model=hf-gpt2,resume=1,strided=refuse"]
EIGHT = ["dp_pp_tp", "zero1_pp_tp", "zero3_pp_tp", "dp_pp_tp:resume=1", "zero1_pp_tp:resume=1"]


def test_two_processes():
    cases = TWO + (TWO_HF if HAS_HF else [])
    for line in check_cases(torchrun_worker(2, cases, timeout=240), cases):
        print(line)


FOUR_QUICK = ["dp_tp", "zero2_tp", "pp_tp", "dp_pp:sched=1f1b", "zero3_pp", "tp:tp=4", "pp_tp:resume=1",
              "dp_tp:accum=2"]
"""The 4-process cases of `make test`: every pair of dimensions, resumed and accumulated once; all in test-slow."""


def test_four_processes():
    cases = FOUR_QUICK + (FOUR_HF if HAS_HF else [])
    for line in check_cases(torchrun_worker(4, cases, timeout=400), cases):
        print(line)


@pytest.mark.slow
def test_four_processes_every_case():
    cases = [c for c in FOUR if c not in FOUR_QUICK]
    for line in check_cases(torchrun_worker(4, cases, timeout=400), cases):
        print(line)


@pytest.mark.slow
def test_eight_processes_3d():
    """dp x pp x tp needs 2 x 2 x 2 ranks: 8 processes on a 2-core machine, hence slow."""
    for line in check_cases(torchrun_worker(8, EIGHT, timeout=900), EIGHT):
        print(line)


def test_cli_launch_then_single_process_resume(tiny_args, tmp_path):
    """The CLI path: `launch` re-executes under torchrun, rank 0 prints and saves; the one-process trainer resumes
    the pipeline run's checkpoint (weights and AdamW moments in the single-process format)."""
    base = [sys.executable, "-m", "tightfit.cli", "train", *tiny_args]
    dist_run = subprocess.run(base + ["--steps", "3", "--nproc-per-node", "2", "--master-port", str(free_port()),
                                      "--strategy", "pp", "--pp-microbatches", "2", "--log-interval", "1"],
                              env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert dist_run.returncode == 0, dist_run.stderr[-3000:]
    out = dist_run.stdout
    assert out.count("step 3/3") == 1  # only rank 0 prints
    assert "strategy pp" in out and "checkpoint" in out
    single = subprocess.run(base + ["--steps", "5", "--resume"], env=rank_env(), cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert single.returncode == 0, single.stderr[-3000:]
    assert "resumed from" in single.stdout and "step 5/5" in single.stdout


@pytest.mark.slow
def test_cli_distributed_resume_is_exact(tiny_args, tmp_path):
    """Stop a 2-rank ddp run at step 2, resume it: steps 3-4 print the same losses as an uninterrupted run (weights,
    AdamW moments and every dp rank's data position restored)."""
    import re

    def run(out: str, *extra: str) -> str:
        args = [a if a != tiny_args[tiny_args.index("--out-dir") + 1] else str(tmp_path / out) for a in tiny_args]
        proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *args, "--steps", "4", "--log-interval",
                               "1", "--nproc-per-node", "2", "--master-port", str(free_port()), "--strategy", "ddp",
                               *extra], env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    def losses(out: str) -> dict[int, str]:
        return {int(m[0]): m[1] for m in re.findall(r"step (\d+)/4 \| loss (\S+)", out)}

    run("a", "--stop-at", "2")
    resumed = losses(run("a", "--resume"))
    straight = losses(run("b"))
    assert resumed == {3: straight[3], 4: straight[4]}, (resumed, straight)
