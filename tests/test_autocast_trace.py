"""The planner's trace makes autocast's casts on the meta device (tightfit/planner/autocast_trace.py).

A bf16 step runs under `torch.autocast`, which does nothing on meta tensors: the trace counted none of its casts,
and the first GPU run's default model, bound by the host's launches, ran 33% slower than planned (benchmarks/
RESULTS.md, batch AE). Checked here against the real thing: CPU autocast on real tensors dispatches exactly the
aten ops the meta trace's emulation does (CPU's lists); CUDA's lists, which only a GPU runs for real, are checked
op by op for the dtypes autocast gives (on CPU tensors: the emulation runs on any device).
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from tightfit.models.gpt import GPT, GPTConfig
from tightfit.planner.autocast_trace import MetaAutocast
from tightfit.planner.model_profile import (
    _FusedAttention,
    _hf_meta_compat,
    profile_model,
)


class _OpCounts(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _step_ops(model, device: str, param_dtype: torch.dtype, hf: bool = False, device_type: str = "cpu",
              autocast: bool = True) -> collections.Counter:
    """Aten ops of one forward (under autocast to bf16: real on CPU tensors, emulated on meta with
    `device_type`'s lists) and backward."""
    params = {n: (torch.empty(p.shape, dtype=param_dtype, device="meta") if device == "meta"
                  else p.detach().to(param_dtype)).requires_grad_() for n, p in model.named_parameters()}
    buffers = {n: b.to(device) for n, b in model.named_buffers()}
    ids = torch.zeros(2, 32, dtype=torch.long, device=device)
    counts = _OpCounts()
    emulated = device == "meta"
    with counts:
        with _FusedAttention(device_type == "cuda") if emulated else contextlib.nullcontext(), _hf_meta_compat(), \
                MetaAutocast(torch.bfloat16, device_type) if emulated and autocast else \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if hf:
                loss = functional_call(model, {**params, **buffers}, (ids,), {"labels": ids}).loss
            else:
                loss = functional_call(model, {**params, **buffers}, (ids, ids))
        loss.backward()
    return counts.counts


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128))


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_the_emulated_autocast_dispatches_what_cpu_autocast_does(param_dtype):
    # fp32 parameters: autocast casts every weight down (once per forward) and the loss's logits up; bf16 ones (the
    # engine's compute copies): only the loss's.
    real, emulated = _step_ops(_gpt(), "cpu", param_dtype), _step_ops(_gpt(), "meta", param_dtype)
    assert emulated == real
    assert real["aten._to_copy"] > 0


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_emulated_autocast_casts_hugging_face_models_as_cpu_autocast_does(arch):
    T = pytest.importorskip("transformers")
    config = {"llama": lambda: T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                             use_cache=False),
              "gpt2": lambda: T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                           use_cache=False, bos_token_id=0, eos_token_id=0)}[arch]()
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config)
    real, emulated = _step_ops(model, "cpu", torch.float32, hf=True), _step_ops(model, "meta", torch.float32, hf=True)
    # The casts agree; other ops differ where the meta trace stands in for data-dependent code (the packed-sequence
    # check of `_hf_meta_compat`), which is not autocast's.
    assert emulated["aten._to_copy"] == real["aten._to_copy"] > 0


def test_the_planners_profile_makes_the_casts_of_a_bf16_step():
    # The profile's parameters are the compute copies (bf16): CUDA's autocast casts each layer norm's input,
    # weight and bias up and the next linear's input down, and backward casts each of their gradients back.
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128))

    def ops(profile) -> int:
        return sum(u.fwd.n_ops + u.bwd.n_ops for u in profile.units)

    casts = (_step_ops(model, "meta", torch.bfloat16, device_type="cuda")["aten._to_copy"]
             - _step_ops(model, "meta", torch.bfloat16, device_type="cuda", autocast=False)["aten._to_copy"])
    assert casts >= 2 * 5 * 2  # at least each of the 5 layer norms' input up and its output down, and back
    autocast = profile_model(model, 2, 32, "bf16", cuda=True)  # the default for a bf16 step: under autocast
    plain = profile_model(model, 2, 32, "bf16", cuda=True, autocast=False)
    # The profile hands backward's ops to the units by their FLOPs, rounding each unit's share.
    assert abs(ops(autocast) - ops(plain) - casts) <= len(plain.units)
    assert ops(profile_model(model, 2, 32, "fp32", cuda=True)) == ops(profile_model(model, 2, 32, "fp32", cuda=True,
                                                                                      autocast=False))


def test_cudas_lists_give_autocasts_dtypes():
    x16 = torch.randn(4, 8, dtype=torch.bfloat16)
    w32 = torch.randn(6, 8, requires_grad=True)
    with MetaAutocast(torch.bfloat16, "cuda"):
        assert F.linear(x16.float(), w32).dtype == torch.bfloat16  # down: matmuls
        assert F.layer_norm(x16, (8,)).dtype == torch.float32  # up: norms (CUDA's list; not CPU's)
        assert torch.rsqrt(x16.abs() + 1).dtype == torch.float32
        assert x16.sum().dtype == torch.float32  # told fp32: reductions and softmax
        assert x16.softmax(-1).dtype == torch.float32
        assert x16.softmax(-1, dtype=torch.bfloat16).dtype == torch.bfloat16  # a dtype given is kept
        assert (x16 + 1).dtype == torch.bfloat16  # not on a list: as given
    with MetaAutocast(torch.bfloat16, "cpu"):
        assert F.layer_norm(x16, (8,)).dtype == torch.bfloat16


def test_cudas_cross_entropy_is_log_softmax_in_fp32_then_nll():
    torch.manual_seed(0)
    logits = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 32, (16,))
    target[3] = -100
    counts = _OpCounts()
    with counts, MetaAutocast(torch.bfloat16, "cuda"):
        loss = F.cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target), rtol=0, atol=0)
    assert counts.counts["aten._to_copy"] <= 1  # no fp32 copy of the logits kept beside log_softmax's output
    assert counts.counts["aten._log_softmax"] == 1


def test_a_weight_used_twice_is_cast_once_per_forward():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(2, 8)
    counts = _OpCounts()
    with counts, MetaAutocast(torch.bfloat16, "cuda"):
        F.linear(F.linear(x, w), w)
    assert counts.counts["aten._to_copy"] == 2  # the input once, the weight once (autocast's weight cache)


def test_a_loop_without_autocast_is_planned_without_its_casts():
    import tightfit

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=4, block_size=32, vocab_size=128))
    under = tightfit.plan(model, micro_batch=2, seq_len=32, precision="bf16", hardware="h200")
    as_given = tightfit.plan(model, micro_batch=2, seq_len=32, precision="bf16", hardware="h200", autocast=False)
    assert sum(u.fwd.n_ops for u in under.profile.units) > sum(u.fwd.n_ops for u in as_given.profile.units)
    assert under.profile.act_peak > as_given.profile.act_peak  # the layer norms' fp32 inputs, saved
    assert under.profile.autocast and not as_given.profile.autocast
    assert "compute bf16 under autocast," in under.table() and "compute bf16," in as_given.table()
