"""tiled_cross_entropy / TiledLMHeadLoss against head + F.cross_entropy on the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tightfit.errors import UsageError
from tightfit.tiling import TiledLMHeadLoss, tiled_cross_entropy


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(n=37, c=16, v=50, seed=0, ignore_frac=0.0, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g)
    w = torch.randn(v, c, generator=g) * 0.3
    b = torch.randn(v, generator=g) * 0.1 if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    if ignore_frac:
        t[torch.rand(n, generator=g) < ignore_frac] = -100
    return h, w, b, t


def _grads(fn, h, w, b, t, grad_out=None):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    loss = fn(h, w, b, t)
    loss.backward(grad_out)
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [1, 5, 37, 1000])
@pytest.mark.parametrize("ignore_frac,bias", [(0.0, False), (0.3, True)])
def test_matches_full_logits(reduction, chunk_size, ignore_frac, bias):
    h, w, b, t = _inputs(ignore_frac=ignore_frac, bias=bias)
    grad_out = torch.randn(h.shape[0]) if reduction == "none" else None

    def ref(h, w, b, t):
        return F.cross_entropy(F.linear(h, w, b).float(), t, ignore_index=-100, reduction=reduction)

    def tiled(h, w, b, t):
        return tiled_cross_entropy(h, w, t, b, chunk_size=chunk_size, reduction=reduction)

    out_ref, out = _grads(ref, h, w, b, t, grad_out), _grads(tiled, h, w, b, t, grad_out)
    assert rel(out[0], out_ref[0]) < 1e-6
    for g, g_ref in zip(out[1:], out_ref[1:]):
        if g_ref is not None:
            assert rel(g, g_ref) < 1e-5


def test_all_ignored_is_nan_like_pytorch():
    h, w, _, t = _inputs()
    t[:] = -100
    assert torch.isnan(tiled_cross_entropy(h, w, t)) and torch.isnan(F.cross_entropy(h @ w.t(), t))
    assert tiled_cross_entropy(h, w, t, reduction="sum").item() == 0.0


def test_module_drop_in_and_autocast():
    torch.manual_seed(0)
    head = nn.Linear(16, 50, bias=False)
    loss_mod = TiledLMHeadLoss.from_linear(head, chunk_size=7)
    assert loss_mod.weight is head.weight  # shared, not copied
    assert list(loss_mod.state_dict()) == list(head.state_dict())
    x = torch.randn(2, 9, 16)  # [B, T, C]
    t = torch.randint(0, 50, (2, 9))
    ref = F.cross_entropy(head(x).float().view(-1, 50), t.view(-1))
    assert rel(loss_mod(x, t), ref) < 1e-6
    assert loss_mod(x).shape == (2, 9, 50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_bf16 = loss_mod(x, t)
        ref_bf16 = F.cross_entropy(head(x).float().view(-1, 50), t.view(-1))
    assert loss_bf16.dtype == torch.float32
    assert abs(loss_bf16.item() - ref_bf16.item()) < 1e-2
    loss_bf16.backward()
    assert head.weight.grad.dtype == torch.float32 and torch.isfinite(head.weight.grad).all()


def test_bf16_weights_without_autocast():
    h, w, _, t = _inputs(n=20, c=16, v=40)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    loss = tiled_cross_entropy(hb, wb, t, chunk_size=3)
    loss.backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    ref = F.cross_entropy((h.bfloat16() @ w.bfloat16().t()).float(), t)
    assert abs(loss.item() - ref.item()) < 1e-3


def test_bad_input():
    h, w, _, t = _inputs()
    with pytest.raises(UsageError):
        tiled_cross_entropy(h, w[:, :3], t)
    with pytest.raises(UsageError):
        tiled_cross_entropy(h, w, t[:3])
    with pytest.raises(UsageError):
        tiled_cross_entropy(h, w, t, reduction="avg")
    with pytest.raises(UsageError):
        tiled_cross_entropy(h, w, t, chunk_size=0)
