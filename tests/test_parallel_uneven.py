"""Scale-out with any split of the evaluation batches, and a rank that stops waiting says where and why (issue 17).

- `--eval-batches 3` on 2 dp ranks under zero3 deals 2 batches to rank 0 and 1 to rank 1; `--eval-batches 1` deals
  rank 1 none. A forward under zero3 all-gathers the weights, so a rank with fewer batches must still join every
  forward of its peers: before the fix rank 0 waited in the all-gather until the process-group timeout. The run
  must finish, and its validation loss must be the plain mean over the real batches (the padding passes are not
  counted): checked against a one-process evaluation of the checkpoint's weights on the same batches.
- A rank that is frozen (SIGSTOP) leaves its peer waiting in a collective: after --dist-timeout the peer stops with
  one line naming the collective phase and the timeout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from parallel_launch import ROOT, free_port, rank_env, start_ranks


def _val_losses(out_dir) -> dict[int, float]:
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["val_loss"] for r in recs if r.get("kind") == "eval"}


def _reference_val_loss(tiny_args, out_dir, eval_batches: int) -> float:
    """The checkpoint's weights evaluated by one process on the trainer's fixed held-out batches."""
    from tightfit.cli import _parser
    from tightfit.config import config_from_args
    from tightfit.models.build import build_model, model_loss
    from tightfit.train import checkpoint as ckpt
    from tightfit.train.loop import load_dataset

    cfg = config_from_args(_parser().parse_args(["train", *tiny_args, "--eval-batches", str(eval_batches)]))
    dataset = load_dataset(cfg, None)
    model = build_model(cfg.model, vocab_size=dataset.vocab_size, block_size=cfg.train.seq_len)
    state = ckpt.load_checkpoint(out_dir / ckpt.CHECKPOINT_NAME)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state.get(f"model.{n}"))
    model.eval()
    val = dataset.val_batches(eval_batches, cfg.train.micro_batch, seed=cfg.train.seed + 1)
    with torch.no_grad():
        return sum(model_loss(model, x, y).item() for x, y in val) / len(val)


@pytest.mark.parametrize("strategy,eval_batches", [("zero3", 1), pytest.param("zero2", 3, marks=pytest.mark.slow)])
def test_evaluates_and_saves_with_uneven_batches(tiny_args, tmp_path, strategy, eval_batches):
    """A checkpoint right after an evaluation (step 2) too: a forward without backward must leave FSDP's groups
    sharded, or the next backward fails to free the unsharded storage the checkpoint writer read."""
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "tightfit.cli", "train", *tiny_args, "--steps", "4", "--eval-interval", "2",
           "--eval-batches", str(eval_batches), "--save-interval", "2", "--nproc-per-node", "2", "--strategy",
           strategy, "--master-port", str(free_port()), "--dist-timeout", "40"]
    proc = subprocess.run(cmd, env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "done: 4 steps" in proc.stdout
    losses = _val_losses(out_dir)
    assert sorted(losses) == [2, 4]
    assert losses[4] == pytest.approx(_reference_val_loss(tiny_args, out_dir, eval_batches), rel=1e-5)


@pytest.mark.slow
def test_a_frozen_rank_leaves_its_peer_one_line_naming_the_collective(tiny_args, tmp_path):
    cmd = [sys.executable, "-m", "tightfit.cli", "train", *tiny_args, "--steps", "100000", "--log-interval",
           "1", "--strategy", "zero3", "--dist-timeout", "6"]
    procs, logs = start_ranks(cmd, tmp_path)
    try:
        t0 = time.time()
        while "3/100000 | loss" not in logs[0].read_text(errors="replace"):
            assert time.time() - t0 < 180, logs[0].read_text()[-2000:]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGSTOP)
        rc = procs[0].wait(timeout=90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = logs[0].read_text()
    errors = [line for line in out.splitlines() if line.startswith("tightfit: error:")]
    assert rc == 1 and len(errors) == 1, out[-2000:]
    assert "rank 0: lost contact with another rank in training step" in errors[0]
    assert "--dist-timeout 6s" in errors[0]
    assert "Traceback" not in out
