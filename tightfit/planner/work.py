"""What one op costs, in terms of no machine: the vocabulary the meta trace (`model_profile.py`) counts a model's
work in and the step-time model (`costs.py`) prices with the probe's rates.

Why apart from the trace: the keys an op's work is filed under (a matmul's rate key, attention's problem size, an
elementwise op's name) must be the ones the probe measures under (`probe.py`), and both sides read them here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.utils.flop_counter import flop_registry


@dataclass
class Work:
    """Work of one phase of one unit, in hardware-independent terms."""

    gemm_flops: dict[int, float] = field(default_factory=dict)
    """Matmul FLOPs, keyed by the rate's key ([Note: matmul rate by the smallest side])."""
    mem_bytes: float = 0.0
    """Bytes read + written by the other ops (norms, adds, copies): memory-bound work."""
    n_ops: int = 0
    """aten ops dispatched (views excluded): each costs a fixed dispatch overhead."""
    attn_flops: dict[int, float] = field(default_factory=dict)
    """FLOPs of fused attention kernels, keyed by problem size (cube root of t_q*d*t_k, a power of two): priced at
    the attention rate the probe measured, not the matmul rate ([Note: attention's own rate])."""
    timed_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes read + written by the elementwise ops the probe times one by one (`TIMED_OPS`), by aten op: priced at
    that op's own rate where it is slower than memory ([Note: ops slower than their bytes])."""

    def add(self, other: "Work", scale: float = 1.0) -> None:
        for mine, theirs in ((self.gemm_flops, other.gemm_flops), (self.attn_flops, other.attn_flops),
                             (self.timed_bytes, other.timed_bytes)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0.0) + v * scale
        self.mem_bytes += other.mem_bytes * scale
        self.n_ops += int(round(other.n_ops * scale))

    def scaled(self, scale: float) -> "Work":
        w = Work()
        w.add(self, scale)
        return w

    def scaled_data(self, f: float) -> "Work":
        """This work at `f` times the tokens: FLOPs and bytes scale, the op count does not."""
        w = self.scaled(f)
        w.n_ops = self.n_ops
        return w

    @property
    def flops(self) -> float:
        return sum(self.gemm_flops.values()) + sum(self.attn_flops.values())

    @classmethod
    def from_dict(cls, d: dict) -> "Work":
        """(A plan file written before attention and the timed ops were priced apart has neither: their FLOPs
        are in `gemm_flops`, their bytes in `mem_bytes`.)"""
        return cls({int(k): v for k, v in d["gemm_flops"].items()}, d["mem_bytes"], d["n_ops"],
                   {int(k): v for k, v in d.get("attn_flops", {}).items()}, dict(d.get("timed_bytes", {})))


# [Note: attention's own rate] A fused attention kernel (flash attention: per tile of queries, a product with the
# keys, a softmax and a product with the values; under a causal mask the tiles above the diagonal skipped) does not
# run at the rate of a matmul of its size: on a 2-core CPU VM it reached 60 GFLOP/s at 128 tokens and head dim 32,
# where a matmul of that size reaches 110, and was 13.5 of the default run's 84 ms, priced at 8.2. So the trace keeps
# attention's FLOPs apart (`Work.attn_flops`, by problem size), the probe times the kernel itself, forward and
# backward at three sizes (`measure_attention` in probe.py), and a profile without that figure (a named GPU, a file
# written by hand, a plan from an older probe) prices them at the matmul rate as before.
_ATTN_OPS = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"}


# [Note: matmul rate by the smallest side] A matmul whose operands stream from memory runs at a rate set by its
# smallest side, not by its volume: at 128 tokens a projection (128 x 2048) @ (2048 x 5632) has the volume of a
# 1139^3 matmul and runs at about half its rate (its weight gradient, (5632 x 128) @ (128 x 2048), is as thin;
# measured in benchmarks/RESULTS.md, batch L). So the probe measures, per smallest side s, the three matmuls a
# 2048 -> 5632 linear layer runs in training with s tokens (forward, input gradient, weight gradient into new
# memory), and a matmul's FLOPs are priced at the rate of its smallest side. A matmul whose operands all fit in
# cache (under 8 MiB, e.g. the default run's (2048 x 128) @ (128 x 512)) runs at its volume's rate and keeps the
# cube-root key, as do attention's products: a fused kernel tiles them over the sequence, and their smallest side
# (the head dim) says little about its speed.


def _bucket(m: float, k: float, n: float) -> int:
    """Problem-size key of a matmul in cache or of attention: cube root of m*k*n as a power of two (16 .. 16384)."""
    size = max(1.0, m * k * n) ** (1 / 3)
    return _pow2(size)


def attention_key(t_q: int, head_dim: int, t_k: int) -> int:
    """The key fused attention's FLOPs are priced by ([Note: attention's own rate])."""
    return _bucket(t_q, head_dim, t_k)


def attention_flops(batch_heads: int, t_q: int, t_k: int, head_dim: int, causal: bool, backward: bool) -> float:
    """FLOPs of fused attention's two products (QK^T and PV; half the tiles under a causal mask); its backward does
    2.5x the forward's (recomputed scores and four gradient products)."""
    return 4.0 * batch_heads * t_q * t_k * head_dim * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)


_IN_CACHE_BYTES = 8 << 20
"""A matmul whose operands are all smaller stays in a processor's caches, where its volume decides its speed."""


def matmul_key(m: float, k: float, n: float, itemsize: int) -> int:
    """Rate key of a matmul ([Note: matmul rate by the smallest side]): its smallest side, as a power of two; the
    cube root of its volume while its operands fit in cache."""
    if max(m * k, k * n, m * n) * itemsize < _IN_CACHE_BYTES:
        return _bucket(m, k, n)
    return _pow2(min(m, k, n))


def _pow2(size: float) -> int:
    return int(2 ** min(14, max(4, round(math.log2(max(1.0, size))))))


# [Note: ops slower than their bytes] Some elementwise ops run far below the memory bandwidth the trace prices the
# rest at, because their arithmetic, not their bytes, bounds them on a CPU: dropout's random mask (`bernoulli_`: 0.9
# GB/s on the 2-core VM, against 47-180 GB/s for a copy: 94 ms of a 460 ms step of a GPT-2 fine-tune with its
# default dropout), tanh (GPT-2's GELU: 7.5 GB/s), exp. The probe times each op of `TIMED_OPS` alone
# (`measure_timed_ops` in probe.py), the trace files their bytes by op (`Work.timed_bytes`), and the plan prices
# each at its own rate where that is slower than memory, at memory bandwidth otherwise (a probe's small tensor runs
# in cache, faster than a model's). Ops a fast kernel serves (GELU's erf form, SiLU, softmax: 30-70 GB/s there) are
# timed too, so a machine where they lag is priced right.
TIMED_OPS = ("bernoulli_", "native_dropout", "native_dropout_backward", "tanh", "tanh_backward", "exp", "sigmoid",
             "sigmoid_backward", "gelu", "gelu_backward", "silu", "silu_backward", "_softmax",
             "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data")
"""Elementwise aten ops priced at their own measured rate ([Note: ops slower than their bytes])."""


def op_bytes(tensors_in: list[torch.Tensor], outs: list[torch.Tensor]) -> int:
    """Bytes an elementwise op reads and writes: its tensor arguments and its outputs, as the trace counts them."""
    return sum(a.numel() * a.element_size() for a in tensors_in + outs)


def count_op(w: Work, func, args, kwargs, out, tensors_in: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """Add one dispatched (non-view) aten op's work to `w`: fused attention's FLOPs by problem size, a matmul's by
    its rate key, a timed elementwise op's bytes by name, any other op's bytes as memory-bound."""
    name = func.overloadpacket.__name__
    if name in _ATTN_OPS:
        backward = "backward" in name
        q = tensors_in[1] if backward else tensors_in[0]
        t_q, d = q.shape[2], q.shape[3]
        t_k = tensors_in[2 if backward else 1].shape[2]
        key = attention_key(t_q, d, t_k)
        w.attn_flops[key] = w.attn_flops.get(key, 0.0) + attention_flops(
            q.shape[0] * q.shape[1], t_q, t_k, d, causal=any(a is True for a in args), backward=backward)
    elif func.overloadpacket in flop_registry or func in flop_registry:
        flops = float(flop_registry[func.overloadpacket](*args, out_val=out, **kwargs))
        mats = [a for a in tensors_in if a.dim() >= 2]
        m = mats[-2].shape[-2] if len(mats) >= 2 else 1
        k_, n = (mats[-1].shape[-2], mats[-1].shape[-1]) if mats else (1, 1)
        key = matmul_key(m, k_, n, out.element_size() if isinstance(out, torch.Tensor) else 4)
        w.gemm_flops[key] = w.gemm_flops.get(key, 0.0) + flops
    elif name in TIMED_OPS:
        w.timed_bytes[name] = w.timed_bytes.get(name, 0.0) + op_bytes(tensors_in, outs)
    else:
        w.mem_bytes += op_bytes(tensors_in, outs)
