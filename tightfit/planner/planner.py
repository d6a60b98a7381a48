"""`make_plan`: model + config (+ hardware) -> Plan. The one function the CLI and the trainer call.

Why here and not in `search.py`: this is where the config's words become the planner's numbers (device, precision,
budgets, the --offload mode) and where the profile, the search and the trace are put together; the search
itself knows nothing about flags.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tightfit.offload.placement import Tier
from tightfit.planner.costs import TrainShape
from tightfit.planner.hardware import HardwareProfile, current
from tightfit.planner.model_profile import DTYPE_BYTES, profile_model
from tightfit.planner.plan import Plan
from tightfit.planner.search import budgets_from, fixed, search


def make_plan(model: nn.Module, cfg, hardware: HardwareProfile | None = None) -> Plan:
    """Plan where every state of `model` (which may live on the meta device) goes, and predict the result.

    `hardware`: a profile to plan for (tests, what-ifs); None reads this machine's cached profile (probing it
    once if there is none) with capacities re-read now. Raises UsageError when no placement fits.
    """
    from tightfit.config import compute_device_type, parse_nvme, precision_name

    nvme_dir = parse_nvme(cfg.memory.nvme)[0] if cfg.memory.nvme else None
    if hardware is None:
        from tightfit.planner.probe import load_or_probe

        hardware = load_or_probe(nvme_dir)
    elif nvme_dir and hardware.nvme_free == 0 and hardware.measured_at:
        hardware = current(hardware, nvme_dir)
    cuda = hardware.cuda and compute_device_type(cfg, torch.cuda.is_available()) == "cuda"
    dtype = precision_name(cfg, "cuda" if cuda else "cpu")
    budgets = budgets_from(cfg.memory, hardware)
    profile = profile_model(model, cfg.train.micro_batch, cfg.train.seq_len, dtype, cuda)
    shape = TrainShape(compute_bytes=DTYPE_BYTES[dtype], grad_accum=cfg.train.grad_accum,
                       tokens_per_micro=cfg.train.micro_batch * cfg.train.seq_len,
                       grad_clip=cfg.optim.grad_clip > 0)
    mode = cfg.memory.offload
    if mode == "auto":
        res = search(profile, hardware, budgets, shape, cfg.memory.checkpointing)
    elif mode == "none":
        res = fixed(profile, hardware, budgets, shape, Tier.DEVICE, cfg.memory.checkpointing, "--offload none "
                    "(plain PyTorch)")
    else:
        res = fixed(profile, hardware, budgets, shape, Tier(mode), cfg.memory.checkpointing, f"--offload {mode}")
    plan = Plan(res.placement, res.prediction,
                {"device": budgets.device, "host": budgets.host, "nvme": budgets.nvme if budgets.nvme_dir else None},
                budgets.source, res.reasons, mode, shape, res.profile, hardware, budgets.shared)
    if cfg.memory.trace:
        from tightfit.planner.trace import write_trace

        write_trace(plan, cfg.memory.trace)
    return plan
