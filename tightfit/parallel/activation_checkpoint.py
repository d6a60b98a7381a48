"""Activation checkpointing of every block under the scale-out strategies (`--checkpointing on|auto`).

Why: under DDP, FSDP2, TP and PP each rank keeps every block's activations of its micro-batch until backward, which
for long sequences outgrows the states (a Llama-2-70B on 8 GPUs at 4096 tokens: 485 GiB of activations a GPU
against 16 GiB of weights, docs/PARALLEL.md). Recomputing each block's forward in its backward keeps only the blocks'
inputs, as torchtitan's full activation checkpointing does.

How: each block's `forward` (the instance's, so the module, its parameter names and every hook torch or FSDP2
registered on it stay as they are) runs under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. The
parallel wrappers' hooks run around the block's call, outside the checkpoint: FSDP2 gathers the block's shards
before its backward, so the recomputation sees them. The recomputed forward is the same ops on the same values with
the RNG state restored, so gradients, and the run, are the ones without checkpointing, bit for bit.

When: `on` checkpoints every block; `auto` does so where the strategy's estimate of a rank's memory
(costs.memory_per_gpu) exceeds its GPU's and the estimate with checkpointing is smaller; `off` never. A CPU rank
has no GPU memory to fit: `auto` leaves it off.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tightfit.parallel.data_parallel import repeated_blocks


def checkpoint_blocks(module: nn.Module) -> int:
    """Make each of `module`'s repeated blocks recompute its forward in backward; the number of blocks."""
    blocks = repeated_blocks(module)
    for block in blocks:
        block.forward = functools.partial(_recomputed, block.forward)
    return len(blocks)


def _recomputed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def wanted(asked: str, plan, profile, gpu_mem: int | None) -> tuple[bool, str]:
    """(checkpoint every block?, why, for the run's line) for `--checkpointing asked` under `plan`, with `profile`
    (costs.ModelProfile) and a rank's GPU memory (None: a CPU rank)."""
    from dataclasses import replace

    from tightfit.parallel.costs import memory_per_gpu
    from tightfit.utils.sizes import format_size

    if asked == "on":
        return True, "--checkpointing on"
    if asked == "off" or gpu_mem is None:
        return False, ""
    without = memory_per_gpu(plan, profile)["total"]
    with_ = memory_per_gpu(plan, replace(profile, checkpointed=True))["total"]
    if without > gpu_mem and with_ < without:
        return True, (f"--checkpointing auto: a rank needs about {format_size(without)} without it, "
                      f"{format_size(with_)} with it, against {format_size(gpu_mem)} of GPU memory")
    return False, ""


def gpu_memory(cfg, device: torch.device) -> int | None:
    """A rank's GPU memory for `wanted`: --gpu-mem, else the CUDA device's; None on a CPU rank."""
    from tightfit.utils.sizes import parse_size

    if device.type != "cuda":
        return None
    if cfg.memory.gpu_mem:
        return parse_size(cfg.memory.gpu_mem, "--gpu-mem")
    return torch.cuda.get_device_properties(device).total_memory
