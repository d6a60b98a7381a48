"""Fine-tuning records on two ranks with the offload engine on each (`--strategy ddp --offload host`): the losses of
one process with twice the accumulation on the same rows. Each micro-batch's loss is normalised by the answer
tokens of the whole step, every rank's together, so the ranks' averaged gradients are the one process's."""

from __future__ import annotations

import json
import subprocess
import sys

import sft_helpers as h
from parallel_launch import ROOT, free_port, rank_env

STEPS = 4


def _train(llama, data, out, *extra: str) -> list[float]:
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", "--model", f"hf:{llama}", "--data",
                           str(data), "--seq-len", "64", "--micro-batch", "2", "--steps", str(STEPS), "--lr", "1e-2",
                           "--warmup-steps", "0", "--log-interval", "1", "--eval-interval", str(STEPS),
                           "--eval-batches", "2", "--tensorboard", "off", "--keep-checkpoints", "0", "--out-dir",
                           str(out), *extra], env=rank_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


def test_records_on_two_ranks_with_the_engine_train_as_one_process(tmp_path):
    llama, _ = h.setup(tmp_path, seq=64)
    data = h.write_jsonl(tmp_path / "chat.jsonl", h.chat_records(60, seed=4))
    one = _train(llama, data, tmp_path / "one", "--grad-accum", "2", "--offload", "none")
    two = _train(llama, data, tmp_path / "two", "--grad-accum", "1", "--offload", "host", "--strategy", "ddp",
                 "--nproc-per-node", "2", "--master-port", str(free_port()))
    assert len(one) == len(two) == STEPS
    for a, b in zip(two, one):
        assert abs(a - b) <= 1e-6 * abs(b), (two, one)
