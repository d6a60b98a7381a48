"""One-line planning from Python: `tightfit.plan(model, gpu_mem=..., ...)` and `tightfit.wrap(model, gpu_mem=...)`.

Why: the planner speaks `Config` (the CLI's typed settings), and applying a plan takes more than its placement
(tiled Linears replaced in the model, the tiles made units, the compute dtype). A Python user states budgets and
the shape of a micro-batch, in the spirit of Accelerate's `max_memory`:

    plan = tightfit.plan(model, gpu_mem="20GiB", cpu_mem="64GiB", nvme="/mnt/swap", micro_batch=4, seq_len=2048)
    print(plan.table())                      # inspect first: where each state goes, memory, step time
    model = tightfit.wrap(model, plan)       # or in one line: tightfit.wrap(model, gpu_mem="20GiB", ...)

The keyword arguments become the same `Config` the CLI builds, so both plan with one planner; messages name the
keyword arguments (`micro_batch=5`), not the flags (`Naming`, naming.py). `apply_plan` is the one place a plan is
applied to a model: `tightfit train` (train/memory.py) calls it too.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.planner.hardware import HardwareProfile
from tightfit.planner.naming import PYTHON
from tightfit.planner.plan import Plan

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CHOICES = {"precision": ("auto", "fp32", "bf16", "fp16"), "offload": ("auto", "none", "device", "host", "nvme"),
            "checkpointing": ("auto", "on", "off"), "accumulation": ("micro", "unit", "auto"),
            "boundaries": ("auto", "device", "host")}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UsageError(f"{name}: must be a positive integer, got {value!r}")
    return value


def _config(gpu_mem, cpu_mem, nvme, micro_batch, seq_len, grad_accum, precision, device, offload, checkpointing,
            grad_clip, accumulation="micro", boundaries="auto"):
    """The keyword arguments as the CLI's `Config`, each checked with an error naming the keyword."""
    from tightfit.config import Config, parse_nvme
    from tightfit.utils.sizes import parse_size

    if micro_batch is None or seq_len is None:
        raise UsageError("tightfit.plan: give micro_batch= and seq_len=, the shape of one micro-batch to plan for "
                         "(sequences x tokens)")
    cfg = Config()
    cfg.train.micro_batch = _positive_int("micro_batch", micro_batch)
    cfg.train.seq_len = _positive_int("seq_len", seq_len)
    cfg.train.grad_accum = _positive_int("grad_accum", grad_accum)
    for name, value in (("precision", precision), ("offload", offload), ("checkpointing", checkpointing),
                        ("accumulation", accumulation), ("boundaries", boundaries)):
        if value not in _CHOICES[name]:
            raise UsageError(f"{name}: {value!r} is not one of {', '.join(_CHOICES[name])}")
    cfg.train.precision, cfg.memory.offload, cfg.memory.checkpointing = precision, offload, checkpointing
    cfg.memory.accumulation, cfg.memory.boundaries = accumulation, boundaries
    dev = "auto" if device is None else torch.device(device).type
    if dev not in ("auto", "cpu", "cuda"):
        raise UsageError(f"device: only cpu and cuda are supported, got {device!r}")
    cfg.train.device = dev
    for name, value in (("gpu_mem", gpu_mem), ("cpu_mem", cpu_mem)):
        if value is not None:
            parse_size(value, name)  # fails here, naming the keyword
    cfg.memory.gpu_mem = None if gpu_mem is None else str(gpu_mem)
    cfg.memory.cpu_mem = None if cpu_mem is None else str(cpu_mem)
    if nvme is not None:
        parse_nvme(str(nvme), "nvme")
        cfg.memory.nvme = str(nvme)
    cfg.optim.grad_clip = 1.0 if grad_clip else 0.0
    return cfg


def _hardware(hardware) -> tuple[HardwareProfile | None, bool]:
    """(profile, what_if): None plans for this machine; a `HardwareProfile` as given; a str is a named profile or
    a profile file (`hardware_file.py`), another machine."""
    if hardware is None or isinstance(hardware, HardwareProfile):
        return hardware, False
    if isinstance(hardware, str):
        from tightfit.planner.hardware_file import load_hardware

        return load_hardware(hardware, PYTHON), True
    raise UsageError(f"hardware: expected a HardwareProfile, a profile file or a named profile, "
                     f"got {type(hardware).__name__}")


def plan(model: nn.Module, *, gpu_mem: str | int | None = None, cpu_mem: str | int | None = None,
         nvme: str | None = None, micro_batch: int | None = None, seq_len: int | None = None, grad_accum: int = 1,
         precision: str = "auto", device: str | torch.device | None = None, offload: str = "auto",
         checkpointing: str = "auto", grad_clip: bool = True, autocast: bool = True, accumulation: str = "micro",
         boundaries: str = "auto", hardware=None) -> Plan:
    """Plan where every state of `model` lives for micro-batches of `micro_batch` x `seq_len` tokens.

    gpu_mem, cpu_mem: budgets ("20GiB", or bytes); None: what the machine has, less headroom. On a machine
        without a GPU, cpu_mem bounds the whole process (the device tier is the same RAM).
    nvme: a swap folder for the NVMe tier, optionally with a size: "/mnt/swap" or "/mnt/swap:500GiB".
    grad_accum, precision, offload, checkpointing: as `tightfit train`'s --grad-accum, --precision, --offload,
        --checkpointing. grad_clip: whether the training loop clips (the optimizer then waits for backward).
    accumulation: the order the loop runs a step's micro-batches in. "micro" (default): one micro-batch's forward
        and backward after another, as an ordinary loop and the Hugging Face Trainer do. "unit": the loop runs them
        through `tightfit.offload.step.unit_major.UnitMajor` (each unit's params cross the link once a step);
        "auto": plan both and keep the faster, as `tightfit train` does (plan.shape.unit_major says which).
    boundaries: where unit-major order keeps the blocks' inputs until backward, as `--boundaries`: the loop passes
        `UnitMajor(model, boundaries_on_host=plan.shape.boundaries_on_host)`.
    autocast: whether the loop runs a bf16/fp16 forward under `torch.autocast` (the Hugging Face Trainer and
        `tightfit train` do: the plan counts autocast's casts and the fp32 copies they save); False for a loop that
        runs the compute dtype as given.
    device: "cpu" or "cuda" (default: CUDA when the planned machine has it).
    hardware: None (this machine, measured once by `tightfit probe` and cached), a `HardwareProfile`, or a named
        profile / profile file to plan for another machine (see docs/PLANNER.md, "What-if hardware").
    `model` may live on the meta device. Raises UsageError (one line, naming these keywords) when nothing fits.
    """
    from tightfit.planner.planner import make_plan

    cfg = _config(gpu_mem, cpu_mem, nvme, micro_batch, seq_len, grad_accum, precision, device, offload,
                  checkpointing, grad_clip, accumulation, boundaries)
    hw, what_if = _hardware(hardware)
    return make_plan(model, cfg, hw, names=PYTHON, what_if=what_if, autocast=autocast)


def _precision_of(dtype: torch.dtype | None) -> str | None:
    """`wrap`'s compute_dtype as a plan's precision ("fp32", "bf16", "fp16"); None when not given."""
    if dtype is None:
        return None
    names = {v: k for k, v in _DTYPES.items()}
    if dtype not in names:
        raise UsageError(f"compute_dtype: {dtype} is not one the planner computes in; use torch.float32, "
                         "torch.bfloat16 or torch.float16")
    return names[dtype]


def tile_as_planned(model: nn.Module, plan: Plan):
    """Replace the Linears `plan` tiles, in place; (the placement for the model's units, the unit list to wrap
    with: None for the engine's default units, each tile its own unit when the plan tiles)."""
    placement, units = plan.placement, None
    if placement.tiled_linears:
        from tightfit.tiling import tile_linears, tile_units

        tile_linears(model, tiles=placement.tiled_linears)
        units = tile_units(model)  # each tile its own unit, fetched and released one at a time
        placement = placement.for_units(units)
    return placement, units


def apply_plan(model: nn.Module, plan: Plan, *, device: torch.device | str | None = None, disk=None) -> nn.Module:
    """Wrap `model` as `plan` says: its tiled Linears replaced (each tile its own unit), the planned compute
    dtype, on the planned device. Returns `model` itself."""
    from tightfit.offload.wrap import wrap as wrap_placement

    if not isinstance(plan, Plan):
        raise UsageError(f"wrap: expected a tightfit.Placement or a Plan, got {type(plan).__name__}; build one with "
                         "Placement.everywhere('device'), tightfit.plan(model, ...), or give budgets: "
                         "tightfit.wrap(model, cpu_mem=..., micro_batch=..., seq_len=...)")
    if plan.hardware.cuda and not torch.cuda.is_available():
        raise UsageError(f"wrap: the plan is for a CUDA GPU ({plan.hardware.device_name}) and this machine has "
                         "none; plan for this machine (leave out hardware=)")
    if device is None:
        device = "cuda" if plan.hardware.cuda else "cpu"
    placement, units = tile_as_planned(model, plan)
    return wrap_placement(model, placement, compute_dtype=_DTYPES[plan.profile.compute_dtype], device=device,
                          units=units, disk=disk)


def wrap(model: nn.Module, plan_: Plan | None = None, *, compute_dtype: torch.dtype | None = None, device=None,
         disk=None, units=None, hardware=None, **budgets) -> nn.Module:
    """`tightfit.wrap` without a `Placement`: apply `plan_`, or plan from `budgets` (the keyword arguments of
    `plan`) and apply that. Returns `model` itself. `compute_dtype` is the plan's precision: planned with it, or
    checked against the given plan's."""
    precision = _precision_of(compute_dtype)
    if units is not None:
        raise UsageError("units: the plan chooses the units; to choose them yourself, write a Placement "
                         "(tightfit.units(model) lists the names) and call tightfit.wrap(model, placement, units=...)")
    if plan_ is not None:
        if budgets or hardware is not None:
            raise UsageError(f"wrap: give a plan or budgets, not both ({', '.join(sorted(budgets)) or 'hardware'} "
                             "with a plan)")
        if precision is not None and precision != plan_.profile.compute_dtype:
            raise UsageError(f"compute_dtype: the plan computes in {plan_.profile.compute_dtype}, not {precision}; "
                             f"plan again with tightfit.plan(model, precision={precision!r}, ...)")
        return apply_plan(model, plan_, device=device, disk=disk)
    if precision is not None:
        if budgets.get("precision", "auto") not in ("auto", precision):
            raise UsageError(f"compute_dtype: {precision} disagrees with precision={budgets['precision']!r}; give "
                             "one of them")
        budgets["precision"] = precision
    if not budgets:
        raise UsageError("wrap: give a Placement, a Plan, or budgets: tightfit.wrap(model, gpu_mem=..., "
                         "cpu_mem=..., nvme=..., micro_batch=..., seq_len=...)")
    if any(p.device.type == "meta" for p in model.parameters()):
        raise UsageError("wrap: the model lives on the meta device; tightfit.plan can plan it, but wrapping needs "
                         "its weights (build or load it on the CPU)")
    known = set(plan.__kwdefaults__) - {"hardware"}
    unknown = sorted(set(budgets) - known)
    if unknown:
        raise UsageError(f"wrap: unknown keyword argument {unknown[0]!r}; planning takes {', '.join(sorted(known))}")
    hw, what_if = _hardware(hardware)
    if what_if:
        raise UsageError("hardware: wrap applies a plan on this machine; plan for another with tightfit.plan(model, "
                         "hardware=...) and inspect it")
    if device is not None:
        budgets["device"] = device
    return apply_plan(model, plan(model, hardware=hw, **budgets), device=device, disk=disk)
