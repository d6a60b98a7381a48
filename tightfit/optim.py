"""`tightfit.optim.AdamW`: the optimizer of a wrapped model, a drop-in for `torch.optim.AdamW`.

Why a subclass of `torch.optim.Optimizer`: learning-rate schedules, gradient-accumulation loops and loggers that
read or edit `param_groups[i]["lr"]` keep working. What differs is where the state is: the moments, the fp32
master weights and the gradients live in the engine's tiers, not in `self.state` (which stays empty), and
`step()` runs the engine's per-unit pipelined step (tightfit/offload/step/optimizer.py).

Memory: the optimizer holds nothing of its own. Per step, at most two units' working sets (16 B/param each) are
in host memory at once, drawn from the engine's bounded buffer pool.

Clipping: `opt.clip_grad_norm_(max_norm)` replaces `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`.
The per-parameter gradient norms are computed when the gradients are accumulated into their tier (no second pass
over the disk), so clipping only stacks them; the clip coefficient is applied to each unit's gradients inside the
step, just before AdamW, as torch multiplies them before its step. Because the norm needs every gradient, a
clipped step starts after backward has finished; see docs/ENGINE.md for how clipping and overlap coexist.

Checkpoints: use `tightfit.offload.state_io.export_state(model, opt)` / `import_state`; `state_dict()` carries
only the hyperparameters.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch

from tightfit.errors import UsageError
from tightfit.offload.step.engine import OffloadEngine, engine_of_param
from tightfit.offload.step.optimizer import Multipliers


def _hyper(group: dict) -> dict:
    """A parameter group's hyperparameters as they are now (its parameters left out)."""
    return {k: v for k, v in group.items() if k != "params"}


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) over a wrapped model's parameters; same defaults as torch.optim.AdamW."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if not 0.0 <= float(lr):
            raise UsageError(f"tightfit.optim.AdamW: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise UsageError(f"tightfit.optim.AdamW: betas must be in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0:
            raise UsageError("tightfit.optim.AdamW: eps and weight_decay must be >= 0")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        engines = set()
        for group in self.param_groups:
            for p in group["params"]:
                engine = engine_of_param(p)
                if engine is None:
                    raise UsageError("tightfit.optim.AdamW: a parameter is not part of a wrapped model; call "
                                     "tightfit.wrap(model, placement) before creating the optimizer")
                engines.add(engine)
        if len(engines) != 1:
            raise UsageError("tightfit.optim.AdamW: parameters come from several wrapped models; use one optimizer "
                             "per model")
        self.engine: OffloadEngine = engines.pop()
        self._backwards_seen = self.engine.backwards  # the engine's backward count at the last step / zero_grad
        self._warned_no_grads = False
        # Multipliers applied to the gradients inside the next step (loss-scale inverse, clip coefficient).
        self._grad_scales: list[torch.Tensor] = []

    def _layout(self) -> dict[str, list[tuple[dict, list[int]]]]:
        """Unit name -> [(param group, indices into unit.trainable)]: which group each trainable slot belongs to.
        Cached while the groups stay the same dicts with as many parameters (`add_param_group` and
        `load_state_dict` make new ones): `_work` runs once per unit per step, and locating every parameter each
        time is quadratic in the number of units."""
        key = tuple((id(group), len(group["params"])) for group in self.param_groups)
        cached = getattr(self, "_layout_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        layout: dict[str, list[tuple[dict, list[int]]]] = {}
        for group in self.param_groups:
            per_unit: dict[str, list[int]] = {}
            for p in group["params"]:
                where = self.engine.locate(p)
                if where is not None and where[0].steps_here:  # None: frozen; not steps_here: another rank's
                    per_unit.setdefault(where[0].name, []).append(where[1])
            for name, idx in per_unit.items():
                layout.setdefault(name, []).append((group, idx))
        self._layout_cache = (key, layout)
        return layout

    def _work(self, only=None):
        """Per unit (in the engine's order, or just `only`), per parameter group as it is now (the hyperparameters
        copied: the step runs later, after the loop may have set the next step's learning rate), the trainable slots
        with a gradient."""
        layout = self._layout()
        work = []
        for unit in ([only] if only is not None else self.engine.step_order()):
            if only is None and unit.stepping is not None:
                continue  # stepped during backward (or queued to be): its step has its gradients
            groups = [(_hyper(group), [i for i in idx if unit.has_grad[i]]) for group, idx in layout.get(unit.name, ())]
            groups = [(group, idx) for group, idx in groups if idx]
            if groups:
                work.append((unit, groups))
        return work

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped_early = self.engine.stepped_during_backward
        work = self._work()
        if not work and not stepped_early:
            self._warn_no_grads()
        self.engine.step_units(work, Multipliers(self._grad_scales))
        self._grad_scales = []
        self._backwards_seen = self.engine.backwards
        return loss

    def _warn_no_grads(self) -> None:
        """Warn (once per optimizer) about a step after a backward that left it no gradient: something between the
        two dropped them (`model.zero_grad()`), or the backward reached none of this optimizer's parameters."""
        if self.engine.backwards == self._backwards_seen or self._warned_no_grads:
            return
        self._warned_no_grads = True
        warnings.warn("tightfit.optim.AdamW.step(): the backward since the last step left no gradient for this "
                      "optimizer's parameters, so nothing was updated; were they dropped before the step "
                      "(model.zero_grad() / p.grad = None), or does the loss not depend on them?", stacklevel=3)

    def step_during_backward(self) -> None:
        """Step each unit during the coming backward, as soon as its gradients are complete.

        Call it right before the backward of the *last* micro-batch of a step, and only for a step that neither
        clips nor unscales gradients (both need every gradient first). Each unit's optimizer step then runs on the
        engine's step thread, overlapping the backward of the units before it; `step()` waits for those and steps
        what is left (the root unit, whose gradients complete last). The result is identical to a plain step.
        """
        if self._grad_scales:
            raise UsageError("step_during_backward: gradients are being unscaled or clipped this step; clipping "
                             "needs all gradients before any unit is stepped, so call opt.step() after backward")
        hyper = Multipliers(self._grad_scales)

        def early(unit) -> None:  # main thread, when the unit's backward is done
            work = self._work(only=unit)
            if work:
                self.engine.submit_early_step(unit, lambda: self.engine.stepper.step_one(unit, work[0][1], hyper))

        self.engine.declare_step(self._layout(), early)

    def preload_during_backward(self) -> None:
        """Start loading each unit's master weights and moments during the coming backward, for the `step()` after it.

        For a step that clips or unscales gradients (so cannot run during backward): call it right before the
        backward of the last micro-batch. As each unit's backward starts, its optimizer state starts loading from
        its tier, under the backward compute, as far as the host budget has room; the step after backward then
        waits only for the gradients. The result is the same as without it.
        """
        self.engine.declare_step(self._layout())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (they live in the engine's grads tier; `param.grad` is always None)."""
        self.engine.zero_grad()
        self._grad_scales = []
        self._backwards_seen = self.engine.backwards

    def scale_grads_(self, factor: torch.Tensor | float) -> None:
        """Multiply every gradient by `factor` inside the next step (used by the loss scaler's unscale)."""
        self._grad_scales.append(torch.as_tensor(factor, dtype=torch.float32))

    def grad_norms(self) -> list[torch.Tensor]:
        """Per-parameter 2-norms of the accumulated gradients (with pending multipliers), in model order."""
        norms = self.engine.grad_norms_in_model_order()
        # Units whose grads stay on a GPU have their norms there, the others on the CPU: gather them on the first
        # one's device, as torch.nn.utils.clip_grad_norm_ does.
        norms = [n.to(norms[0].device) for n in norms]
        if norms and self._grad_scales:
            factor = torch.stack([f.to(norms[0].device) for f in self._grad_scales]).prod()
            norms = [n * factor for n in norms]
        return norms

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip the global gradient norm like `torch.nn.utils.clip_grad_norm_`; returns the norm before clipping."""
        if norm_type != 2.0:
            raise UsageError("tightfit.optim.AdamW.clip_grad_norm_: only norm_type=2.0 is supported")
        if self.engine.early_step is not None or self.engine.stepped_during_backward:
            raise UsageError("clip_grad_norm_: this step was started during backward (step_during_backward); "
                             "clipping needs every gradient first, so do not combine the two")
        norms = self.grad_norms()
        if not norms:
            return 0.0
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # Torch multiplies the gradients by the coefficient even when it is 1 (the norm is within max_norm). A
        # multiply by exactly 1 changes no bit of any float, so the step's pass over every gradient is skipped then
        # ([Note: host passes] in planner/costs.py: on a GPU machine 8 bytes of host memory a parameter).
        if coef.item() != 1.0:
            self._grad_scales.append(coef)
        return float(total)
