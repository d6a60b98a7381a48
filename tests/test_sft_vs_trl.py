"""tightfit's fine-tuning against TRL's SFTTrainer on the same records, model and hyperparameters (fp32, CPU).

Two checks per case, both able to fail:
1. Masking and packing: the rows TRL prepares from the training records (its tokenization, loss mask, best-fit
   decreasing packing) are tightfit's rows, token for token and target for target, in the same order.
2. Training: TRL trains on tightfit's rows in tightfit's order (its own collator: padding-free rows with restarting
   position ids, or padding with an attention mask; its loss, normalised by the step's answer tokens), and the
   20 per-step losses agree with tightfit's within 1e-5 relative. LoRA (peft, the same initial adapters) too, with
   tightfit's base on the host tier.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import sft_helpers as h
from tightfit.cli import main

import datasets
import trl  # the dev extra installs both: a missing one fails here, not skips

STEPS, MICRO, ACCUM, SEQ, SEED, LR = 20, 2, 2, 64, 7, 1e-3
TOLERANCE = 1e-5
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    model, _ = h.setup(tmp, seq=SEQ)
    h.write_jsonl(tmp / "chat.jsonl", h.chat_records(48, seed=1))
    h.write_jsonl(tmp / "pc.jsonl", h.prompt_completion_records(48, seed=2))
    return tmp


def _tightfit(folder: Path, data: str, out: Path, packing: bool, lora: bool) -> list[float]:
    args = ["train", "--model", f"hf:{folder / 'llama'}", "--data", str(folder / data), "--seq-len", str(SEQ),
            "--micro-batch", str(MICRO), "--grad-accum", str(ACCUM), "--steps", str(STEPS), "--lr", str(LR),
            "--min-lr", str(LR), "--warmup-steps", "0", "--weight-decay", "0", "--beta2", "0.999",
            "--grad-clip", "1.0", "--seed", str(SEED), "--val-fraction", "0.125", "--log-interval", "1",
            "--eval-interval", str(STEPS), "--precision", "fp32", "--device", "cpu", "--tensorboard", "off",
            "--out-dir", str(out), "--keep-checkpoints", "0", "--offload", "host" if lora else "none"]
    if not packing:
        args.append("--no-packing")
    if lora:
        args += ["--lora", "r=4,alpha=8,dropout=0,targets=q_proj,v_proj"]
    assert main(args) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("kind") == "train"]


def _tightfit_rows(folder: Path, data: str, out: Path, packing: bool):
    """tightfit's training rows, in row order, and the rows of each step (the dataset the run drew from)."""
    from tightfit.config import Config
    from tightfit.finetune.examples import load_examples
    from tightfit.models.tokenizer import get_tokenizer

    cfg = Config()
    cfg.model.model = f"hf:{folder / 'llama'}"
    cfg.data.data, cfg.data.val_fraction, cfg.data.packing = str(folder / data), 0.125, packing
    cfg.train.seq_len, cfg.train.seed, cfg.train.out_dir = SEQ, SEED, str(out)
    ds = load_examples(cfg, get_tokenizer(str(folder / "llama")), lambda s: None)
    rows = []
    for r in range(len(ds.train)):
        members = ds.train.members[ds.train.starts[r]:ds.train.starts[r + 1]]
        pieces = []
        for m in members:
            e, n = int(ds.train.examples[m]), int(ds.train.lengths[m])
            s = int(ds.train.data.offsets[e])
            ids = np.asarray(ds.train.data.ids[s:s + n]).tolist()
            mask = np.asarray(ds.train.data.mask[s:s + n]).tolist()
            pieces.append((ids, [t if k else -100 for t, k in zip(ids, mask)]))
        rows.append(pieces)
    per_step = MICRO * ACCUM
    order = [ds._row_of(i) for i in range(STEPS * per_step)]
    return rows, order, ds


def _trl_args(out: Path, packing: bool, chat: bool):
    return trl.SFTConfig(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=MICRO,
                         gradient_accumulation_steps=ACCUM, learning_rate=LR, lr_scheduler_type="constant",
                         warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                         max_grad_norm=1.0, optim="adamw_torch_fused", seed=SEED, logging_steps=1, report_to=[],
                         save_strategy="no", use_cpu=True, bf16=False, fp16=False, max_length=SEQ, packing=packing,
                         assistant_only_loss=chat, shuffle_dataset=False, dataloader_drop_last=False,
                         disable_tqdm=True)


class _InOrder(trl.SFTTrainer):
    """SFTTrainer that samples its dataset in order and records each micro-batch's loss."""

    micro: list[float]

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.micro.append(float(loss))
        return loss


def _trl_model(folder: Path, lora: bool):
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "llama", dtype=torch.float32)
    if lora:  # peft's adapters at tightfit's initial values for the run's seed (tightfit/finetune/lora.py)
        from tightfit.finetune.lora import initialise

        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
        initialise(model, SEED)
    return model


def _trl_prepared(folder: Path, data: str, train_records: list, out: Path, packing: bool, chat: bool):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder / "llama")
    trainer = trl.SFTTrainer(model=_trl_model(folder, False), args=_trl_args(out, packing, chat),
                             train_dataset=datasets.Dataset.from_list(train_records), processing_class=tok)
    return trainer.train_dataset, tok


@pytest.mark.parametrize("data,packing,lora", [
    ("chat.jsonl", True, False), ("chat.jsonl", False, False), ("pc.jsonl", True, False),
    ("pc.jsonl", False, False), ("chat.jsonl", True, True)])
def test_rows_and_losses_equal_trl_sft_trainer(folder, tmp_path, data, packing, lora):
    chat = data.startswith("chat")
    records = [json.loads(line) for line in (folder / data).read_text().splitlines()]
    every = 8  # --val-fraction 0.125: every 8th record held out
    train_records = [r for i, r in enumerate(records) if i % every != every - 1]
    rows, order, _ = _tightfit_rows(folder, data, tmp_path / "rows", packing)

    # 1. The rows TRL prepares are tightfit's, in order.
    prepared, tok = _trl_prepared(folder, data, train_records, tmp_path / "trl-prep", packing, chat)
    assert len(prepared) == len(rows)
    for r, (mine, theirs) in enumerate(zip(rows, prepared)):
        lengths = theirs["seq_lengths"] if packing else [len(theirs["input_ids"])]
        at, pieces = 0, []
        for n in lengths:
            pieces.append((theirs["input_ids"][at:at + n], theirs["labels"][at:at + n]))
            at += n
        assert pieces == mine, f"row {r} differs"

    # 2. The same rows in the same order: the same losses.
    ours = _tightfit(folder, data, tmp_path / "tightfit", packing, lora)
    in_order = datasets.Dataset.from_list([prepared[i] for i in order])
    args = _trl_args(tmp_path / "trl", packing, chat=False)  # the rows' labels carry the masks already
    args.dataset_kwargs = {"skip_prepare_dataset": True}
    trainer = _InOrder(model=_trl_model(folder, lora), args=args, train_dataset=in_order, processing_class=tok)
    trainer.micro = []
    trainer.train()
    theirs = [sum(trainer.micro[i:i + ACCUM]) for i in range(0, len(trainer.micro), ACCUM)]
    assert len(ours) == len(theirs) == STEPS
    np.testing.assert_allclose(ours, theirs, rtol=TOLERANCE)
    assert ours[-1] < ours[0]  # it learns


def test_packing_goes_by_windows_of_examples_as_trl_packs_them(folder, tmp_path):
    """More examples than one `datasets.map` batch (1,000): TRL packs each batch on its own, and so does tightfit."""
    many = h.write_jsonl(tmp_path / "many.jsonl", h.prompt_completion_records(2400, seed=9))
    records = [json.loads(line) for line in many.read_text().splitlines()]
    train_records = [r for i, r in enumerate(records) if i % 8 != 7]
    (folder / "many.jsonl").write_bytes(many.read_bytes())
    rows, _, _ = _tightfit_rows(folder, "many.jsonl", tmp_path / "rows", packing=True)
    prepared, _ = _trl_prepared(folder, "many.jsonl", train_records, tmp_path / "trl-prep", True, False)
    assert len(train_records) > 2000 and len(prepared) == len(rows)
    for r, (mine, theirs) in enumerate(zip(rows, prepared)):
        at, pieces = 0, []
        for n in theirs["seq_lengths"]:
            pieces.append((theirs["input_ids"][at:at + n], theirs["labels"][at:at + n]))
            at += n
        assert pieces == mine, f"row {r} differs"
