"""Shared pieces of the offload tests: tiny models, deterministic data, and one training loop for plain and wrapped."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit import Placement, Tier, UnitPlacement
from tightfit.models.gpt import GPT, GPTConfig
from tightfit.optim import AdamW

VOCAB, SEQ = 64, 16


def tiny_gpt() -> torch.nn.Module:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=3, n_head=2, n_embd=32))


def hf_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def hf_llama(layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False,
                      bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg)


def batch(i: int, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, VOCAB, (b, SEQ), generator=g)
    return x, torch.roll(x, -1, 1)


def loss_of(model, x, y) -> torch.Tensor:
    if isinstance(model, GPT):
        return model(x, y)
    return model(input_ids=x, labels=x).loss


def continue_training(model, opt, steps) -> list[float]:
    """The losses of `model` trained on the batches of `steps` (a range of step numbers, one micro-batch each), as
    `train` trains: a resumed run's continuation."""
    losses = []
    for step in steps:
        loss = loss_of(model, *batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train(build, placement=None, *, steps=10, accum=1, clip=None, fused=True, lr=1e-2, freeze=(),
          compute_dtype=torch.float32, wrap_kwargs=None, scaler=None, seed=0, early=False, preload=False,
          device="cpu"):
    """Train `build()` for `steps` optimizer steps; plain PyTorch + torch.optim.AdamW when placement is None.

    Returns (losses, model, optimizer). `freeze`: parameter-name prefixes set to requires_grad=False.
    `early`: step units during the last micro-batch's backward (`AdamW.step_during_backward`).
    `preload`: load optimizer states during the last micro-batch's backward (`AdamW.preload_during_backward`).
    `device`: where the model computes (the plain model is moved there; the wrapped one is wrapped for it).
    """
    torch.manual_seed(seed)
    model = build()
    for name, p in model.named_parameters():
        if name.startswith(tuple(freeze)):
            p.requires_grad_(False)
    if placement is None:
        model.to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=fused or None)
    else:
        tightfit.wrap(model, placement, compute_dtype=compute_dtype, device=device, **(wrap_kwargs or {}))
        opt = AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            x, y = (t.to(device) for t in batch(step * accum + micro))
            loss = loss_of(model, x, y) / accum
            if early and micro == accum - 1:
                opt.step_during_backward()
            if preload and micro == accum - 1:
                opt.preload_during_backward()
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.item()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            if placement is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            else:
                opt.clip_grad_norm_(clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        losses.append(total)
    if placement is not None:
        # The last step is queued for the next forward ([Note: steps under the next forward]); the tests read the
        # engine's internals and counters next, so the states are first brought to rest.
        from tightfit.offload.step.engine import engine_of

        engine_of(model).wait_steps()
    return losses, model, opt


def tier_placements(tmp_path) -> dict[str, Placement]:
    """Every state on NVMe; every state in host memory; every state on a different tier somewhere (the root unit on
    the host)."""
    swap = str(tmp_path / "swap")
    mixed = UnitPlacement(params=Tier.NVME, master=Tier.HOST, grads=Tier.DEVICE, optim=Tier.NVME)
    return {"nvme": Placement.everywhere(Tier.NVME, nvme_dir=swap),
            "host": Placement.everywhere(Tier.HOST),
            "mixed": Placement(default=mixed, units={"root": UnitPlacement.all_on(Tier.HOST)}, nvme_dir=swap)}


def max_rel_diff(a, b) -> float:
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max())


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run fastest on one intra-op thread, and a loaded shared machine stalls OpenMP barriers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
