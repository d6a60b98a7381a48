"""Offload engine: stream a model's training states across device, host and NVMe (see docs/ENGINE.md)."""

from tightfit.offload.placement import ROOT_UNIT, Placement, State, Tier, UnitPlacement

__all__ = ["ROOT_UNIT", "Placement", "State", "Tier", "UnitPlacement", "engine_of", "wrap", "LossScaler"]


def __getattr__(name: str):
    # Imported lazily: the planner imports placement.py without pulling in the engine.
    if name == "engine_of":
        from tightfit.offload.step.engine import engine_of

        return engine_of
    if name == "wrap":
        from tightfit.offload.wrap import wrap

        return wrap
    if name == "LossScaler":
        from tightfit.offload.step.loss_scale import LossScaler

        return LossScaler
    raise AttributeError(f"module 'tightfit.offload' has no attribute {name!r}")
