"""The offload engine on a GPU (issue 3, acceptance 6): the fidelity tests of test_offload_fidelity.py on CUDA, and
what only a GPU has (pinned staging, device memory that is really device memory).

Marked `cuda` and left out of `make test` (the CI machine has no GPU); `make test-gpu` runs them, and fails rather
than skips where there is no GPU, so a run that claims them cannot pass without one. Plain PyTorch runs on the same
GPU with the same seed and data, and `torch.optim.AdamW(fused=True)`. With every state on the device tier the
engine steps with the same CUDA kernel over views of its flat buffers, so the losses must be bitwise equal. With
states on host or NVMe the step runs on the CPU (torch's fused CPU AdamW): the same formula from another kernel,
held to the CPU tests' bar against torch's foreach AdamW, a max relative difference of 1e-6 over 10 steps.
"""

from __future__ import annotations

import os

import pytest
import torch

from offload_helpers import hf_gpt2, hf_llama, max_rel_diff, tiny_gpt, train
from tightfit import Placement, Tier, UnitPlacement
from tightfit.models.gpt import GPT, GPTConfig
from tightfit.offload.engine import engine_of

pytestmark = pytest.mark.cuda

MODELS = {"gpt": tiny_gpt, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama}


@pytest.fixture(autouse=True)
def deterministic_cuda():
    """Both sides must run the same kernels the same way: no TF32, deterministic algorithms (cuBLAS needs its
    workspace setting before its first use)."""
    assert torch.cuda.is_available(), "these tests need a CUDA GPU (make test-gpu); this machine has none"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def placements(tmp_path) -> dict[str, Placement]:
    mixed_unit = UnitPlacement(params=Tier.NVME, master=Tier.HOST, grads=Tier.DEVICE, optim=Tier.NVME)
    return {
        "device": Placement.everywhere(Tier.DEVICE),
        "host": Placement.everywhere(Tier.HOST),
        "nvme": Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap")),
        "mixed": Placement(default=mixed_unit, units={"root": UnitPlacement.all_on(Tier.HOST)},
                           nvme_dir=str(tmp_path / "swap")),
    }


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("where", ["device", "host", "nvme", "mixed"])
def test_losses_match_plain_pytorch_on_cuda(model, where, tmp_path):
    ref = train(MODELS[model], device="cuda")[0]
    losses, wrapped, _ = train(MODELS[model], placements(tmp_path)[where], device="cuda")
    if where == "device":
        assert losses == ref, "the same CUDA fused AdamW over views: bitwise equal"
    assert max_rel_diff(losses, ref) <= 1e-6
    engine = engine_of(wrapped)
    assert engine.device.type == "cuda" and all(p.device.type == "cuda" for p in wrapped.parameters())
    engine.close()


def test_step_during_backward_on_cuda_is_the_plain_step(tmp_path):
    """The step thread's per-unit steps (CPU, overlapping backward) give the bits the step after backward gives."""
    after = train(tiny_gpt, placements(tmp_path)["nvme"], device="cuda")[0]
    during = train(tiny_gpt, placements(tmp_path)["nvme"], device="cuda", early=True)[0]
    assert during == after
    assert max_rel_diff(during, train(tiny_gpt, device="cuda")[0]) <= 1e-6


def test_accumulation_clipping_and_bf16_on_cuda(tmp_path):
    kw = dict(accum=2, clip=0.05, device="cuda")
    assert max_rel_diff(train(tiny_gpt, placements(tmp_path)["nvme"], **kw)[0], train(tiny_gpt, **kw)[0]) <= 1e-6
    bf16 = train(tiny_gpt, placements(tmp_path)["nvme"], compute_dtype=torch.bfloat16, device="cuda")[0]
    assert max_rel_diff(bf16, train(tiny_gpt, device="cuda")[0]) <= 1e-2


def test_staging_is_pinned_and_the_device_budget_is_real_memory(tmp_path):
    """With every state off the GPU and a device budget, the CUDA allocator's peak during training stays far below
    plain PyTorch's, which holds parameters, gradients and both moments on the GPU."""
    def build():
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=256))

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    train(build, steps=3, device="cuda")
    plain_peak = torch.cuda.max_memory_allocated() - base

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    probe = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=4, n_embd=256))
    block = sum(p.numel() for p in probe.blocks[0].parameters()) * 4
    root = sum(p.numel() for n, p in probe.named_parameters() if not n.startswith("blocks.")) * 4
    budget = 2 * root + 6 * block
    placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"), device_budget=budget,
                                     prefetch_depth=2)
    losses, model, _ = train(build, placement, steps=3, device="cuda", early=True)
    offload_peak = torch.cuda.max_memory_allocated() - base
    engine = engine_of(model)
    assert engine.device_peak <= budget
    assert offload_peak < 0.5 * plain_peak, (offload_peak, plain_peak)
    assert engine.pool.pin
    buf = engine.pool.take(1024, torch.float32)
    assert buf.is_pinned()
    engine.pool.give(buf)
    assert max_rel_diff(losses, train(build, steps=3, device="cuda")[0]) <= 1e-6
    engine.close()
