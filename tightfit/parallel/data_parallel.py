"""Data parallelism over the mesh's `dp` dimension: `apply_ddp`, `apply_zero`, and the ZeRO-1 optimizer wrapper.

How each ZeRO stage maps onto PyTorch's own engines (no home-made communication):

- **ZeRO-1** (optimizer states sharded) = DDP + `torch.distributed.optim.ZeroRedundancyOptimizer`. DDP all-reduces
  full gradients exactly as plain data parallelism does; ZeroRedundancyOptimizer gives each dp rank the Adam
  moments of ~1/dp of the parameters, steps only those, then broadcasts the updated parameters. That is ZeRO-1 by
  definition (paper, sec. 5.1): memory 2Ψ + 2Ψ + 12Ψ/N_d in mixed precision, communication = DDP's all-reduce plus
  the parameter broadcast. It is the stage that composes with PP and TP in Megatron-style 3D training, because
  gradients stay whole per rank (pipeline micro-batches accumulate into them without extra collectives).
- **ZeRO-2** (+ gradients sharded) = FSDP2 `fully_shard(reshard_after_forward=False)`. Gradients are
  reduce-scattered, so each rank keeps 1/dp of them, and optimizer states are sharded with the parameters. The
  parameters stay gathered from the forward until the end of backward (no re-gather in backward): FSDP1 called this
  SHARD_GRAD_OP and documents it as ZeRO-2. Difference from the paper: between steps FSDP2 keeps parameters
  sharded too (one all-gather per step), so memory at rest is ZeRO-3's; peak memory and communication volume
  (all-gather Ψ + reduce-scatter Ψ = DDP's 2Ψ) are ZeRO-2's.
- **ZeRO-3** (+ parameters sharded) = FSDP2 `fully_shard(reshard_after_forward=True)`: parameters are gathered per
  block in forward, freed, gathered again in backward (3Ψ communication). With `cpu_offload` the sharded
  parameters, gradients and optimizer states live in host memory (`CPUOffloadPolicy`) and the optimizer steps on
  the CPU: what the planner asks for when even 1/dp of the states does not fit on a GPU.

FSDP2 is applied per transformer block and then to the root, so one block's parameters are gathered at a time
(torchtitan's order). DDP does not accept DTensor parameters, so ddp/zero1 with tensor parallelism first turns the
TP's DTensor parameters, so ddp with tensor parallelism uses `replicate` (DDP semantics on the FSDP2 engine), and
ZeRO-1 with tensor parallelism runs ZeroRedundancyOptimizer on the TP shards' local tensors (`_LocalZero1`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from tightfit.errors import UsageError


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a model (or pipeline stage): members of its `blocks` / `layers` / `h` container."""
    for name in ("blocks", "layers", "h"):
        for mod_name, mod in module.named_modules():
            if mod_name.split(".")[-1] == name and isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
                return list(mod.values()) if isinstance(mod, nn.ModuleDict) else list(mod)
    return []


def _has_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def apply_ddp(module: nn.Module, dp_mesh: DeviceMesh, pipelined: bool = False,
              bucket_cap_mb: float = 25.0) -> nn.Module:
    """Replicate `module` over `dp_mesh` with gradient all-reduce (torch DDP). Returns the DDP wrapper.

    Grads are averaged over dp ranks, so each rank's loss must be the mean over its own share of the global batch.
    `pipelined`: the module is a pipeline stage that runs several micro-batch backwards per step. DDP normally
    rebuilds its buckets after the first step from the order in which gradients became ready; with micro-batches
    each parameter becomes ready once per micro-batch and the rebuild fails an internal size check.
    `find_unused_parameters=True` is DDP's public switch that skips that rebuild (buckets keep the reverse
    registration order) at the price of one autograd-graph walk per step. The pipeline stage itself runs all but
    the last micro-batch's backward under `no_sync()`, so gradients are still all-reduced once per step.
    """
    if _has_dtensor_params(module):
        # DDP broadcasts and buckets plain tensors only. For TP-sharded (DTensor) parameters PyTorch's DDP
        # semantics come from `replicate`, the FSDP2-based data-parallel engine: parameters replicated over dp,
        # gradients all-reduced once per step, one group per block as with fully_shard.
        replicate = _fsdp_replicate()
        for block in repeated_blocks(module):
            replicate(block, mesh=dp_mesh)
        replicate(module, mesh=dp_mesh)
        return module
    device_ids = [torch.cuda.current_device()] if dp_mesh.device_type == "cuda" else None
    return DDP(module, process_group=dp_mesh.get_group(), device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
               find_unused_parameters=pipelined)


def _fsdp_replicate():
    """torch's FSDP2-based `replicate`: private (torch.distributed._composable), taking a 1-D mesh from torch 2.10."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:
        replicate = None
    if replicate is None or _torch_older_than(2, 10):
        raise UsageError(f"--strategy: data parallelism over tensor-parallel shards needs torch >= 2.10 "
                         f"(torch.distributed._composable.replicate_with_fsdp), this is {torch.__version__}: "
                         "upgrade torch, or use zero2/zero3 with tp")
    return replicate


def _torch_older_than(major: int, minor: int) -> bool:
    return tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (major, minor)


def unit_name(name: str) -> str:
    """A ZeRO-3 unit's name as plans and `shard_states.fsdp_units` give it: the module's own, "root" for the model."""
    return name or "root"


def apply_zero(module: nn.Module, dp_mesh: DeviceMesh, stage: int, cpu_offload: bool = False,
               pipelined: bool = False, kept: Iterable[str] = (), param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard training states over `dp_mesh` following ZeRO `stage` (1, 2 or 3); see the module docstring.

    Stage 1 returns a DDP wrapper: the optimizer-state sharding itself comes from `build_optimizer(..., zero1=True)`.
    Stages 2 and 3 shard `module` in place with FSDP2 and return it. With `cpu_offload` each unit's shards go to host
    memory (`CPUOffloadPolicy`, one policy per `fully_shard` call) except the units named in `kept` (`unit_name`s),
    whose shards stay on the device ([Note: shards kept on the GPU, unit by unit] in parallel/unit_split.py).
    `param_dtype` (bf16 training): FSDP2 gathers each unit's fp32 shards cast to it and reduces the gradients in fp32
    (`MixedPrecisionPolicy`), so a gathered unit costs its compute dtype's bytes, as `costs.memory_per_gpu` counts
    them, and the all-gathers half of fp32's; the shards stay fp32, the master weights.
    """
    if stage not in (1, 2, 3):
        raise UsageError(f"--strategy: ZeRO stage must be 1, 2 or 3, got {stage}")
    if cpu_offload and stage != 3:
        raise UsageError("CPU offload of sharded states needs ZeRO stage 3 (--strategy zero3)")
    if stage == 1:
        return apply_ddp(module, dp_mesh, pipelined)
    kept = set(kept)
    names = {id(m): unit_name(n) for n, m in module.named_modules()}

    def shard(m: nn.Module, reshard_after_forward: bool) -> None:
        kwargs: dict = {"mesh": dp_mesh, "reshard_after_forward": reshard_after_forward}
        if param_dtype is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        if cpu_offload and names[id(m)] not in kept:
            # Pinned host memory needs CUDA; on a CPU-only machine the "host" is the device itself.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        fully_shard(m, **kwargs)

    for block in repeated_blocks(module):
        shard(block, stage == 3)
    # The root group (embeddings, final norm, head) is gathered at the start of forward and kept until the end of
    # backward anyway, so resharding it after forward would only add an all-gather.
    shard(module, False)
    return module


def build_optimizer(param_groups: Iterable[dict], zero1_group=None, **adamw_kwargs) -> torch.optim.Optimizer:
    """AdamW over `param_groups`; with `zero1_group` (the dp process group) its states are sharded (ZeRO-1).

    Under ZeRO-2/3 the parameters are already FSDP shards, so a plain AdamW holds only this rank's states.
    """
    groups = [g for g in param_groups if g["params"]]
    if zero1_group is None:
        return torch.optim.AdamW(groups, **adamw_kwargs)
    if any(isinstance(p, DTensor) for g in groups for p in g["params"]):
        return _LocalZero1(groups, zero1_group, **adamw_kwargs)
    return _zero_redundancy(groups, zero1_group, **adamw_kwargs)


def _zero_redundancy(groups: list[dict], group, **adamw_kwargs) -> ZeroRedundancyOptimizer:
    opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW, process_group=group,
                                  **{**adamw_kwargs, **{k: v for k, v in groups[0].items() if k != "params"}})
    for g in groups[1:]:
        opt.add_param_group(g)
    return opt


class _LocalZero1:
    """ZeRO-1 for tensor-parallel (DTensor) parameters: ZeroRedundancyOptimizer over their local TP shards.

    Why it is correct: after `replicate`'s all-reduce over dp, every dp rank holds the same local TP shard and the
    same local gradient, which is exactly the situation ZeroRedundancyOptimizer handles for plain tensors: it
    steps the ~1/dp of these local tensors it owns and broadcasts them over the dp group. The local tensors alias
    the DTensors' storage (`to_local()` under no_grad), so updates land in the model in place. Gradients are
    aliased the same way just before each step, after clipping.
    """

    def __init__(self, groups: list[dict], group, **adamw_kwargs) -> None:
        with torch.no_grad():
            self._pairs = [(p, p.to_local()) for g in groups for p in g["params"]]
        local = {id(p): t for p, t in self._pairs}
        self._inner = _zero_redundancy([{**g, "params": [local[id(p)] for p in g["params"]]} for g in groups],
                                       group, **adamw_kwargs)
        self.param_groups = self._inner.param_groups

    def step(self) -> None:
        for p, t in self._pairs:
            t.grad = None if p.grad is None else p.grad.to_local()
        self._inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, t in self._pairs:
            p.grad = t.grad = None

    def state_dict(self) -> dict:
        return self._inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._inner.load_state_dict(state)

    def consolidate_state_dict(self, to: int = 0) -> None:
        self._inner.consolidate_state_dict(to)
