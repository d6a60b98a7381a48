"""LoRA fine-tune of a Hugging Face causal LM with `transformers.Trainer` and peft, its states offloaded by tightfit.

    python examples/finetune_hf_trainer_lora.py [--model DIR] [--out DIR] [--steps N] [--nvme DIR]

This is an ordinary Trainer + peft script: the two lines that differ from one without tightfit are marked
"# tightfit". Without --model a small Llama with random weights (byte-level vocabulary, 256 tokens) stands in for
a checkpoint you have; the training text is this file. What tightfit does underneath:
- the frozen base weights are kept once, in the compute dtype, with no fp32 master, gradient or Adam moments;
  the LoRA adapters' states (master, gradients, moments) sit on NVMe (--nvme, a temp folder by default);
- Trainer clips to `max_grad_norm` and logs the true `grad_norm`; its linear schedule and warmup run as usual;
- Trainer's checkpoints (every steps/2) hold no pickle: optimizer.safetensors, scheduler.json,
  rng_state.safetensors and peft's adapter files. The script resumes a second trainer from the halfway checkpoint
  and checks that it ends on the same loss as the unbroken run;
- at the end the adapters are saved with peft's `save_pretrained`, reopened with `PeftModel.from_pretrained` on a
  fresh base, and give the trained model's logits.
Runs in about a minute on a laptop CPU with the defaults.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model

from tightfit.integrations.hf_trainer import Placement, TightfitTrainer  # tightfit


def base_model(path: str | None) -> transformers.PreTrainedModel:
    if path:
        return transformers.AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=128, intermediate_size=352,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


def lora_model(path: str | None):
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(base_model(path), lora)


def text_dataset(seq_len: int) -> list[dict]:
    """Byte tokens of this file in windows of `seq_len`; labels are the inputs (the model shifts them)."""
    data = torch.tensor(list(Path(__file__).read_bytes() * 8), dtype=torch.long)
    return [{"input_ids": data[i : i + seq_len], "labels": data[i : i + seq_len]}
            for i in range(0, len(data) - seq_len, seq_len // 2)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local Hugging Face causal-LM folder whose vocabulary covers bytes "
                                   "(default: a small random Llama)")
    p.add_argument("--out", help="Trainer's output_dir (default: a temp folder)")
    p.add_argument("--nvme", help="swap folder for the adapters' states (default: a temp folder)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=64)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tightfit-trainer-"))
    out = Path(a.out) if a.out else work / "out"
    ds = text_dataset(a.seq_len)

    def training_args(folder: Path) -> transformers.TrainingArguments:
        return transformers.TrainingArguments(
            output_dir=str(folder), max_steps=a.steps, per_device_train_batch_size=8, gradient_accumulation_steps=2,
            learning_rate=2e-3, lr_scheduler_type="linear", warmup_steps=max(1, a.steps // 10), max_grad_norm=1.0,
            logging_steps=max(1, a.steps // 8), save_steps=max(1, a.steps // 2), report_to="none", use_cpu=True,
            disable_tqdm=True, seed=0)

    def placement(name: str) -> Placement:
        return Placement.everywhere("nvme", nvme_dir=str(Path(a.nvme or work / "swap") / name))

    # The ordinary script, with TightfitTrainer(..., placement=...) where it said Trainer(...).
    trainer = TightfitTrainer(model=lora_model(a.model), args=training_args(out), train_dataset=ds,  # tightfit
                              placement=placement("run"))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(f"step {h['step']:3d}  loss {h['loss']:.4f}  grad_norm {h['grad_norm']:.4f}  lr {h['learning_rate']:.2e}")

    # Resume from the halfway checkpoint with Trainer's own machinery: the run ends where the unbroken one did.
    half = out / f"checkpoint-{max(1, a.steps // 2)}"
    again = TightfitTrainer(model=lora_model(a.model), args=training_args(work / "resumed"), train_dataset=ds,
                            placement=placement("resumed"))
    again.train(resume_from_checkpoint=str(half))
    last, last_again = logs[-1]["loss"], [h for h in again.state.log_history if "loss" in h][-1]["loss"]
    print(f"resumed from {half.name}: last loss {last_again:.6f} (unbroken run {last:.6f})")

    # Adapters with peft's own calls; a fresh base + the saved adapters give the trained model's logits.
    adapters = out / "adapters"
    trainer.save_model(str(adapters))
    reloaded = PeftModel.from_pretrained(base_model(a.model), str(adapters)).eval()
    x = ds[0]["input_ids"][None]
    with torch.no_grad():
        ours, theirs = trainer.model.eval()(input_ids=x).logits, reloaded(input_ids=x).logits
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    print(f"adapters saved to {adapters} ({sorted(f.name for f in adapters.iterdir())}); "
          f"PeftModel.from_pretrained gives the same logits (max relative difference {rel:.1e})")


if __name__ == "__main__":
    main()
