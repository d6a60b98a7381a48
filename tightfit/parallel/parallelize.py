"""`parallelize(model, plan, mesh)`: apply the parallelisms in their one documented order.

The order (torchtitan's), and why:
1. **PP split** — `build_stage_module`: keep only this pipeline rank's blocks. First, so every later step touches
   only the parameters this rank owns.
2. **TP** — `apply_tp`: replace the stage's Linear weights by DTensor shards over the `tp` mesh. Before DP, because
   FSDP2 must see the TP shards to make 2-D (dp, tp) shards, and DDP must see them to localise them.
   Then activation checkpointing of every block where asked (activation_checkpoint.py), inside DP's wrappers.
3. **DP** — `apply_ddp` (ddp, zero1) or `apply_zero` (zero2, zero3) over the `dp` mesh.
4. **PP schedule** — `apply_pp`: the PipelineStage wraps the DP-wrapped stage, so it can skip gradient sync on all
   but the last micro-batch.
5. **Optimizer** — AdamW, wrapped in ZeroRedundancyOptimizer over the dp group for zero1.

The result, `ParallelModel`, is what a training loop drives: `forward_backward(x, y)` runs one step's compute on
this rank's share of the batch, `clip_grad_norm_` and `global_loss` do the two reductions a loop needs, and
`full_state_dict` gathers weights for comparison or saving.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from tightfit.errors import UsageError
from tightfit.parallel.activation_checkpoint import checkpoint_blocks
from tightfit.parallel.data_parallel import apply_ddp, apply_zero, build_optimizer
from tightfit.parallel.pipeline import apply_pp, build_stage_module, lm_loss
from tightfit.parallel.plan import ParallelPlan
from tightfit.parallel.tensor_parallel import apply_tp, full_tensor, on_mesh_device


def _logits(out) -> torch.Tensor:
    """Logits from a plain model (tensor) or a Hugging Face one (output object)."""
    return out if isinstance(out, torch.Tensor) else out.logits


def _clean(name: str) -> str:
    """Parameter name as in the unwrapped model (DDP adds `module.`)."""
    return name[len("module."):] if name.startswith("module.") else name


@dataclass
class ParallelModel:
    """This rank's part of a parallelised model, with the collectives a training loop needs."""

    module: nn.Module
    """The local module: the (DP-wrapped, TP-sharded) model or pipeline stage."""
    plan: ParallelPlan
    mesh: DeviceMesh
    schedule: object | None = None
    """The pipeline schedule when pp > 1."""
    hf: bool = False
    """A Hugging Face model (called with input_ids=..., use_cache=False; returns an output object)."""
    settle: Callable[[], None] = lambda: None
    """Waits for the optimizer's steps still running on the shards (shard_states.py) before they are read whole."""

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def has_loss(self) -> bool:
        """Whether this rank computes the loss (the last pipeline stage does)."""
        return self.pp_rank == self.plan.dims.pp - 1

    def parameters(self):
        return self.module.parameters()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Forward of the local module (pp == 1 only): logits [b, T, vocab]."""
        out = self.module(input_ids=x, use_cache=False) if self.hf else self.module(x)
        return _logits(out)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, scale: float = 1.0,
                         sync: bool = True) -> torch.Tensor:
        """Forward and backward on this dp rank's batch x, y [b, T]. Returns the mean loss (NaN off the last stage).

        Gradients end up averaged over the dp ranks and the micro-batches: those of one step on the global batch.
        Accumulating over several calls (pp == 1): `scale` = 1/calls, and `sync=False` on all but the last, which
        skips the dp gradient reduction until then under DDP (`no_sync`, and `replicate`'s), so a step costs one
        all-reduce whatever the accumulation. Not under ZeRO-2/3 (`fully_shard`): there each micro-batch's gradients
        are reduce-scattered into the shards, since FSDP2 skipping it would keep every unit's unsharded fp32
        gradients on the device until the last micro-batch — the whole model's, 4 bytes a parameter on every rank,
        which ZeRO-3 is there to avoid and `costs.memory_per_gpu` does not count (a Llama-2-70B on 8 GPUs: 257 GiB a
        GPU); a reduce-scatter per micro-batch is the price, as DeepSpeed's ZeRO-2/3 pay it.
        """
        if self.schedule is None:
            with self._grad_sync(sync or self.plan.dp_mode in ("zero2", "zero3")):
                loss = lm_loss(self.logits(x), y)
                (loss * scale if scale != 1.0 else loss).backward()
            return loss.detach()
        if x.shape[0] % self.plan.pp_microbatches:
            raise UsageError(f"--pp-microbatches {self.plan.pp_microbatches}: must divide the per-rank batch "
                             f"({x.shape[0]} sequences)")
        first, last = self.pp_rank == 0, self.has_loss
        losses: list[torch.Tensor] = []
        # Contiguous: x and y are usually slices of one token tensor (inputs [:, :-1], targets [:, 1:]), and a
        # stage checks each micro-batch's strides against the contiguous shapes it inferred (torch 2.11 does:
        # a stride mismatch, (17, 1) against (16, 1)).
        if first:
            self.schedule.step(x.contiguous())
        elif last:
            self.schedule.step(target=y.contiguous(), losses=losses)
        else:
            self.schedule.step()
        if not last:
            return torch.tensor(float("nan"))
        return torch.stack([loss.detach() for loss in losses]).mean()

    def _grad_sync(self, sync: bool):
        """Context in which backward does (sync) or does not (accumulate locally) reduce gradients over dp."""
        from contextlib import nullcontext

        from torch.distributed.fsdp import FSDPModule
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(self.module, DistributedDataParallel):
            return nullcontext() if sync else self.module.no_sync()
        if isinstance(self.module, FSDPModule):  # fully_shard and replicate: a flag, set for this backward
            self.module.set_requires_gradient_sync(sync)
        return nullcontext()

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only on x, y [b, T]: the mean loss on the last stage (NaN elsewhere). Dropout off meanwhile."""
        was_training = self.module.training
        self.module.eval()
        try:
            if self.schedule is None:
                return lm_loss(self.logits(x), y)
            losses: list[torch.Tensor] = []
            if self.pp_rank == 0:
                self.schedule.eval(x)
            elif self.has_loss:
                self.schedule.eval(target=y, losses=losses)
            else:
                self.schedule.eval()
            return torch.stack(losses).mean() if self.has_loss else torch.tensor(float("nan"))
        finally:
            self.module.train(was_training)
            self._reshard()

    def _reshard(self) -> None:
        """Return every FSDP2 group to its sharded parameters, as a training step's backward leaves them.

        Why: a forward without backward leaves the groups that do not reshard after forward (the root always,
        every group under zero2) holding unsharded plain tensors as the module's parameters. The checkpoint
        gather would then read those (and miss their optimizer moments, keyed on the sharded parameters), and
        the next backward could not free their storage once a writer had taken a view of it."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def global_loss(self, local_loss: torch.Tensor | float, weight: float = 1.0) -> float:
        """Weighted mean of the loss-holding ranks' `local_loss`, the same on every rank (one all-reduce).

        tp peers hold equal losses and equal weights, so counting each of them leaves the mean unchanged.
        """
        t = torch.zeros(2, dtype=torch.float64, device=self._comm_device())
        if self.has_loss and weight:
            t[0], t[1] = float(local_loss) * weight, weight
        dist.all_reduce(t)
        return float(t[0] / t[1]) if t[1] else float("nan")

    def _comm_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.mesh.device_type == "cuda" \
            else torch.device("cpu")

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm (over every shard on every rank). Returns the norm before clipping.

        Squares are summed per kind of shard: DTensor gradients (FSDP/TP/replicate) reduce over their own mesh
        with `full_tensor()`; plain (replicated) ones count once; pipeline stages then add their sums.
        """
        grads = [(n, p.grad) for n, p in self.module.named_parameters() if p.grad is not None]
        by_spec: dict = {}
        plain = torch.zeros((), dtype=torch.float32, device=self._comm_device())
        for name, g in grads:
            if isinstance(g, DTensor):  # by device too: FSDP2's offloaded units' gradients are on the host
                by_spec.setdefault((g.device_mesh, tuple(g.placements), g.to_local().device), []).append(g)
            else:
                plain += g.detach().float().pow(2).sum()
        total_sq = plain
        for gs in by_spec.values():
            n = torch.nn.utils.get_total_norm(gs, 2.0)
            # the norm of host gradients (FSDP2's CPU offload) is reduced on the mesh's device
            total_sq = total_sq + on_mesh_device(n).full_tensor().float().pow(2).to(total_sq.device)
        if self.plan.dims.pp > 1:
            dist.all_reduce(total_sq, group=self.mesh["pp"].get_group())
        total = float(total_sq.sqrt())
        coef = max_norm / (total + 1e-6)
        if max_norm > 0 and coef < 1.0:
            # Same coefficient as torch.nn.utils.clip_grad_norm_; applied per kind of tensor because one foreach
            # call cannot mix DTensors of different meshes with plain tensors.
            for gs in [*by_spec.values(), [g for n, g in grads if not isinstance(g, DTensor)]]:
                if gs:
                    torch._foreach_mul_(gs, coef)
        return total

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, un-sharded (every rank of a pp stage gets the stage's weights). Collective."""
        self.settle()
        out = {}
        for name, p in self.module.named_parameters():
            t = p.detach()
            if isinstance(t, DTensor):
                t = full_tensor(t)
            out[_clean(name)] = t.cpu()
        return out


def parallelize(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, device: torch.device,
                checkpoint: bool = False, param_dtype: torch.dtype | None = None) -> ParallelModel:
    """Apply PP split, TP, activation checkpointing (`checkpoint`: every block), DP and the PP schedule to `model`
    (built identically on every rank), in that order (torchtitan's). `param_dtype`: the dtype FSDP2 gathers the
    fp32 shards in (bf16 training; `apply_zero`), without pipeline stages (whose schedule infers the activations'
    dtypes itself)."""
    dims = plan.dims
    module = model.to(device)
    if dims.pp > 1:
        module = build_stage_module(model, mesh["pp"].get_local_rank(), dims.pp)
    if dims.tp > 1:
        apply_tp(module, mesh["tp"])
    if checkpoint:
        checkpoint_blocks(module)
    if dims.dp > 1 or plan.dp_mode == "zero3" and plan.cpu_offload:
        if plan.dp_mode in ("ddp", "zero1"):
            module = apply_ddp(module, mesh["dp"], pipelined=dims.pp > 1)
        else:
            module = apply_zero(module, mesh["dp"], int(plan.dp_mode[-1]), plan.cpu_offload, dims.pp > 1,
                                kept=plan.kept_names, param_dtype=param_dtype if dims.pp == 1 else None)
    schedule = None
    if dims.pp > 1:
        schedule = apply_pp(module, mesh["pp"], device, plan.pp_schedule, plan.pp_microbatches)
    return ParallelModel(module, plan, mesh, schedule, hf=hasattr(getattr(model, "config", None), "model_type"))


def make_optimizer(pm: ParallelModel, lr: float, weight_decay: float = 0.0, betas=(0.9, 0.95), eps: float = 1e-8,
                   moments_folder=None, host_room: int | None = None):
    """AdamW with decay on matrices only (biases, norms exempt); ZeRO-1 shards its states over dp. Under FSDP2's CPU
    offload, `ShardStatesAdamW` (shard_states.py): each offloaded unit's moments in host memory, or, with
    `moments_folder` (this rank's swap folder), there for the units past the first that fit `host_room` bytes, each
    unit stepped under the next forward; the units the plan keeps on the device (unit_split.py) have theirs there."""
    decay = [p for p in pm.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in pm.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if pm.plan.cpu_offload and pm.plan.dims.pp == 1:
        from tightfit.offload.placement import Tier
        from tightfit.offload.tiers.stores import DiskStore, MemoryStore
        from tightfit.parallel.shard_states import ShardStatesAdamW, fsdp_units

        disk = DiskStore(str(moments_folder)) if moments_folder is not None else None
        kept = pm.plan.kept_names
        device = MemoryStore(Tier.DEVICE, pm._comm_device()) if kept else None
        opt = ShardStatesAdamW(groups, fsdp_units(pm.module), MemoryStore(Tier.HOST, torch.device("cpu")), disk,
                               host_room, lr=lr, betas=betas, eps=eps, device=device, resident=kept)
        pm.settle = opt.wait
        return opt
    zero1 = pm.mesh["dp"].get_group() if pm.plan.dp_mode == "zero1" and pm.plan.dims.dp > 1 else None
    return build_optimizer(groups, zero1_group=zero1, lr=lr, betas=betas, eps=eps)
