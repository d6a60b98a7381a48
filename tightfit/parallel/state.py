"""Gather and restore full training state (weights + AdamW moments) across any parallel layout.

Why full tensors: a distributed run then writes the *single-process* checkpoint format (`model.<name>`,
`optim.<name>.exp_avg|exp_avg_sq|step`, offload.model_state.state_io), so any run resumes any other — a different
strategy, a different world size, or one process. The cost is gathering on rank 0 at save time, fine up to models
whose full state fits in one host's memory; beyond that, torch.distributed.checkpoint (per-rank shards) is the
tool, and not wired yet.

Where the moments of parameter `name` live, by optimizer:
- AdamW over plain tensors (no dp, or pp stages): this rank's `opt.state[p]`, whole.
- AdamW over DTensors (FSDP2 zero2/zero3, TP, `replicate`): `opt.state[p]` holds DTensors placed like `p`;
  `tensor_parallel.full_tensor` gathers them.
- ZeroRedundancyOptimizer (zero1): only the owning dp rank has them (in `opt.optim.state`); an
  `all_gather_object` over dp gives every dp rank the local moments, then as above.
- `_LocalZero1` (zero1 with TP): the owning dp rank has the *local TP shard*; after the dp exchange,
  `DTensor.from_local(..., p.placements).full_tensor()` rebuilds it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from tightfit.parallel.data_parallel import _LocalZero1
from tightfit.parallel.tensor_parallel import distribute_like, full_tensor

MOMENTS = ("exp_avg", "exp_avg_sq")


def _named(pm) -> list[tuple[str, torch.nn.Parameter]]:
    from tightfit.parallel.parallelize import _clean

    return [(_clean(n), p) for n, p in pm.module.named_parameters()]


def _zero(opt):
    """(ZeroRedundancyOptimizer, {model param -> tensor the ZeRO optimizer holds}) or (None, None)."""
    if isinstance(opt, _LocalZero1):
        return opt._inner, {id(p): t for p, t in opt._pairs}
    if isinstance(opt, ZeroRedundancyOptimizer):
        return opt, None
    return None, None


def _local_moments(pm, opt) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {exp_avg, exp_avg_sq, step} as this rank holds them (local shards, or DTensors)."""
    zero, alias = _zero(opt)
    state = zero.optim.state if zero is not None else opt.state
    out = {}
    for name, p in _named(pm):
        key = alias[id(p)] if alias else p
        st = state.get(key)
        if st and "exp_avg" in st:
            out[name] = {k: st[k] for k in MOMENTS} | {"step": torch.as_tensor(st["step"], dtype=torch.float32)}
    if zero is not None:  # each dp rank owns a part: exchange so every dp rank has all of them (local tensors)
        parts = [None] * pm.plan.dims.dp
        dist.all_gather_object(parts, {n: {k: v.detach().cpu() for k, v in m.items()} for n, m in out.items()},
                               group=pm.mesh["dp"].get_group())
        out = {n: m for part in parts for n, m in part.items()}
    return out


def gather_full_state(pm, opt) -> dict[str, torch.Tensor] | None:
    """Every weight and AdamW moment, whole, on global rank 0 (None elsewhere). Collective over all ranks."""
    pm.settle()
    zero, alias = _zero(opt)
    moments = _local_moments(pm, opt)
    full: dict[str, torch.Tensor] = {}
    for name, p in _named(pm):
        w = p.detach()
        full[f"model.{name}"] = (full_tensor(w) if isinstance(w, DTensor) else w).cpu()
        m = moments.get(name)
        if m is None:
            continue
        for k in MOMENTS:
            v = m[k]
            if isinstance(v, DTensor):
                v = full_tensor(v)
            elif isinstance(p, DTensor):  # a local shard (zero1 with TP): rebuild the DTensor, then gather
                v = full_tensor(DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                                   stride=p.stride()))
            full[f"optim.{name}.{k}"] = v.detach().float().cpu()
        full[f"optim.{name}.step"] = m["step"].cpu()
    if pm.plan.dims.pp > 1:  # one gather over the pp group of (dp=0, tp=0), whose first member is global rank 0
        mesh = pm.mesh
        if mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0:
            parts = [None] * pm.plan.dims.pp if dist.get_rank() == 0 else None
            dist.gather_object(full, parts, group_dst=0, group=mesh["pp"].get_group())
            if dist.get_rank() == 0:
                full = {k: v for part in parts for k, v in part.items()}
    return full if dist.get_rank() == 0 else None


@torch.no_grad()
def load_moments(pm, opt, get) -> int:
    """Put AdamW moments from a full-state source (`get(key) -> tensor`, KeyError/UsageError when absent) into
    `opt`, sharded like the parameters. Returns how many parameters got moments (0: none in the checkpoint)."""
    from tightfit.errors import UsageError

    zero, alias = _zero(opt)
    owned = None
    if zero is not None:
        rank_of = zero._param_to_rank
        me = dist.get_rank(zero.process_group)
        owned = {id(t) for t, r in rank_of.items() if r == me}
    state = zero.optim.state if zero is not None else opt.state
    loaded = 0
    for name, p in _named(pm):
        try:
            vals = {k: get(f"optim.{name}.{k}") for k in (*MOMENTS, "step")}
        except (KeyError, UsageError):
            continue
        key = alias[id(p)] if alias else p
        if owned is not None and id(key) not in owned:
            continue
        moments = {}
        for k in MOMENTS:
            v = vals[k].to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):
                # Every rank holds the full value: slice locally (src_data_rank=None), no collective — ranks
                # that own no ZeRO-1 state skip parameters, so a collective here would mismatch.
                v = distribute_like(v, p)
                if alias:  # the ZeRO optimizer steps local shards
                    v = v.to_local()
            moments[k] = v
        state[key] = {"step": vals["step"].float().reshape(()).clone(), **moments}
        loaded += 1
    return loaded
