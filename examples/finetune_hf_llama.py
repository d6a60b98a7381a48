"""Fine-tune a Hugging Face Llama checkpoint with tightfit.wrap in an ordinary PyTorch loop, then save it back.

    python examples/finetune_hf_llama.py [--model DIR] [--out DIR] [--steps N]

Without --model, a tiny Llama (random weights, byte-level vocabulary) is saved with `save_pretrained` first, to
stand in for a checkpoint you already have. The checkpoint is never loaded into host memory as a whole: the model
is built on the meta device, `tightfit.wrap` places every state (weights, fp32 masters, gradients, Adam moments)
on NVMe, and the weights then stream from the safetensors shards into those tiers one block at a time. The loop
is the ordinary one. The result is a normal Hugging Face folder: `from_pretrained` opens it with no conversion.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import transformers

import tightfit
import tightfit.optim
from tightfit.models.build import model_loss
from tightfit.models.hf_load import HFCheckpoint, build_meta_model
from tightfit.models.hf_save import save_hf_model
from tightfit.models.hf_wrap import fill_wrapped
from tightfit.models.tokenizer import get_tokenizer
from tightfit.offload.step.engine import engine_of


def make_stand_in_checkpoint(folder: Path) -> None:
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=176,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder, max_shard_size="100KB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Hugging Face Llama folder (default: a tiny stand-in)")
    p.add_argument("--tokenizer", help="its tokenizer folder (default: bytes, vocab 256)")
    p.add_argument("--out", help="where to save the fine-tuned folder (default: a temp folder)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args()
    torch.manual_seed(0)
    work = Path(tempfile.mkdtemp(prefix="tightfit-example-"))
    src = Path(args.model) if args.model else work / "llama"
    if not args.model:
        make_stand_in_checkpoint(src)
    out = Path(args.out) if args.out else work / "finetuned"

    # 1. Shapes only, then states in their tiers, then the weights streamed in unit by unit.
    ckpt = HFCheckpoint.open(src)
    model = build_meta_model(ckpt.config)
    model.get_input_embeddings().weight.requires_grad_(False)  # frozen: no gradient, no optimizer state
    placement = tightfit.Placement.everywhere("nvme", nvme_dir=str(work / "swap"))
    model = tightfit.wrap(model, placement)
    fill_wrapped(model, ckpt)

    # 2. The ordinary loop. model_loss takes pre-shifted (x, y) and returns the mean next-token cross-entropy.
    tok = get_tokenizer(args.tokenizer)
    data = torch.tensor(tok.encode(Path(__file__).read_text() * 4), dtype=torch.long)
    opt = tightfit.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.0)
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - args.seq_len - 1, (4,))
        chunk = torch.stack([data[s : s + args.seq_len + 1] for s in starts])  # [B, T+1]
        loss = model_loss(model, chunk[:, :-1], chunk[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")

    # 3. Save in the Hugging Face layout, streamed from the tiers, and check transformers reads the same model.
    save_hf_model(model, out, max_shard_size="200KB")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = chunk[:1, :-1]
    with torch.no_grad():
        ours, theirs = model.eval()(x).logits, reloaded(x).logits
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    print(f"saved {out}; transformers' from_pretrained gives the same logits (max relative difference {rel:.1e})")
    engine_of(model).close()  # releases the tiers and deletes the swap files


if __name__ == "__main__":
    main()
