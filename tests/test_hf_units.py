"""The engine's unit detection on the model families issue 7 names, and the explicit policy where it is needed.

Each model is wrapped with every state on NVMe and must give the logits and gradients of the unwrapped model:
a unit boundary in the wrong place would show up as wrong values, not only as a wrong list.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tightfit
import tightfit.optim
from tightfit.models.gpt import GPT, GPTConfig
from tightfit.models.hf_units import slot_units
from tightfit.offload.step.units import find_units

transformers = pytest.importorskip("transformers")


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=3, n_embd=16, n_head=2, vocab_size=50, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=50, bos_token_id=0, eos_token_id=0))


def _encoder():
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))


CASES = {
    # name: (factory, policy, expected non-root units, input)
    "gpt2": (_gpt2, None, [f"transformer.h.{i}" for i in range(3)], lambda: torch.randint(0, 50, (2, 8))),
    "llama": (_llama, None, [f"model.layers.{i}" for i in range(3)], lambda: torch.randint(0, 50, (2, 8))),
    "gpt": (lambda: GPT(GPTConfig(vocab_size=50, block_size=8, n_layer=3, n_head=2, n_embd=16)), None,
            [f"blocks.{i}" for i in range(3)], lambda: torch.randint(0, 50, (2, 8))),
    "transformer_encoder": (_encoder, None, [f"layers.{i}" for i in range(3)], lambda: torch.randn(2, 8, 16)),
    # An nn.Sequential has no ModuleList: detection finds nothing, so the policy names the Linear layers.
    "sequential_mlp": (_mlp, ["0", "2", "4"], ["0", "2", "4"], lambda: torch.randn(4, 16)),
}


def _out(model, x):
    y = model(x)
    return y.logits if hasattr(y, "logits") else y


@pytest.mark.parametrize("name", list(CASES))
def test_units_and_wrapped_numerics(tmp_path, name):
    factory, policy, expected, make_input = CASES[name]
    torch.manual_seed(0)
    plain = factory().train()
    specs = find_units(plain, policy)
    assert [s.name for s in specs] == ["root", *expected]
    groups = slot_units(plain, [n for n, _ in plain.named_parameters()], policy)
    assert list(groups) == [s.name for s in specs if s.slots]  # the loader streams in the engine's units

    model = copy.deepcopy(plain)
    tightfit.wrap(model, tightfit.Placement.everywhere("nvme", nvme_dir=str(tmp_path)), units=policy)
    x = make_input()
    a, b = _out(model, x), _out(plain, x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    a.square().mean().backward()
    b.square().mean().backward()
    opt, ref = tightfit.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt.step()
    ref.step()
    torch.testing.assert_close(_out(model, x), _out(plain, x), rtol=1e-4, atol=1e-5)


def test_sequential_without_policy_is_one_root_unit():
    specs = find_units(_mlp())
    assert [s.name for s in specs] == ["root"]
