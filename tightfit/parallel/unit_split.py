"""Which ZeRO-3 units keep their shards on the GPU and which send them to host memory: `split_units`.

[Note: shards kept on the GPU, unit by unit] FSDP2's CPU offload is a policy of each `fully_shard` call, so of each
unit (a block, the root), not of the model: torch applies it to the units it is given and no other. Sending every
unit's states to the host because the whole model's do not fit the GPU (all or nothing, pytorch#120256) moves more
than it must: each offloaded unit's fp32 shard crosses the link at each all-gather (forward, and a block's again
in backward), its gradient comes back, and the host's cores step it. Here, where ZeRO-3's shards do not fit a GPU
with `--offload auto`, the units keep their shards, gradients and AdamW moments on the GPU (16 bytes a parameter of
the rank's shard) while they fit `KEPT_SHARE` of its memory beside what every rank needs whatever the split (the
gathered blocks and the activations, costs.memory_per_gpu; with every block recomputed unless `--checkpointing
off`); the others are offloaded (`apply_zero(..., kept=...)`), their moments in host memory or,
with `--nvme`, past the rank's host room in its swap folder (shard_states.py). The blocks are kept first, in
forward order, and the root last: an offloaded block crosses the link twice a step (its forward's all-gather and
its backward's), the root once (FSDP2 keeps it gathered from forward to backward). A kept unit is stepped on the
GPU by `ShardStatesAdamW.step()`; an offloaded one on the host's cores, under the next forward.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch.nn as nn

from tightfit.parallel.costs import ModelProfile, memory_per_gpu
from tightfit.parallel.data_parallel import repeated_blocks, unit_name
from tightfit.parallel.plan import ParallelPlan
from tightfit.utils.sizes import format_size

KEPT_SHARE = 0.9
"""The share of a GPU's memory the kept units and what every rank needs may fill together: the rest is for what
`memory_per_gpu` leaves out (the CUDA context, the allocator's rounding, FSDP2's copy-in buffers of the offloaded
units' shards)."""
KEPT_BYTES = 16
"""Device bytes a kept unit's parameter costs on its rank: the fp32 shard (FSDP2's master under mixed precision), its
fp32 gradient and AdamW's two fp32 moments."""


def zero3_units(model: nn.Module, dp: int) -> list[tuple[str, int]]:
    """(unit name, elements of one rank's shard) of each unit `apply_zero` makes of `model` over `dp` ranks, the
    blocks in forward order and the root (what no block holds) last. A rank's shard of a parameter is its dim-0
    chunk, padded as FSDP2 pads it (ceil(rows / dp) rows)."""
    def shard(p: nn.Parameter) -> int:
        if p.dim() == 0:
            return 1
        return math.ceil(p.shape[0] / dp) * (p.numel() // max(1, p.shape[0]))

    names = {id(m): n for n, m in model.named_modules()}
    blocks = repeated_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [(unit_name(names[id(b)]), sum(shard(p) for p in b.parameters() if p.requires_grad)) for b in blocks]
    units.append(("root", sum(shard(p) for p in model.parameters() if p.requires_grad and id(p) not in in_blocks)))
    return [u for u in units if u[1]]


HOST_LINK_BW = 25e9
"""Bytes a second each way between a GPU and host memory, assumed for a what-if: PCIe 4.0 x16 (an H200's measured
55 GB/s, benchmarks/RESULTS.md batch AP, is PCIe 5.0's)."""


def host_link_bytes(units: list[tuple[str, int]], kept: frozenset[str], micro_batches: int) -> tuple[int, int]:
    """(up, down) bytes a step between each GPU and its host for the offloaded units (those not in `kept`): FSDP2
    copies an offloaded unit's fp32 shard to the GPU for each all-gather — a block's twice a micro-batch (forward,
    and backward after resharding), the root's once (kept gathered from forward to backward) — and each micro-batch's
    reduce-scattered fp32 gradient shard back (parallelize.py reduces every micro-batch under ZeRO-3)."""
    off = [(name, n) for name, n in units if name not in kept]
    up = 4 * micro_batches * sum((1 if name == "root" else 2) * n for name, n in off)
    return up, 4 * micro_batches * sum(n for _, n in off)


def split_units(plan: ParallelPlan, model: nn.Module, prof: ModelProfile, gpu_mem: int | None,
                checkpointed: bool) -> tuple[ParallelPlan, str | None]:
    """`--strategy zero3` with `--offload auto`: where ZeRO-3's shards do not fit a GPU of `gpu_mem` bytes (None: no
    budget, nothing to decide), the units kept on it and the rest offloaded ([Note: shards kept on the GPU, unit by
    unit]), with the activations of `prof` recomputed or not (`checkpointed`, as the run will). Returns the plan and
    the line that says what was chosen (None: nothing changed)."""
    if (gpu_mem is None or plan.dp_mode != "zero3" or plan.cpu_offload or plan.engine or plan.dims.pp > 1
            or plan.dims.tp > 1):
        return plan, None
    prof = replace(prof, checkpointed=checkpointed)
    need = memory_per_gpu(plan, prof)["total"]
    if need <= gpu_mem:
        return plan, None
    offloaded = replace(plan, cpu_offload=True)
    room = int(KEPT_SHARE * gpu_mem) - memory_per_gpu(offloaded, prof)["total"]
    units = zero3_units(model, plan.dims.dp)
    kept = []
    for name, n in units:
        if KEPT_BYTES * n <= room:
            kept.append((name, n))
            room -= KEPT_BYTES * n
    split = replace(offloaded, kept_on_device=tuple(kept))
    on_gpu = (f"{len(kept)} of {len(units)} units keep theirs on the GPU "
              f"({format_size(KEPT_BYTES * sum(n for _, n in kept))}: shards, gradients and AdamW moments, stepped "
              f"there), the other {len(units) - len(kept)}'s go" if kept else "every unit's go")
    return split, (f"ZeRO-3's shards need {format_size(need)} per GPU against {format_size(gpu_mem)}: {on_gpu} to host "
                   "memory (FSDP2's CPU offload for those units; their AdamW moments in host memory, or with --nvme "
                   "past each rank's host room in its swap folder, each unit stepped under the next forward)")


def split_offload(plan: ParallelPlan, model: nn.Module, prof: ModelProfile, gpu_mem: int | None,
                  checkpointed: bool) -> tuple[ParallelPlan, str | None]:
    """`--strategy auto`'s FSDP2 CPU offload of the whole model (auto.RULE_NODE_ZERO) split as an explicit
    `--strategy zero3`'s is: the units that fit stay on the GPU, or none is offloaded where recomputing every block's
    activations is enough. Other plans are returned as they are."""
    if not plan.cpu_offload or plan.kept_on_device or plan.dims.pp > 1 or plan.dims.tp > 1:
        return plan, None
    return split_units(replace(plan, cpu_offload=False), model, prof, gpu_mem, checkpointed)
