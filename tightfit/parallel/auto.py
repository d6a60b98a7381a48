"""`--strategy auto`: `choose_strategy(hardware, model_profile)` applies the issue's rules and says which one chose.

The rules, in order (each `RULE_*` constant below is the text printed when it decides):
- one GPU: the model fits → plain; it does not → offload (+ tiling when the largest layer does not fit);
- one node, several GPUs: fits → DDP (ZeRO is optional: same traffic, less memory); does not fit → with
  NVLink/NVSwitch PP, ZeRO and TP cost about the same, so the largest layer decides: it does not fit → ZeRO-3
  (a block is gathered, then streamed/tiled, never held whole with its states), else TP (splits every layer);
  without NVLink → PP, which only sends one activation per micro-batch across each stage boundary;
- several nodes: fast interconnect (InfiniBand, NVLink) → ZeRO (the lowest stage that fits), or PP+TP+DP when
  even ZeRO-3 does not fit; slow interconnect (Ethernet) and memory short → DP+PP+TP+ZeRO-1 (TP inside a node,
  PP across nodes, ZeRO-1's optimizer sharding on top of DP); slow and memory not short → DDP (the rules leave
  this case open; DDP is the least traffic that trains on every GPU).

"Fits" means weights + gradients + optimizer states + one micro-batch of activations ≤ GPU memory (costs.py).
Degrees are the smallest that make the plan fit (less splitting = less communication); TP stays inside a node
and must divide the head count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tightfit.parallel.costs import Hardware, ModelProfile, memory_per_gpu
from tightfit.parallel.mesh import ParallelDims
from tightfit.parallel.plan import ParallelPlan
from tightfit.utils.sizes import format_size

RULE_SINGLE_FITS = "one GPU, model fits -> plain training"
RULE_SINGLE_OFFLOAD = "one GPU, model does not fit -> offload"
RULE_SINGLE_TILING = "one GPU, model does not fit and its largest layer does not either -> offload + tiling"
RULE_NODE_FITS = "one node, several GPUs, model fits -> DDP (ZeRO optional)"
RULE_NODE_PP = "one node, several GPUs, model does not fit, no NVLink/NVSwitch -> PP"
RULE_NODE_ZERO = "one node, several GPUs, model does not fit, NVLink, largest layer does not fit -> ZeRO-3"
RULE_NODE_TP = "one node, several GPUs, model does not fit, NVLink, largest layer fits -> TP"
RULE_MULTI_FAST_ZERO = "several nodes, fast interconnect -> ZeRO"
RULE_MULTI_FAST_3D = "several nodes, fast interconnect, ZeRO-3 alone does not fit -> PP+TP+DP"
RULE_MULTI_SLOW_SHORT = "several nodes, slow interconnect, memory short -> DP+PP+TP+ZeRO-1"
RULE_MULTI_SLOW_FITS = "several nodes, slow interconnect, model fits -> DDP"
NOTE_ZERO3_OFFLOAD = "ZeRO-3 shards do not fit either: their states go to host memory"
"""RULE_NODE_ZERO's note where it offloads; a run and `tightfit plan` replace it by unit_split.py's line."""


@dataclass(frozen=True)
class StrategyChoice:
    """What auto chose: a strategy string `--strategy` accepts (or single/offload/offload+tiling for one GPU)."""

    strategy: str
    dims: ParallelDims
    rule: str
    """The RULE_* text that decided."""
    reason: str
    """The rule plus the figures that triggered it."""
    plan: ParallelPlan | None = None
    """The plan to run (None for one GPU: that is the offload engine's business)."""
    notes: list[str] = field(default_factory=list)


def _pp_plan(pp: int, dp: int, tp: int, dp_mode: str) -> ParallelPlan:
    """A plan with pipeline stages gets 2·pp micro-batches: 1F1B needs ≥ pp, and the bubble (p−1)/(m+p−1) is then
    about a third of the step (the run may raise --pp-microbatches further)."""
    return ParallelPlan(ParallelDims(pp=pp, dp=dp, tp=tp), dp_mode, pp_microbatches=max(4, 2 * pp))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fits(plan: ParallelPlan, prof: ModelProfile, hw: Hardware) -> bool:
    return memory_per_gpu(plan, prof)["total"] <= hw.gpu_mem


def _smallest(candidates, prof: ModelProfile, hw: Hardware) -> tuple[ParallelPlan, bool]:
    """First plan that fits, else the last (most split) one; and whether it fits."""
    plans = list(candidates)
    for p in plans:
        if _fits(p, prof, hw):
            return p, True
    return plans[-1], False


def _tp_degrees(prof: ModelProfile, limit: int) -> list[int]:
    return [t for t in _divisors(limit) if t > 1 and prof.n_heads % t == 0] or [1]


def choose_strategy(hw: Hardware, prof: ModelProfile, log: Callable[[str], None] | None = print) -> StrategyChoice:
    """Apply the rules (module docstring) to `hw` and `prof`; `log` receives the deciding rule."""
    choice = _choose(hw, prof)
    if log is not None:
        log(f"tightfit: strategy {choice.strategy} ({choice.dims}): {choice.reason}")
    return choice


def _choose(hw: Hardware, prof: ModelProfile) -> StrategyChoice:
    need = prof.state_bytes + prof.activation_bytes
    figures = f"needs {format_size(need)} per GPU unsplit, GPU has {format_size(hw.gpu_mem)}"
    fits = prof.fits(hw.gpu_mem)
    layer_fits = prof.largest_layer_bytes <= hw.gpu_mem
    one = ParallelDims()
    G, world = hw.gpus_per_node, hw.world_size

    def done(strategy, plan, rule, extra="", notes=()):
        dims = plan.dims if plan else one
        if plan is not None:
            strategy = plan.name  # the degrees chosen may leave a dimension at 1 (e.g. dp_pp_tp with dp=1)
        reason = f"{rule} ({figures}{'; ' + extra if extra else ''})"
        return StrategyChoice(strategy, dims, rule, reason, plan, list(notes))

    if world == 1:
        if fits:
            return done("single", None, RULE_SINGLE_FITS)
        if layer_fits:
            return done("offload", None, RULE_SINGLE_OFFLOAD)
        return done("offload+tiling", None, RULE_SINGLE_TILING,
                    f"largest layer needs {format_size(prof.largest_layer_bytes)}")

    if hw.nnodes == 1:
        if fits:
            return done("ddp", ParallelPlan(ParallelDims(dp=G), "ddp"), RULE_NODE_FITS)
        if hw.interconnect not in ("nvlink", "nvswitch"):
            pps = [p for p in _divisors(G) if 1 < p <= max(prof.n_layers, 2)]
            plan, ok = _smallest((_pp_plan(p, G // p, 1, "ddp") for p in pps), prof, hw)
            return done("pp" if plan.dims.dp == 1 else "dp_pp", plan, RULE_NODE_PP,
                        notes=() if ok else ["still short with every stage count: add offload"])
        if not layer_fits:
            plan = ParallelPlan(ParallelDims(dp=G), "zero3")
            ok = _fits(plan, prof, hw)
            if not ok:
                plan = ParallelPlan(ParallelDims(dp=G), "zero3", cpu_offload=True)
            return done("zero3", plan, RULE_NODE_ZERO,
                        f"largest layer needs {format_size(prof.largest_layer_bytes)}",
                        () if ok else [NOTE_ZERO3_OFFLOAD])
        plan, ok = _smallest((ParallelPlan(ParallelDims(dp=G // t, tp=t), "ddp") for t in _tp_degrees(prof, G)),
                             prof, hw)
        return done("tp" if plan.dims.dp == 1 else "dp_tp", plan, RULE_NODE_TP,
                    notes=() if ok else ["still short at the largest TP degree: add offload"])

    if hw.fast:
        for stage in ("zero1", "zero2", "zero3"):
            plan = ParallelPlan(ParallelDims(dp=world), stage)
            if _fits(plan, prof, hw):
                return done(stage, plan, RULE_MULTI_FAST_ZERO)
        plan, ok = _three_d(hw, prof, "ddp")
        return done("dp_pp_tp", plan, RULE_MULTI_FAST_3D, notes=() if ok else ["still short: add offload"])
    if fits:
        return done("ddp", ParallelPlan(ParallelDims(dp=world), "ddp"), RULE_MULTI_SLOW_FITS)
    plan, ok = _three_d(hw, prof, "zero1")
    return done("zero1_pp_tp", plan, RULE_MULTI_SLOW_SHORT, notes=() if ok else ["still short: add offload"])


def _three_d(hw: Hardware, prof: ModelProfile, dp_mode: str) -> tuple[ParallelPlan, bool]:
    """TP over a node's GPUs (largest degree dividing the heads), then the fewest pipeline stages that fit."""
    tp = max(_tp_degrees(prof, hw.gpus_per_node))
    rest = hw.world_size // tp
    pps = [p for p in _divisors(rest) if 1 < p <= max(prof.n_layers, 2)] or [1]
    return _smallest((_pp_plan(p, rest // p, tp, dp_mode) for p in pps), prof, hw)
