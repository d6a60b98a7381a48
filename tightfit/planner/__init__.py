"""The memory planner: decide where every state lives, predict memory and step time, explain both.

Entry points:
- `make_plan(model, cfg, hardware=None) -> Plan` (planner.py): the placement the engine consumes, with predictions.
- `tightfit.plan(model, gpu_mem=..., ...)` / `tightfit.wrap(model, gpu_mem=..., ...)` (from_python.py): the same
  from Python keyword arguments, and `apply_plan(model, plan)`, the one place a plan is applied to a model.
- `hardware_file.load_hardware(FILE or NAME)`: another machine's profile, for `tightfit plan --hardware`.
- `Plan.summary()`, `Plan.table()`, `Plan.to_json()`, `Plan.compare(measured)` (plan.py): what the CLI prints.
- `tightfit.planner.probe.run_probe(folder) -> HardwareProfile`: measure this machine (`tightfit probe`).
- `tightfit.planner.trace.write_trace(plan, folder)`: Chrome trace + memory timeline of one simulated step.
See docs/PLANNER.md for the model behind the predictions.
"""

from tightfit.planner.hardware import HardwareProfile
from tightfit.planner.plan import Plan
from tightfit.planner.planner import make_plan
from tightfit.planner.search import Infeasible

__all__ = ["HardwareProfile", "Infeasible", "Plan", "make_plan"]
