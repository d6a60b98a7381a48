"""TightfitTrainer under torchrun with 2 gloo ranks: the losses, clipped gradient norms and learning rates of a
stock Trainer under DDP (fp32, CPU; accelerate deals each rank its share of every batch in both), and its own
checkpoints resumed on 2 ranks continue as the unbroken run. Each rank keeps every state on its own NVMe folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from parallel_launch import ROOT, free_port, rank_env  # noqa: E402

WORKER = ROOT / "tests" / "trainer_ranks.py"


def _ranks(kind: str, out, mode: str = "") -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(WORKER), kind, str(out), *([mode] if mode else [])],
                          env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    history = json.loads((out / f"log{'-' + mode if mode else ''}.json").read_text())
    return [(h["step"], h["loss"], h["grad_norm"], h["learning_rate"]) for h in history if "loss" in h]


def _close(got, ref, rel: float = 1e-6) -> None:
    assert len(got) == len(ref) and got, (got, ref)
    for g, r in zip(got, ref):
        assert g[0] == r[0]
        for a, b in zip(g[1:], r[1:]):
            assert abs(a - b) <= rel * abs(b), (got, ref)


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> list:
    return _ranks("stock", tmp_path_factory.mktemp("stock"))


def test_two_ranks_match_stock_trainer_under_ddp_and_resume(tmp_path, stock):
    ours = _ranks("ours", tmp_path / "ours", "save")
    _close(ours, stock)
    assert all(norm > 0.5 for _, _, norm, _ in stock)  # every step clipped: clipping is what is compared
    assert (tmp_path / "ours" / "checkpoint-3" / "rng_state_1.safetensors").is_file()
    resumed = [h for h in _ranks("ours", tmp_path / "ours", "resume") if h[0] > 3]  # the history holds 1-3 too
    _close(resumed, [h for h in ours if h[0] > 3])


@pytest.mark.slow
def test_zero3_ranks_match_stock_trainer_under_ddp_and_resume(tmp_path, stock):
    """`TightfitTrainer(sharding="zero3")`: each rank holds its own units' parameters, master, gradients and moments
    alone, each use's parameters sent by their rank: the losses, clipped norms and learning rates of the stock
    Trainer under DDP; its checkpoint (the one-process files, gathered to rank 0) resumes on 2 zero3 ranks as the
    unbroken run, and loads into one process of the engine."""
    ours = _ranks("zero3", tmp_path / "z3", "save")
    _close(ours, stock)
    saved = tmp_path / "z3" / "checkpoint-3"
    assert (saved / "optimizer.safetensors").is_file() and (saved / "model.safetensors").is_file()
    resumed = [h for h in _ranks("zero3", tmp_path / "z3", "resume") if h[0] > 3]
    _close(resumed, [h for h in ours if h[0] > 3])
    import transformers

    full = transformers.AutoModelForCausalLM.from_pretrained(saved)  # one folder from_pretrained reads
    assert sum(p.numel() for p in full.parameters()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["zero1", "zero2"])
def test_zero1_and_zero2_ranks_match_stock_trainer_under_ddp_and_resume(tmp_path, stock, sharding):
    """`TightfitTrainer(sharding="zero1"|"zero2")`: each rank steps its own units (zero2: their gradients reduced to
    it), the new values broadcast after each optimizer step: the stock Trainer's losses, clipped norms and learning
    rates under DDP, and its checkpoint resumes on 2 ranks as the unbroken run."""
    ours = _ranks(sharding, tmp_path / sharding, "save")
    _close(ours, stock)
    resumed = [h for h in _ranks(sharding, tmp_path / sharding, "resume") if h[0] > 3]
    _close(resumed, [h for h in ours if h[0] > 3])
