"""`tightfit train` end to end on a tiny model: the loss falls, metrics are logged, resume is bit-identical."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tightfit.cli import main
from tightfit.train.checkpoint import read_all


def _weights(run_dir):
    return {k: v for k, v in read_all(run_dir).items() if not k.startswith("rng.")}


def test_training_lowers_the_loss_and_logs(tiny_args, tmp_path, capsys):
    assert main(["train", *tiny_args, "--steps", "30", "--lr", "1e-2"]) == 0
    out = capsys.readouterr().out
    assert "step 30/30" in out and "tok/s" in out and "ETA" in out and "mem " in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in records if r["kind"] == "eval"]
    assert evals[-1] < evals[0] - 0.5, evals  # starts near ln(256) = 5.55
    summary = [r for r in records if r["kind"] == "summary"][-1]
    assert summary["final_step"] == 30 and summary["val_loss"] == evals[-1]


def test_resume_is_bit_identical(tiny_args, tmp_path):
    i = tiny_args.index("--out-dir")
    a = tiny_args[: i + 1] + [str(tmp_path / "straight")] + tiny_args[i + 2:]
    b = tiny_args[: i + 1] + [str(tmp_path / "split")] + tiny_args[i + 2:]
    assert main(["train", *a, "--steps", "10"]) == 0
    # Interrupted after 5 of 10 steps (same LR schedule), then resumed to 10.
    assert main(["train", *b, "--steps", "10", "--stop-at", "5"]) == 0
    ckpt5 = _weights(tmp_path / "split")
    assert main(["train", *b, "--steps", "10", "--resume"]) == 0
    w_straight, w_split = _weights(tmp_path / "straight"), _weights(tmp_path / "split")
    assert w_straight.keys() == w_split.keys()
    assert any(k.endswith(".exp_avg") for k in w_straight)  # optimizer state is in the checkpoint
    for k in w_straight:
        assert torch.equal(w_straight[k], w_split[k]), k
    assert any(not torch.equal(ckpt5[k], w_split[k]) for k in ckpt5 if k.startswith("model."))


def _with_out_dir(args, out_dir):
    i = args.index("--out-dir")
    return args[: i + 1] + [str(out_dir)] + args[i + 2:]


def test_offloaded_runs_match_plain_and_resume_across_placements(tiny_args, tmp_path):
    """10 plain steps == 5 on NVMe + resume 5 on NVMe == 5 plain + resume 5 on NVMe (fp32, CPU)."""
    swap = ["--nvme", str(tmp_path / "swap")]
    assert main(["train", *_with_out_dir(tiny_args, tmp_path / "plain"), "--steps", "10", "--offload", "none"]) == 0
    nvme = _with_out_dir(tiny_args, tmp_path / "nvme")
    assert main(["train", *nvme, "--steps", "10", "--stop-at", "5", "--offload", "nvme", *swap]) == 0
    assert main(["train", *nvme, "--steps", "10", "--resume", "--offload", "nvme", *swap]) == 0
    mixed = _with_out_dir(tiny_args, tmp_path / "mixed")
    assert main(["train", *mixed, "--steps", "10", "--stop-at", "5", "--offload", "none"]) == 0
    assert main(["train", *mixed, "--steps", "10", "--resume", "--offload", "nvme", *swap]) == 0
    ref = _weights(tmp_path / "plain")
    for run in ("nvme", "mixed"):
        got = _weights(tmp_path / run)
        assert got.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=0, msg=f"{run}: {k}")


def test_budget_too_small_for_a_layer_tiles_it_and_trains_the_same(corpus, tmp_path, capsys):
    """--gpu-mem below what one MLP projection needs: the planner tiles it, the run respects the budget and its
    losses equal plain PyTorch's."""
    base = ["--data", str(corpus), "--n-layer", "2", "--n-embd", "512", "--n-head", "2", "--seq-len", "16",
            "--micro-batch", "1", "--steps", "3", "--eval-interval", "3", "--eval-batches", "2", "--threads", "1"]
    assert main(["plan", *base, "--gpu-mem", "12MiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["placement"]["tiled_linears"], "the planner should tile the oversized projections"
    assert main(["train", *base, "--out-dir", str(tmp_path / "tiled"), "--gpu-mem", "12MiB"]) == 0
    assert main(["train", *base, "--out-dir", str(tmp_path / "plain"), "--offload", "none"]) == 0

    def summary(run):
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines if '"summary"' in x][-1]

    tiled, plain = summary("tiled"), summary("plain")
    assert tiled["peak_memory"]["device"] <= 12 * 2**20
    # Tiles sum partial products over input splits: the same math in another order, so 1e-6 rather than bitwise.
    for key in ("train_loss", "val_loss"):
        assert tiled[key] == pytest.approx(plain[key], rel=1e-6)


def test_offloaded_run_without_clipping_steps_during_backward_and_matches_plain(tiny_args, tmp_path):
    """--grad-clip 0 lets each unit step as its gradients land (AdamW.step_during_backward): same weights."""
    swap = ["--nvme", str(tmp_path / "swap")]
    common = ["--steps", "6", "--grad-clip", "0", "--grad-accum", "2"]
    assert main(["train", *_with_out_dir(tiny_args, tmp_path / "plain"), *common, "--offload", "none"]) == 0
    assert main(["train", *_with_out_dir(tiny_args, tmp_path / "nvme"), *common, "--offload", "nvme", *swap]) == 0
    ref, got = _weights(tmp_path / "plain"), _weights(tmp_path / "nvme")
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=0, msg=k)
    assert not list((tmp_path / "swap").glob("*.safetensors")), "the run left its swap files behind"


def test_the_corpus_is_held_once_in_its_own_dtype_and_batches_are_the_same_int64(tmp_path):
    """The corpus is in RAM for the whole run: held once as loaded (1 byte a token for text, 4 for a tokenizer's
    ids), the train and held-out parts indexing it in place. It was widened to int64 and copied into the two
    parts: 8 bytes a token at rest, 17 while loading. A batch is widened to int64, with the values the parts held
    as streams of their blocks."""
    import numpy as np

    from tightfit.train.data import TokenDataset, load_tokens

    rng = np.random.default_rng(0)
    for dtype, vocab in ((np.uint8, 256), (np.int32, 50_000)):
        tokens = rng.integers(0, vocab, 200_000).astype(dtype)
        data = TokenDataset.from_tokens(tokens, seq_len=32, val_fraction=0.1, vocab_size=vocab)
        assert data.train.tokens.data_ptr() == data.val.tokens.data_ptr() == tokens.ctypes.data  # no copy
        assert data.train.tokens.element_size() == np.dtype(dtype).itemsize
        # The parts as the trainer had them: every 10th block held out, the rest one int64 stream.
        block = data.train.tokens.shape[1]
        t = torch.from_numpy(tokens[: data.train.tokens.numel()].astype(np.int64)).view(-1, block)
        held = torch.arange(len(t)) % 10 == 9
        streams = {"train": t[~held].reshape(-1), "val": t[held].reshape(-1)}
        assert len(data.train) == len(streams["train"]) and len(data.val) == len(streams["val"])
        g = torch.Generator().manual_seed(1)
        x, y = data.sample(4, torch.Generator().manual_seed(1))
        starts = torch.randint(0, len(streams["train"]) - 33, (4,), generator=g)
        want = streams["train"][starts[:, None] + torch.arange(33)[None, :]]
        assert x.dtype == torch.int64 and torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
        vx, _ = data.val_batches(2, 4)[1]
        g = torch.Generator().manual_seed(0)
        torch.randint(0, len(streams["val"]) - 33, (4,), generator=g)
        starts = torch.randint(0, len(streams["val"]) - 33, (4,), generator=g)
        assert torch.equal(vx, streams["val"][starts[:, None] + torch.arange(32)[None, :]])
    # Text files are read into the array's own buffer, joined by newlines.
    (tmp_path / "a.txt").write_bytes(b"abc")
    (tmp_path / "b.txt").write_bytes(b"de")
    loaded = load_tokens(str(tmp_path))
    assert loaded.dtype == np.uint8 and loaded.tobytes() == b"abc\nde" and loaded.flags.writeable


def test_unit_major_training_logs_the_engines_counters_and_matches_micro_batch_major(tiny_args, tmp_path, capsys):
    """`tightfit train --accumulation unit` (offload/step/unit_major.py) against `--accumulation micro`, every state
    on NVMe, four micro-batches a step: the same losses and weights, bit for bit; each train record of metrics.jsonl
    carries the engine's counters per step ([Note: engine counters]), where unit-major order's bytes to the device
    and gradient bytes the host touched are under a third of micro-batch-major order's, and the progress line shows
    the link's and the disk's rates."""
    runs = {}
    flags = {"micro": ["--accumulation", "micro"], "unit": ["--accumulation", "unit"],
             "unit, inputs on the host": ["--accumulation", "unit", "--boundaries", "host", "--checkpointing", "on"]}
    for order, extra in flags.items():
        args = _with_out_dir(tiny_args, tmp_path / order)
        assert main(["train", *args, "--steps", "6", "--log-interval", "3", "--grad-accum", "4", "--offload", "nvme",
                     "--nvme", str(tmp_path / "swap"), *extra]) == 0
        out = capsys.readouterr().out
        assert re.search(r"\| link [0-9.]+ GB/s disk [0-9.]+ GB/s \|", out), out
        assert ("block inputs of 4 micro-batches wait in host memory" in out) == ("--boundaries" in extra), out
        records = [json.loads(line) for line in (tmp_path / order / "metrics.jsonl").read_text().splitlines()]
        runs[order] = [r for r in records if r["kind"] == "train"]
    for order, records in runs.items():
        assert [r["step"] for r in records] == [3, 6]
        for r in records:
            assert set(r["engine"]) == {"h2d_bytes", "d2h_bytes", "host_grad_bytes", "nvme_read_bytes",
                                        "nvme_write_bytes", "optimizer_s", "optimizer_exposed_s", "micro_batches",
                                        "step_s"}, r["engine"]
            assert r["engine"]["micro_batches"] == 4 and r["engine"]["nvme_read_bytes"] > 0
    ref = _weights(tmp_path / "micro")
    for order in ("unit", "unit, inputs on the host"):  # the block inputs come back as they left
        assert [r["loss"] for r in runs[order]] == [r["loss"] for r in runs["micro"]], order
        got = _weights(tmp_path / order)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref), order
    unit, micro = runs["unit"][-1]["engine"], runs["micro"][-1]["engine"]
    assert unit["h2d_bytes"] < micro["h2d_bytes"] / 3 and unit["host_grad_bytes"] < micro["host_grad_bytes"] / 3
