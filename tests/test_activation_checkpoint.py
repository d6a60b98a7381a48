"""Activation checkpointing of every block under the scale-out strategies (tightfit/parallel/activation_checkpoint.py):
the blocks recompute their forward in backward, keep fewer bytes for it, and give the same gradients; `auto` asks
the strategy's memory estimate. The strategies themselves with it: tests/test_parallel_equivalence.py (`ac=1`)."""

from __future__ import annotations

import copy

import torch

from tightfit.models.gpt import GPT, GPTConfig
from tightfit.parallel.activation_checkpoint import checkpoint_blocks, wanted
from tightfit.parallel.costs import ModelProfile
from tightfit.parallel.plan import parse_strategy


def _saved_bytes_and_grads(model, x):
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).float().logsumexp(-1).mean()
    loss.backward()
    return sum(saved), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_blocks_recompute_keep_less_and_give_the_same_gradients():
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=2, n_embd=32))
    checked = copy.deepcopy(plain)
    assert checkpoint_blocks(checked) == 3
    assert [n for n, _ in checked.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert checked.state_dict().keys() == plain.state_dict().keys()  # checkpoints and exports see the same names
    runs = {"block": 0}
    checked.blocks[1].attn.register_forward_hook(lambda *a: runs.__setitem__("block", runs["block"] + 1))
    x = torch.randint(0, 64, (4, 32))
    kept, grads = _saved_bytes_and_grads(checked, x)
    plain_kept, plain_grads = _saved_bytes_and_grads(plain, x)
    assert runs["block"] == 2  # its forward, and again in its backward
    assert kept < plain_kept / 2, (kept, plain_kept)
    for n, g in plain_grads.items():
        assert torch.equal(grads[n], g), n  # the same ops on the same values: bit for bit


def _llama70b_like(checkpointed=False) -> ModelProfile:
    return ModelProfile(n_params=69_000_000_000, largest_layer_params=262_000_000, largest_block_params=856_000_000,
                        n_layers=80, n_heads=64, hidden=8192, vocab=32000, seq_len=4096, micro_batch=1,
                        checkpointed=checkpointed)


def test_auto_checkpoints_where_the_estimate_outgrows_the_gpu():
    plan = parse_strategy("zero3", 8, 0, 0, "1f1b", 4, cpu_offload=True)
    prof = _llama70b_like()
    assert _llama70b_like(True).activation_bytes < prof.activation_bytes / 20
    assert wanted("on", plan, prof, None) == (True, "--checkpointing on")
    assert wanted("off", plan, prof, 80 << 30)[0] is False
    assert wanted("auto", plan, prof, None)[0] is False  # a CPU rank: nothing to fit
    yes, why = wanted("auto", plan, prof, 80 << 30)
    assert yes and "--checkpointing auto" in why and "80.0 GiB" in why
    small = ModelProfile(n_params=10_000_000, largest_layer_params=1_000_000, largest_block_params=1_000_000,
                         n_layers=4, n_heads=4, hidden=256, vocab=1000, seq_len=128)
    assert wanted("auto", plan, small, 80 << 30)[0] is False  # fits without
