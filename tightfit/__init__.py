"""tightfit: train PyTorch models that do not fit your hardware.

Public entry points:
- `tightfit.wrap(model, placement_or_budget, ...)`: stream a model's states across GPU, CPU and NVMe inside an
  ordinary `loss.backward(); opt.step()` loop (see tightfit/offload/). Budgets instead of a placement
  (`gpu_mem=..., cpu_mem=..., nvme=..., micro_batch=..., seq_len=...`) plan one and apply it.
- `tightfit.plan(model, gpu_mem=..., cpu_mem=..., nvme=..., micro_batch=..., seq_len=...)`: the `Plan` to inspect
  first (`plan.table()`), then `tightfit.wrap(model, plan)` (tightfit/planner/from_python.py).
- `tightfit.units(model, units=None)`: the unit names wrapping would make, to write a Placement's per-unit entries.
- `tightfit train` / `tightfit plan` / `tightfit env`: the command line (tightfit/cli.py).
"""

from tightfit.offload.placement import Placement, State, Tier, UnitPlacement

__version__ = "0.1.0"

__all__ = ["Placement", "State", "Tier", "UnitPlacement", "__version__"]


def __getattr__(name: str):
    # `wrap` is imported lazily so `import tightfit` stays cheap and the engine can be built independently.
    if name == "wrap":
        from tightfit.offload.wrap import wrap

        return wrap
    if name == "plan":
        from tightfit.planner.from_python import plan

        return plan
    if name == "units":
        from tightfit.offload.step.units import unit_names

        return unit_names
    if name == "optim":
        import importlib

        return importlib.import_module("tightfit.optim")
    raise AttributeError(f"module 'tightfit' has no attribute {name!r}")
