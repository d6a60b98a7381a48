"""A unit with frozen parameters on NVMe: its optimizer step moves only the trainable prefix of the params entry
([Note: the frozen tail stays on its tier] in tightfit/offload/step/optimizer.py), counted by the store's byte stats;
the losses stay those of plain PyTorch with the same parameters frozen."""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit.offload.step.engine import engine_of
from tightfit.offload.step.unit import PARAMS
from tightfit.offload.placement import Placement, Tier
from tightfit.optim import AdamW
from offload_helpers import batch, loss_of, one_torch_thread, tiny_gpt, train  # noqa: F401  (autouse fixture)

# The embeddings and every block's matrices frozen: each block keeps trainable biases and norms in front of a
# frozen tail several times larger (the shape of a LoRA fine-tune).
FREEZE = ("tok_emb", "pos_emb") + tuple(f"blocks.{i}.{m}.weight" for i in range(3)
                                        for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                                  "mlp.up", "mlp.down"))


def _wrapped(swap, compute_dtype):
    torch.manual_seed(0)
    model = tiny_gpt()
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith(FREEZE))
    tightfit.wrap(model, Placement.everywhere(Tier.NVME, nvme_dir=str(swap)), compute_dtype=compute_dtype,
                  device="cpu")
    return model, AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _step_io(model, opt, step: int) -> tuple[int, int]:
    """(bytes read, bytes written) on NVMe by optimizer step `step` alone (its write-backs drained)."""
    x, y = batch(step)
    loss_of(model, x, y).backward()
    engine = engine_of(model)
    store = engine.stores[Tier.NVME]
    engine.wait_grads()
    store.wait()  # the backward's gradient writes are not the step's
    before = store.stats()
    opt.step()
    engine.wait_writes()
    store.wait()
    after = store.stats()
    opt.zero_grad()
    return after["bytes_read"] - before["bytes_read"], after["bytes_written"] - before["bytes_written"]


def test_a_separate_master_refreshes_the_params_prefix_without_reading_the_frozen_tail(tmp_path):
    """bf16 compute: the master is the trainable prefix in fp32; the step reads master, gradients and moments
    (16 B per trainable element from the second step on) and writes master, moments and the bf16 prefix of the
    params. Before, it read the unit's whole bf16 params entry (frozen tail included) and wrote it whole."""
    model, opt = _wrapped(tmp_path / "swap", torch.bfloat16)
    units = [u for u in engine_of(model).units.values() if u.trainable]
    assert all(u.spec.train_numel < u.spec.numel for u in units)
    assert sum(u.spec.numel for u in units) > 5 * sum(u.spec.train_numel for u in units)
    _step_io(model, opt, 0)  # the first step reads no moments (they start at zero)
    read, written = _step_io(model, opt, 1)
    trainable = sum(u.spec.train_numel for u in units)
    assert read == 16 * trainable  # master, gradients, two moments: fp32 each
    assert written == 12 * trainable + 2 * trainable  # master and moments, and the bf16 prefix of the params
    engine_of(model).close()


def test_fp32_params_that_are_the_master_move_only_their_prefix(tmp_path):
    """fp32 compute: the params entry is the master. A unit whose stepped params are not kept for the next forward
    reads only their trainable prefix; every unit writes only that prefix back. The units fetched last in forward
    (the root, and those that stay materialised for backward) read no master at all: their forward fetch's staging
    buffer is it ([Note: master from the fetch])."""
    model, opt = _wrapped(tmp_path / "swap", torch.float32)
    engine = engine_of(model)
    units = [u for u in engine.units.values() if u.trainable]
    _step_io(model, opt, 0)
    from_fetch = {"root", *engine.scheduler.first("backward")}
    read, written = _step_io(model, opt, 1)
    kept = [u for u in units if engine.cache.holds(u.name, PARAMS, u.version)]  # read whole for the next forward
    assert len(kept) < len(units)  # some unit read its prefix only
    trainable = sum(u.spec.train_numel for u in units)
    master = sum(0 if u.name in from_fetch else u.spec.numel if u in kept else u.spec.train_numel for u in units)
    assert from_fetch < {u.name for u in units} and read == 12 * trainable + 4 * master
    assert written == 12 * trainable
    engine.close()


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_losses_are_plain_pytorchs_with_the_same_parameters_frozen(tmp_path, compute_dtype):
    """The frozen tail on disk stays what wrap wrote; losses equal plain PyTorch's (fp32) or the device tier's
    with the same compute dtype (bf16, where plain PyTorch rounds differently), step by step."""
    nvme = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"))
    ours, model, _ = train(tiny_gpt, nvme, steps=4, freeze=FREEZE, compute_dtype=compute_dtype)
    if compute_dtype == torch.float32:
        ref = train(tiny_gpt, None, steps=4, freeze=FREEZE)[0]
    else:
        ref = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), steps=4, freeze=FREEZE,
                    compute_dtype=compute_dtype)[0]
    assert ours == ref
    engine_of(model).close()
