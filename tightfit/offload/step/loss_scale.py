"""Dynamic loss scaling for fp16 compute with an offloaded optimizer.

Why its own class (and not torch.amp.GradScaler): GradScaler unscales and checks `param.grad`, which a wrapped
model never keeps (gradients leave the device as soon as they are produced). Here the overflow check reads the
per-parameter gradient norms the engine computes anyway while accumulating (a non-finite gradient has a
non-finite norm), and unscaling is a multiplier the optimizer applies inside its per-unit step. The API mirrors
GradScaler so a loop reads the same:

    scaler = LossScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(opt); opt.clip_grad_norm_(1.0)   # optional: clip the unscaled gradients
    scaler.step(opt)      # skipped (gradients dropped) when any gradient overflowed
    scaler.update()       # halve the scale after an overflow, double it after `growth_interval` clean steps

bf16 and fp32 need no scaler: their exponent range is fp32's.
"""

from __future__ import annotations

import math

import torch


class LossScaler:
    """Multiply the loss by `scale`, skip steps whose gradients overflowed, adapt the scale."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._clean_steps = 0
        self._unscaled = False
        self._found_inf = False
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, opt) -> None:
        """Have `opt` divide the gradients by the scale in its next step (and in `clip_grad_norm_`)."""
        if not self._unscaled:
            opt.scale_grads_(1.0 / self.scale_value)
            self._unscaled = True

    def step(self, opt) -> bool:
        """Run `opt.step()` unless a gradient is inf/NaN; returns whether the step ran."""
        self.unscale_(opt)
        norms = opt.grad_norms()
        self._found_inf = bool(norms) and not math.isfinite(float(torch.stack(norms).sum()))
        if self._found_inf:
            self.skipped_steps += 1
            opt.zero_grad()
        else:
            opt.step()
        self._unscaled = False
        return not self._found_inf

    def update(self) -> None:
        if self._found_inf:
            self.scale_value *= self.backoff_factor
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps >= self.growth_interval:
                self.scale_value *= self.growth_factor
                self._clean_steps = 0
        self._found_inf = False

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "clean_steps": self._clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, d: dict) -> None:
        self.scale_value = float(d["scale"])
        self._clean_steps = int(d["clean_steps"])
        self.skipped_steps = int(d.get("skipped_steps", 0))


def scaler_state(scaler) -> dict | None:
    """The loss scaler's state for a checkpoint, the same for tightfit's LossScaler and torch's GradScaler (a plain
    run's), so an fp16 run resumes exactly under either placement: {"scale", "growth_tracker"} (clean steps since
    the last change). None without a scaler (bf16, fp32)."""
    if scaler is None:
        return None
    if isinstance(scaler, LossScaler):
        return {"scale": float(scaler.scale_value), "growth_tracker": int(scaler._clean_steps)}
    d = scaler.state_dict()  # torch.amp.GradScaler
    if not d:  # a disabled GradScaler has no state
        return None
    return {"scale": float(d["scale"]), "growth_tracker": int(d["_growth_tracker"])}


def load_scaler_state(scaler, state: dict | None) -> None:
    """Restore what `scaler_state` saved (validated by the checkpoint loader); nothing without either."""
    if scaler is None or state is None:
        return
    if isinstance(scaler, LossScaler):
        scaler.scale_value = float(state["scale"])
        scaler._clean_steps = int(state["growth_tracker"])
        return
    d = scaler.state_dict()
    if d:
        scaler.load_state_dict({**d, "scale": float(state["scale"]), "_growth_tracker": int(state["growth_tracker"])})
