"""Tiled LM head + cross-entropy: the loss of `hidden @ weight.T` without ever holding the [tokens x vocab] logits.

Why: with a 128k vocabulary the logits dominate activation memory. For 8k tokens they are 8192 x 131072 x 4 B =
4 GiB in fp32, and `head + F.cross_entropy` keeps them (and the softmax gradient of the same size) alive from the
forward to the backward. Here the tokens are cut into chunks of `chunk_size`; each chunk's logits [n_c, V] exist
only while that chunk is processed:

    forward,  per chunk:  z = h_c @ W^T (+ b)        [n_c, V]   computed, reduced, freed
                          lse_c = logsumexp(z)       [n_c]      kept for backward (fp32, 4 B per token)
                          loss += lse_c - z[t]                  (ignored targets contribute 0)
    backward, per chunk:  z recomputed               [n_c, V]
                          dz = (softmax(z) - onehot(t)) * dloss / n_valid     (in place in z's buffer)
                          dh_c = dz @ W              [n_c, C]
                          dW  += dz^T @ h_c          [V, C]     fp32 accumulator across chunks (see below)

Cost: the head's matmul runs twice (forward and the recompute in backward), i.e. 3 matmuls of the head become 4;
peak loss memory falls from ~2-3 [N, V] fp32 tensors to a few [n_c, V] ones.

Memory kept across forward -> backward: hidden and weight (which autograd keeps for a plain head too), targets, and
lse [N] fp32. dW is accumulated in fp32 over the chunks ([V, C] fp32, the size of an fp32 weight gradient) and cast to
the weight's dtype at the end, so a bf16 head does not lose low bits over many chunks.

Semantics follow `F.cross_entropy(logits.float(), targets, ignore_index, reduction)`: logits are reduced in fp32,
`ignore_index` targets contribute neither loss nor gradient, "mean" divides by the number of non-ignored targets
(NaN when there are none, like PyTorch). Under autocast the matmuls run in the autocast dtype, as a head would.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tightfit.errors import UsageError

DEFAULT_CHUNK_BYTES = 64 * 1024**2
"""Default size of one chunk's fp32 logits: chunk_size = DEFAULT_CHUNK_BYTES // (4 * vocab), at least 1."""

_REDUCTIONS = ("mean", "sum", "none")


def default_chunk_size(vocab: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about DEFAULT_CHUNK_BYTES."""
    return max(1, DEFAULT_CHUNK_BYTES // (4 * vocab))


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a head matmul on `t`'s device runs in: the autocast dtype when autocast is on there, else t's."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _chunk_logits(h_c: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits [n_c, V] of one chunk; h_c [n_c, C] and w [V, C] already in the compute dtype."""
    z = h_c @ w.t()  # [n_c, V] compute dtype
    if b is not None:
        z = z + b
    return z.float()  # no copy when the compute dtype is fp32


class _TiledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, ignore_index, reduction):
        dtype = _compute_dtype(hidden)
        # Autocast is switched off inside and the casts are done by hand, so forward and the backward recompute run
        # in the same dtype whatever autocast state the backward happens to run under.
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            n = h.shape[0]
            valid = targets != ignore_index  # [N] bool
            safe_t = torch.where(valid, targets, 0)  # [N] ignored rows gather column 0, then get masked
            lse = torch.empty(n, dtype=torch.float32, device=h.device)  # [N] kept for backward
            losses = torch.empty(n, dtype=torch.float32, device=h.device)  # [N]
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                z = _chunk_logits(h[s:e], w, b)  # [n_c, V] fp32; freed at the next iteration
                lse[s:e] = torch.logsumexp(z, dim=-1)
                losses[s:e] = lse[s:e] - z.gather(1, safe_t[s:e, None]).squeeze(1)
                del z
            losses = torch.where(valid, losses, 0.0)
            n_valid = valid.sum()
        ctx.save_for_backward(hidden, weight, bias, safe_t, valid, lse, n_valid)
        ctx.dtype, ctx.chunk_size, ctx.reduction = dtype, chunk_size, reduction
        if reduction == "none":
            return losses  # [N] fp32
        total = losses.sum()
        return total / n_valid if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, safe_t, valid, lse, n_valid = ctx.saved_tensors
        dtype, chunk_size = ctx.dtype, ctx.chunk_size
        # Per-token weight of dloss/dlogits [N] fp32: 0 for ignored tokens.
        if ctx.reduction == "none":
            scale = grad_out.float()
        elif ctx.reduction == "mean":
            scale = (grad_out.float() / n_valid).expand(hidden.shape[0])
        else:
            scale = grad_out.float().expand(hidden.shape[0])
        scale = torch.where(valid, scale, 0.0)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            dh = torch.empty_like(h) if need_h else None  # [N, C] compute dtype
            dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None  # [V, C]
            db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None  # [V]
            rows = torch.arange(min(chunk_size, h.shape[0]), device=h.device)
            for s in range(0, h.shape[0], chunk_size):
                e = min(s + chunk_size, h.shape[0])
                z = _chunk_logits(h[s:e], w, b)  # [n_c, V] fp32, recomputed
                # softmax - onehot, scaled, all in z's buffer: no second [n_c, V] tensor.
                z.sub_(lse[s:e, None]).exp_()
                z[rows[: e - s], safe_t[s:e]] -= 1.0
                z.mul_(scale[s:e, None])
                dz = z.to(dtype)  # [n_c, V] compute dtype (no copy in fp32)
                if need_h:
                    dh[s:e] = dz @ w  # [n_c, C]
                if need_w:
                    # From the fp32 z (== dz in fp32) into the fp32 accumulator; h_c.float() is only [n_c, C].
                    dw.addmm_(z.t(), h[s:e].float())
                if need_b:
                    db += z.sum(0)
                del z, dz
        grad_h = dh.to(hidden.dtype) if need_h else None
        grad_w = dw.to(weight.dtype) if need_w else None
        grad_b = db.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def tiled_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, ...)` without the full logits.

    hidden [N, C], weight [V, C], bias [V] or None, targets [N] int64 (values in [0, V) or `ignore_index`).
    `chunk_size`: tokens per chunk (default: about 64 MiB of fp32 logits per chunk). Returns a scalar, or [N]
    for reduction="none".
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise UsageError(f"tiled_cross_entropy: need hidden [N, C] and weight [V, C], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise UsageError(f"tiled_cross_entropy: targets must be [N={hidden.shape[0]}], got {tuple(targets.shape)}")
    if reduction not in _REDUCTIONS:
        raise UsageError(f"tiled_cross_entropy: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    chunk_size = default_chunk_size(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise UsageError(f"tiled_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    return _TiledCrossEntropy.apply(hidden, weight, bias, targets, chunk_size, ignore_index, reduction)


class TiledLMHeadLoss(nn.Module):
    """Drop-in for `head = nn.Linear(C, V, bias)` followed by `F.cross_entropy`, without the [N, V] logits.

    Parameters are `weight` [V, C] and `bias` [V] like the Linear, so the head's checkpoint keys load unchanged;
    `from_linear(head)` shares the head's parameters (tied embeddings stay tied).

    forward(hidden [..., C], targets [...]) -> loss; forward(hidden) without targets -> full logits [..., V]
    (for generation, where the logits are wanted).
    """

    def __init__(self, in_features: int, vocab_size: int, bias: bool = False, chunk_size: int | None = None,
                 ignore_index: int = -100, reduction: str = "mean", device=None, dtype=None) -> None:
        super().__init__()
        ref = nn.Linear(in_features, vocab_size, bias=bias, device=device, dtype=dtype)  # nn.Linear's init
        self.in_features, self.vocab_size = in_features, vocab_size
        self.weight = ref.weight
        self.bias = ref.bias
        self.chunk_size, self.ignore_index, self.reduction = chunk_size, ignore_index, reduction

    @classmethod
    def from_linear(cls, head: nn.Linear, **kwargs) -> "TiledLMHeadLoss":
        """A loss module using `head`'s own parameters (shared, not copied)."""
        mod = cls(head.in_features, head.out_features, bias=head.bias is not None, device="meta", **kwargs)
        mod.weight = head.weight
        mod.bias = head.bias
        return mod

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return nn.functional.linear(hidden, self.weight, self.bias)  # [..., V]
        # [..., C] -> [N, C]; targets [...] -> [N]
        return tiled_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.weight, targets.reshape(-1), self.bias,
            chunk_size=self.chunk_size, ignore_index=self.ignore_index, reduction=self.reduction,
        )

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, vocab_size={self.vocab_size}, bias={self.bias is not None}, "
                f"chunk_size={self.chunk_size}")
