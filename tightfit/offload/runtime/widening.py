"""Adding a narrower float tensor into a wider one on the CPU (a bf16 gradient pack into its fp32 sum) at memory speed.

Why: torch's mixed-dtype `fp32.add_(bf16)` on a CPU falls off a cliff once its operands outgrow the last-level
cache: on the 2-core VM (32 MiB L3) it runs at 47-69 GB/s up to 6 M elements and at 7.4-7.8 GB/s from 8 M on, where
converting the same tensor (`copy_`) runs at 38 and an fp32 add at memory speed (benchmarks/RESULTS.md, batch V).
The gradient worker makes this add for every micro-batch after a step's first, over every parameter whose gradients
live in host memory or on disk, and the parameters of the models offloaded from a GPU are past the cliff (a 1.2 B
GPT's MLP weights: 16.8 M elements; Llama-2-7B's: 45 M). Converting a chunk into a small fp32 scratch that stays in
cache and adding that gives the same bits (every bf16 and fp16 value is an fp32 value, so the conversion is exact,
and the add rounds once, as the mixed add does) at memory speed: 6.3 against 43 ms over 32 M elements.

The scratch is one per thread that adds (the gradient worker; the thread running backward on a CPU device whose
gradients add in place), `CHUNK` elements of the wider dtype, made at its first use and kept for the process:
4 MiB, which no budget counts.
"""

from __future__ import annotations

import threading

import torch

CHUNK = 1 << 20
"""Elements converted at a time: a chunk of 4 MiB fp32 ran at 52 GB/s on the VM, one of 256 KiB at 40, of 64 KiB
at 31 (per-chunk dispatch)."""

_local = threading.local()


def add_widening(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst += src`, bit for bit as `dst.add_(src)`; `src` of a narrower float dtype is converted a chunk at a time.
    Both contiguous and of one shape (views of flat buffers, as the engine's are)."""
    if src.dtype == dst.dtype or dst.device.type != "cpu" or src.device.type != "cpu":
        dst.add_(src)
        return
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.dtype != dst.dtype:
        scratch = _local.scratch = torch.empty(CHUNK, dtype=dst.dtype)
    d, s = dst.view(-1), src.view(-1)
    for start in range(0, d.numel(), CHUNK):
        n = min(CHUNK, d.numel() - start)
        part = scratch[:n]
        part.copy_(s[start:start + n])
        d[start:start + n].add_(part)
