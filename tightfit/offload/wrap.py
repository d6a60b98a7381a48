"""`tightfit.wrap`: apply offloading to a model, in place.

Why a verb applied from outside: the model file holds no offload code (the same model trains plain, offloaded,
tiled or parallel); `wrap` installs hooks and replaces each unit's parameters by views of one flat buffer, and
returns the same module object so the user's loop does not change:

    model = tightfit.wrap(model, Placement.everywhere("nvme", nvme_dir="/mnt/swap"))
    opt = tightfit.optim.AdamW(model.parameters(), lr=3e-4)
    for x, y in data:
        loss = model(x, y); loss.backward(); opt.step(); opt.zero_grad()

"No offload" is the general path with every state on the device tier.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.offload.step.engine import OffloadEngine
from tightfit.offload.model_state.module_state import attach
from tightfit.offload.tiers.nvme.store import DiskTuning
from tightfit.offload.placement import Placement
from tightfit.offload.step.units import UnitPolicy


def wrap(model: nn.Module, placement: Placement | None = None, *, compute_dtype: torch.dtype | None = None,
         device: torch.device | str | None = None, units: UnitPolicy = None,
         disk: DiskTuning | None = None, **budgets) -> nn.Module:
    """Offload `model`'s training states as `placement` says; returns `model` itself.

    compute_dtype: dtype of the parameters during forward/backward (fp32 master weights are kept regardless);
        default fp32, or the plan's when the planner decides (then this is its `precision`).
    device: where to compute (default: CUDA if available, else the CPU, with `placement.device_budget`).
    units: which modules are units: a list of module paths (fnmatch patterns allowed) or a callable
        `(path, module) -> bool`; default: the children of every ModuleList of same-class children.
    disk: advanced, for benchmarks and tests: `tightfit.offload.tiers.nvme.store.DiskTuning(
        threads=..., chunk_bytes=...)`
        overrides the NVMe tier's I/O threads and largest transfer, which it otherwise takes from `tightfit probe`'s
        measurement of the swap folder's disk (8 threads and 4 MiB where none was made; [Note: disk tuning]).
    Use `tightfit.offload.engine_of(model)` for memory reports and timings.
    Without a placement the planner decides: `wrap(model, gpu_mem=..., cpu_mem=..., nvme=..., micro_batch=...,
    seq_len=...)`, or `wrap(model, tightfit.plan(model, ...))` (tightfit/planner/from_python.py).
    """
    if not isinstance(placement, Placement):
        from tightfit.planner.from_python import wrap as wrap_planned

        return wrap_planned(model, placement, compute_dtype=compute_dtype, device=device, disk=disk, units=units,
                            **budgets)
    if budgets:
        raise UsageError(f"wrap: {', '.join(budgets)}: budgets plan a placement; this one carries its own")
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):  # e.g. "gpu": torch's message lists twenty device types
        raise UsageError(f"wrap(device=...): {device!r} is not a device; use 'cpu' or 'cuda'") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"wrap(device=...): only cpu and cuda are supported, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("wrap(device=...): cuda was asked for but torch sees no CUDA device; use device='cpu'")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cpu":
        device = torch.device("cpu")  # "cpu:0" is the CPU: one device, compared equal to every CPU tensor's
    engine = OffloadEngine(model, placement, compute_dtype or torch.float32, device, units, disk=disk)
    attach(model, engine)  # state_dict / load_state_dict through the tiers, parameter reads (module_state.py)
    return model
