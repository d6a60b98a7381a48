"""Acceptance: every strategy trains 5 steps to the same losses (rel <= 1e-5) and weights as one process.

One torchrun launch per world size checks many strategies in one process group (tests/parallel_worker.py), so
the process start-up and imports are paid once. CPU, gloo, one thread per rank.
"""

from __future__ import annotations

import importlib.util

import pytest

from parallel_launch import check_cases, torchrun_worker

HAS_HF = importlib.util.find_spec("transformers") is not None

TWO = ["ddp", "zero1", "zero2", "zero3", "zero3:offload=1", "tp", "pp:sched=gpipe", "pp:sched=1f1b"]
TWO_HF = ["tp:model=hf-gpt2", "tp:model=hf-llama"]
FOUR = ["dp_tp", "zero2_tp", "zero1_tp", "pp_tp", "dp_pp:sched=gpipe", "dp_pp:sched=1f1b", "zero1_pp",
        "zero3_pp", "ddp", "zero3", "pp:pp=4,mb=4,sched=1f1b", "tp:tp=4"]
EIGHT = ["dp_pp_tp", "zero1_pp_tp", "zero3_pp_tp"]


def test_two_processes():
    cases = TWO + (TWO_HF if HAS_HF else [])
    for line in check_cases(torchrun_worker(2, cases, timeout=240), cases):
        print(line)


def test_four_processes():
    for line in check_cases(torchrun_worker(4, FOUR, timeout=400), FOUR):
        print(line)


@pytest.mark.slow
def test_eight_processes_3d():
    """dp x pp x tp needs 2 x 2 x 2 ranks: 8 processes on a 2-core machine, hence slow."""
    for line in check_cases(torchrun_worker(8, EIGHT, timeout=900), EIGHT):
        print(line)
