"""TightfitTrainer: the same losses, clipped gradient norms and learning rates as a stock `transformers.Trainer`
(fp32, CPU), checkpoints saved and resumed through Trainer's own machinery without a pickle, and one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import tightfit
from tightfit.errors import UsageError
from tightfit.integrations.hf_trainer import TightfitTrainer
from tightfit.offload.step.engine import engine_of
from tightfit.offload.model_state.state_io import export_state
from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)

VOCAB, SEQ = 128, 16


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def dataset(n: int = 48) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def args(folder, **kw) -> transformers.TrainingArguments:
    base = dict(output_dir=str(folder), per_device_train_batch_size=4, max_steps=6, learning_rate=1e-2,
                lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.5, weight_decay=0.1, logging_steps=1,
                report_to="none", use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    return transformers.TrainingArguments(**{**base, **kw})


def logged(trainer, after_step: int = 0) -> list[tuple[float, float, float]]:
    return [(h["loss"], h["grad_norm"], h["learning_rate"]) for h in trainer.state.log_history
            if "loss" in h and h["step"] > after_step]


def assert_close(got, ref):
    assert len(got) == len(ref) and got
    for g, r in zip(got, ref):
        for a, b in zip(g, r):
            assert abs(a - b) <= 1e-6 * abs(b), (got, ref)


def nvme(tmp_path):
    return tightfit.Placement.everywhere("nvme", nvme_dir=str(tmp_path / "swap"))


@pytest.mark.parametrize("build,clip,accum", [(llama, 0.5, 2), (gpt2, 0.0, 1)], ids=["llama-clipped-accum", "gpt2"])
def test_trainer_matches_stock_trainer(tmp_path, build, clip, accum):
    kw = dict(max_grad_norm=clip, gradient_accumulation_steps=accum)
    data = dataset()
    stock = transformers.Trainer(model=build(), args=args(tmp_path / "stock", **kw), train_dataset=data)
    stock.train()
    ours = TightfitTrainer(model=build(), args=args(tmp_path / "ours", **kw), train_dataset=data,
                           placement=nvme(tmp_path))
    ours.train()
    ref = logged(stock)
    assert_close(logged(ours), ref)
    assert len({lr for _, _, lr in ref}) > 2  # the schedule moved the learning rate
    if clip:
        assert all(norm > clip for _, norm, _ in ref)  # every step was clipped, so clipping is what is compared
    # The trained weights, not only the losses.
    plain = dict(stock.model.named_parameters())
    for key, value in export_state(ours.model):
        torch.testing.assert_close(value, plain[key.removeprefix("model.")].detach(), rtol=1e-5, atol=1e-7)


def test_checkpoint_resume_through_trainer(tmp_path):
    """Stopped at step 3 and resumed from Trainer's checkpoint-3: the steps after it equal an unbroken run."""
    data = dataset()
    kw = dict(save_strategy="steps", save_steps=3, gradient_accumulation_steps=2)
    full = TightfitTrainer(model=llama(), args=args(tmp_path / "run", **kw), train_dataset=data,
                           placement=nvme(tmp_path))
    full.train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    files = {p.name for p in ckpt.iterdir()}
    assert {"optimizer.safetensors", "scheduler.json", "model.safetensors", "config.json"} <= files
    assert {"rng_state.safetensors", "training_args.json", "trainer_state.json"} <= files
    assert not [f for f in files if f.endswith((".pt", ".pth", ".bin"))]  # no pickle anywhere
    engine_of(full.model).close()

    resumed = TightfitTrainer(model=llama(), args=args(tmp_path / "run2", **kw), train_dataset=data,
                              placement=tightfit.Placement.everywhere("host"))
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert_close(logged(resumed, after_step=3), logged(full, after_step=3))
    assert len(logged(resumed, after_step=3)) == 3
    # The saved model is an ordinary Hugging Face folder holding the weights trained so far.
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run2" / "checkpoint-6")
    ours = dict(export_state(resumed.model))
    for name, p in final.named_parameters():
        assert torch.equal(p.detach(), ours[f"model.{name}"]), name


def test_resume_restores_moments_and_learning_rate(tmp_path):
    """The optimizer file is what makes the resume exact: without the moments (fresh optimizer) it is not."""
    data = dataset()
    kw = dict(save_strategy="steps", save_steps=3)
    full = TightfitTrainer(model=llama(), args=args(tmp_path / "run", **kw), train_dataset=data,
                           placement=tightfit.Placement.everywhere("host"))
    full.train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    groups = json.loads(__import__("safetensors").safe_open(str(ckpt / "optimizer.safetensors"), "pt")
                        .metadata()["param_groups"])
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]  # Trainer's own groups: no decay on norms
    (ckpt / "optimizer.safetensors").unlink()
    fresh = TightfitTrainer(model=llama(), args=args(tmp_path / "run2", **kw), train_dataset=data,
                            placement=tightfit.Placement.everywhere("host"))
    fresh.train(resume_from_checkpoint=str(ckpt))  # weights from model.safetensors, fresh moments
    assert logged(fresh, after_step=3)[0][0] == logged(full, after_step=3)[0][0]  # same weights at step 3
    assert logged(fresh, after_step=3)[1][0] != logged(full, after_step=3)[1][0]  # moments differ after


def test_refusals(tmp_path):
    data = dataset(8)
    with pytest.raises(UsageError, match="not wrapped; pass placement"):
        TightfitTrainer(model=llama(), args=args(tmp_path / "a"), train_dataset=data)
    model = tightfit.wrap(llama(), tightfit.Placement.everywhere("host"), device="cpu")
    with pytest.raises(UsageError, match="tightfit.optim.AdamW"):
        TightfitTrainer(model=model, args=args(tmp_path / "b"), train_dataset=data,
                        optimizers=(torch.optim.AdamW(model.parameters()), None))
    with pytest.raises(UsageError, match="already wrapped"):
        TightfitTrainer(model=model, args=args(tmp_path / "c"), train_dataset=data,
                        placement=tightfit.Placement.everywhere("host"))
    with pytest.raises(UsageError, match="fp16=True"):
        TightfitTrainer(model=model, args=args(tmp_path / "f", fp16=True), train_dataset=data)
    with pytest.raises(UsageError, match=r"sharding='zero4'\): use 'zero1', 'zero2' or 'zero3'"):
        TightfitTrainer(model=llama(), args=args(tmp_path / "g"), train_dataset=data, sharding="zero4",
                        placement=tightfit.Placement.everywhere("host"))
    with pytest.raises(UsageError, match=r"sharding='zero2'\): pass the unwrapped model"):
        TightfitTrainer(model=model, args=args(tmp_path / "h"), train_dataset=data, sharding="zero2")
    with pytest.raises(UsageError, match="optim='adamw_torch_fused'"):
        TightfitTrainer(model=model, args=args(tmp_path / "d", optim="sgd"), train_dataset=data).train()
    stock_ckpt = tmp_path / "stock"
    stock = transformers.Trainer(model=llama(), args=args(stock_ckpt, max_steps=1, save_strategy="steps",
                                                          save_steps=1), train_dataset=data)
    stock.train()
    with pytest.raises(UsageError, match="never unpickles"):
        TightfitTrainer(model=model, args=args(tmp_path / "e"), train_dataset=data).train(
            resume_from_checkpoint=str(stock_ckpt / "checkpoint-1"))


def test_rng_state_round_trip(tmp_path):
    import random

    import numpy as np

    from tightfit.integrations.rng_file import load_rng, save_rng

    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.random(), np.random.standard_normal(), torch.rand(5)  # a cached Gaussian, positions mid-stream
    save_rng(tmp_path / "rng.safetensors")
    first = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(4).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_rng(tmp_path / "rng.safetensors")
    again = (random.random(), random.gauss(0, 1), np.random.standard_normal(3).tolist(), torch.rand(4).tolist())
    assert again == first


@pytest.mark.slow
def test_example_trainer_lora_runs(tmp_path):
    """examples/finetune_hf_trainer_lora.py end to end, a few steps (a fresh interpreter: slow on a loaded machine)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "examples" / "finetune_hf_trainer_lora.py"), "--steps", "4",
                           "--out", str(tmp_path / "out")], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = re.search(r"last loss (\S+) \(unbroken run (\S+)\)", proc.stdout)
    assert resumed and resumed.group(1) == resumed.group(2)
    assert "same logits (max relative difference 0.0e+00)" in proc.stdout
    assert (tmp_path / "out" / "adapters" / "adapter_model.safetensors").is_file()
