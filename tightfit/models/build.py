"""The model `tightfit train` trains, from `--model`, and one loss convention for every kind of model.

Why: the trainer handles two kinds of model, the reference GPT (`--model gpt`) and any local Hugging Face
causal-LM folder (`--model hf:PATH`: weights, or only a config.json for a random init). They differ in how they
are called: the reference GPT takes `(idx, targets)` and returns the loss, while a transformers model takes
`input_ids` and, given `labels`, shifts them by one internally. The data pipeline yields *pre-shifted* pairs
(x = tokens[:-1], y = tokens[1:], both [B, T]), so `model_loss` never passes `labels`: it takes the logits and
computes the same mean cross-entropy the reference GPT does, in fp32. Both kinds then give the same loss for the
same logits, and no token is dropped twice.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tightfit.config import ModelConfig
from tightfit.errors import UsageError
from tightfit.models.gpt import GPT, GPTConfig


def hf_path(spec: str) -> str | None:
    """The folder of an 'hf:PATH' model spec, None for 'gpt'; UsageError for anything else."""
    if spec == "gpt":
        return None
    if spec.startswith("hf:") and len(spec) > 3:
        return spec[3:]
    raise UsageError(f"--model: expected 'gpt' or 'hf:PATH' (a local Hugging Face folder), got {spec!r}")


def build_model(model_cfg: ModelConfig, vocab_size: int, block_size: int, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model `model_cfg` names, in train mode, on `device`.

    vocab_size: the tokenizer's; a Hugging Face model's embedding must have at least that many rows.
    block_size: the longest sequence trained on (--seq-len); must fit the model's position range.
    device="meta" (Hugging Face models): parameters on the meta device, for a model larger than host memory:
        wrap it, then give it its values with `import_state(get)` where `get` comes from
        `hf_wrap.checkpoint_values(HFCheckpoint.open(path))` (one unit in memory at a time).
    """
    path = hf_path(model_cfg.model)
    if path is None:
        cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=model_cfg.n_layer,
                        n_head=model_cfg.n_head, n_embd=model_cfg.n_embd)
        return GPT(cfg).to(device=device, dtype=dtype).train()

    from tightfit.models.hf_load import HFCheckpoint, build_meta_model, stream_into

    ckpt = HFCheckpoint.open(path)  # reads config.json and the shard headers only: the checks below cost nothing
    text_cfg = ckpt.config.get_text_config() if hasattr(ckpt.config, "get_text_config") else ckpt.config
    model_vocab = getattr(text_cfg, "vocab_size", None)
    if model_vocab is not None and vocab_size > model_vocab:
        raise UsageError(f"--tokenizer: gives token ids up to {vocab_size - 1}, but {path}/config.json has "
                         f"vocab_size {model_vocab}; use the tokenizer the model was trained with")
    max_pos = getattr(text_cfg, "max_position_embeddings", None)
    if max_pos is not None and block_size > max_pos:
        raise UsageError(f"--seq-len: {block_size} exceeds the {max_pos} positions of {path}/config.json "
                         "(max_position_embeddings); use a shorter --seq-len")
    if torch.device(device).type == "meta":
        from tightfit.models.hf_wrap import meta_model

        return meta_model(ckpt).train()
    model = build_meta_model(ckpt.config)
    stream_into(model, ckpt, dtype=dtype, strict=ckpt.has_weights)
    return model.to(device).train()


def is_hf_model(model: nn.Module) -> bool:
    """True for transformers models (their config has a `model_type`), False for the reference GPT and plain torch."""
    return hasattr(getattr(model, "config", None), "model_type")


def model_logits(model: nn.Module, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [B, T, vocab] for token ids x [B, T], for either kind of model. `positions` [B, T] restart at 0 at
    each example packed into a row: a Hugging Face model then attends within each example (transformers builds a
    block-diagonal mask from position ids that restart, when no attention mask is given), and so does the
    reference GPT (its own mask)."""
    if is_hf_model(model):
        # use_cache=False: training and evaluation never reuse keys/values, so building a cache only costs memory.
        if positions is None:
            return model(input_ids=x, use_cache=False).logits
        return model(input_ids=x, position_ids=positions, use_cache=False).logits
    return model(x) if positions is None else model(x, positions=positions)


def model_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy for pre-shifted inputs x and targets y (both [B, T] int64), in fp32."""
    if not is_hf_model(model):
        return model(x, y)
    logits = model_logits(model, x)  # [B, T, vocab]
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
