"""Choosing a placement within budgets (budgets.py): a greedy fill of the fastest tiers, then the fastest plan.

Why greedy: the states of a transformer are a few identical units plus a root; what matters is which *kind* of
state sits where, and a greedy fill in order of "touched most per step" is both near-optimal for that structure
and explainable in one line per decision (the `reasons` the plan prints). Each move is checked with the full
memory model (`costs.memory`), so no budget is ever exceeded by the arithmetic that chose it.

Order of decisions (each step can only make the next easier):
1. budgets (flags, else the machine less headroom: budgets.py);
2. activation checkpointing (auto: only if activations + the smallest streaming window do not fit the device;
   the search then runs again with every unit checkpointed, unless every state fits on the device without, and
   keeps the faster plan, or within 3% of it the smaller);
3. tiling (only if one unit's largest Linear alone leaves no room on the device);
4. prefetch depth (hide one unit's fetch behind the compute of the units before it), staging buffers;
5. states: start on host; promote to the device in priority order while the device budget holds; demote to NVMe
   in reverse priority while host memory does not hold; promote again (a CPU-only machine's shared RAM may have
   room after the NVMe demotion); then the fastest plan, then the smallest (`_rework`): give back what does not
   shorten the step, spend the room on what shortens it most per byte, give back again.
Priority = touches per step: params 2 x accum (3 x with checkpointing), grads accum + 1, master + moments 2.
When nothing fits, `Infeasible` carries the smallest change that does, with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tightfit.errors import UsageError
from tightfit.offload.placement import ROOT_UNIT, Placement, State, Tier
from tightfit.offload.step.units import padded
from tightfit.planner.budgets import Budgets, violations
from tightfit.planner.budgets import device_ok as _device_ok
from tightfit.planner.budgets import host_ok as _host_ok
from tightfit.planner.costs import (
    Prediction,
    TrainShape,
    act_bytes,
    casts_on_device,
    engine_budgets,
    link_time,
    memory,
    predict,
    units_per_window,
)
from tightfit.planner.hardware import HardwareProfile
from tightfit.planner.model_profile import ModelProfile, UnitProfile
from tightfit.planner.naming import CLI, Naming
from tightfit.planner.unit_size import joined_reason, small_block_groups
from tightfit.planner.work import Work
from tightfit.utils.sizes import format_size


def _groups(shape: TrainShape) -> dict[str, tuple[State, ...]]:
    """The states the search moves together. With fp32 compute the master *is* the compute parameters when both
    share a tier (one tensor, [Note: bytes per state] in memory_model.py), so the master follows the parameters:
    moving it apart would add an identical fp32 copy (params on host + master on NVMe: 20 B/param, not 16)."""
    if shape.compute_bytes == 4:
        return {"params": (State.PARAMS, State.MASTER), "grads": (State.GRADS,), "optimizer": (State.OPTIM,)}
    return {"params": (State.PARAMS,), "grads": (State.GRADS,), "optimizer": (State.MASTER, State.OPTIM)}


class Infeasible(UsageError):
    """No placement fits; the message names the smallest change that does."""


class _NoFit(Exception):
    """Internal: the search found no placement within the budgets (`search` turns it into `Infeasible`)."""

    def __init__(self, bad: tuple[str, int, int], profile: ModelProfile, placement: Placement,
                 pred: Prediction) -> None:
        super().__init__(bad[0])
        self.bad, self.profile, self.placement, self.pred = bad, profile, placement, pred


@dataclass
class SearchResult:
    placement: Placement
    prediction: Prediction
    profile: ModelProfile
    """The profile the placement refers to (with tile units when tiling was applied)."""
    reasons: list[str]
    fastest_s: float = 0.0
    """Predicted step of the fullest placement the fill found, before `_trim` gave residency back (0: the placement
    is the fullest)."""

    @property
    def fastest(self) -> float:
        """The fastest this search can do: its fullest placement's step, or the placement's where giving residency
        back made it faster (params back on the host are masters the GPU casts, `Placement.cast_on_device`)."""
        return min(self.fastest_s or self.prediction.step_s, self.prediction.step_s)


def _set(placement: Placement, unit: str, states: tuple[State, ...], tier: Tier) -> Placement:
    up = placement.of(unit)
    kw = {s.value: tier for s in states}
    return placement.with_units(**{unit: replace(up, **kw)})


def _items(profile: ModelProfile, shape: TrainShape, ck: set[str]) -> list[tuple[str, str]]:
    """(unit, group) in priority order: most touched per step first, then execution order."""
    a = shape.passes  # unit-major: a unit's params and gradients cross once a step
    scored = []
    for i, u in enumerate(profile.units):
        scored.append(((3 if u.name in ck else 2) * a, 0, i, u.name, "params"))
        if u.trainable:
            scored.append((a + 1, 1, i, u.name, "grads"))
            scored.append((2, 2, i, u.name, "optimizer"))
    scored.sort(key=lambda x: (-x[0], x[1], x[2]))
    return [(name, group) for *_, name, group in scored]


def fixed(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape, tier: Tier,
          checkpointing: str, label: str, names: Naming = CLI) -> SearchResult:
    """Every state on one tier (--offload device|host|nvme|none): predicted, budgets reported, not enforced. The
    tier is the user's; checkpointing is still the plan's under "auto": every block checkpointed where the
    activations alone would take the device past its budget and checkpointing brings it within (unit-major order's
    activations of every micro-batch at once, which no user placed)."""
    if tier == Tier.NVME and not b.nvme_dir:
        raise UsageError(f"{names.set('offload', 'nvme')}: needs a swap folder, add {names.set('nvme', 'PATH[:SIZE]')}")
    every = [u.name for u in profile.units if u.checkpointable]
    res = _fixed(profile, hw, b, shape, tier, every if checkpointing == "on" else [], label)
    if checkpointing == "auto" and every and not _device_ok(res.prediction, b):
        ck = _fixed(profile, hw, b, shape, tier, every, label)
        if _device_ok(ck.prediction, b):
            act = res.prediction.breakdown["device"]["activations"]
            ck.reasons.insert(1, f"activation checkpointing of {len(every)} unit(s): their activations "
                                 f"({format_size(act)}) do not fit the device beside the rest")
            res = ck
    for t, need, have in violations(res.prediction, b):
        res.reasons.append(f"warning: {t} needs {format_size(need)}, budget {format_size(have)}: this run may not "
                           "fit")
    return res


def _fixed(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape, tier: Tier,
           ck: list[str], label: str) -> SearchResult:
    """`fixed`'s plan with the units `ck` checkpointed."""
    p = Placement.everywhere(tier, checkpoint_units=ck, nvme_dir=b.nvme_dir)
    p = _finish(p, profile, hw, b, shape)
    pred = predict(profile, p, hw, shape)
    reasons = [f"{label}: every state on the {tier.value} tier"]
    found = small_block_groups(p, profile)
    if found is not None:  # every block on one tier: join them as they come (unit_size.py)
        groups, target = found
        reasons.append(joined_reason(profile, groups, target))
        profile = profile.grouped(groups)
        p = _finish(replace(p, min_unit_bytes=target).for_groups(groups), profile, hw, b, shape)
        pred = predict(profile, p, hw, shape)
    res = SearchResult(engine_budgets(p, pred), pred, profile, reasons)
    if _cpu_casts(res, hw, shape):  # who casts the masters is the plan's choice in any mode (decision 8)
        cp = _finish(p, profile, hw, b, shape, Copies(p.land_grads_fp32, cast_on_device=True))
        cpred = predict(profile, cp, hw, shape)
        cast = SearchResult(engine_budgets(cp, cpred), cpred, profile, reasons)
        if _fastest_then_smallest(res, cast, hw) is cast:
            res = _say_cast(cast, res)
    return res


@dataclass(frozen=True)
class Copies:
    """How a plan's copies use the link, which the search does not choose unit by unit: how a step's first gradients
    leave the device (`Placement.land_grads_fp32`) and who casts the masters (`Placement.cast_on_device`)."""

    land_grads_fp32: bool = True
    cast_on_device: bool = False


def _finish(p: Placement, profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape,
            copies: Copies = Copies()) -> Placement:
    """Prefetch depth and budgets of a placement whose tiers are chosen (and how its copies use the link)."""
    p = replace(p, land_grads_fp32=copies.land_grads_fp32, cast_on_device=copies.cast_on_device)
    depth = units_per_window(profile, p, hw, shape)
    return replace(p, prefetch_depth=depth, device_budget=b.device, host_budget=b.host, nvme_dir=b.nvme_dir,
                   nvme_budget=b.nvme if b.nvme_dir else None)


def search(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape,
           checkpointing: str = "auto", names: Naming = CLI, explain: bool = True) -> SearchResult:
    """The fastest placement the budgets allow (see the module docstring for the order of decisions). Raises
    `Infeasible` with the smallest change that fits, each figure found by planning again with it; with `explain`
    false (a candidate whose failure the caller catches, such as unit-major order beside micro-batch-major) only
    with what is short: the smallest change costs dozens of searches (minutes for a 7B of 16 micro-batches)."""
    try:
        return search_fastest(profile, hw, b, shape, checkpointing)
    except _NoFit as nf:
        if not explain:
            tier, need, have = nf.bad
            raise Infeasible(f"needs {format_size(need)} {tier} memory, {format_size(have)} available") from None
        from tightfit.planner.suggest import suggest

        raise Infeasible(suggest(nf, profile, hw, b, shape, checkpointing, names)) from None


def _fits(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape, checkpointing: str) -> bool:
    try:
        _search_units(profile, hw, b, shape, checkpointing)
        return True
    except _NoFit:
        return False


def search_fastest(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape,
                   checkpointing: str) -> SearchResult:
    """The search with how gradients leave the device chosen (`search_fastest_grads`), then, where the CPU's step
    casts masters into host compute copies, again with the GPU casting them instead ([Note: the device casts the
    master] in offload/step/unit.py: the CPU's step casts nothing and the host keeps no compute copy, for 2 bytes a
    parameter more over the link per fetch, so the search may keep more on the device where the link then binds): of
    the two, as of the checkpointing searches, the fastest then smallest. Raises `_NoFit`."""
    res = search_fastest_grads(profile, hw, b, shape, checkpointing)
    if not _cpu_casts(res, hw, shape):
        return res
    try:
        cast = _search_units(profile, hw, b, shape, checkpointing,
                             Copies(res.placement.land_grads_fp32, cast_on_device=True))
    except _NoFit:
        return res
    if _fastest_then_smallest(res, cast, hw) is res:
        return res
    cast.reasons += [r for r in res.reasons if r.startswith(PACKED_GRADS)]  # the choice this search kept
    return _say_cast(cast, res)


def _say_cast(cast: SearchResult, res: SearchResult) -> SearchResult:
    """`cast` (the GPU casting the masters), its reasons saying what that bought against `res` (the CPU's step
    casting them)."""
    cast.reasons = list(cast.reasons)
    what = "masters: uploaded as fp32 and cast to the compute dtype by the GPU, with no compute copy on the host"
    new, old = cast.prediction.step_s, res.prediction.step_s
    saved = res.prediction.peak.get("device", 0) - cast.prediction.peak.get("device", 0)
    if new < old:
        more = f", and {format_size(saved)} less of the GPU's memory" if saved > 0 else ""
        cast.reasons.append(f"{what} ({new * 1e3:.0f} ms per step, against {old * 1e3:.0f} ms with the CPU's step "
                            f"casting them{more})")
    else:
        cast.reasons.append(f"{what}: {format_size(saved)} less of the GPU's memory for a step within "
                            f"{TRIM_TOLERANCE:.0%} of the CPU's step casting them ({new * 1e3:.0f} ms against "
                            f"{old * 1e3:.0f} ms)")
    return cast


def _cpu_casts(res: SearchResult, hw: HardwareProfile, shape: TrainShape) -> bool:
    """Does `res`'s CPU step cast masters into host compute copies that the GPU could cast instead? On a GPU, with a
    compute dtype narrower than fp32, some unit's params and master on the host tier."""
    if not (hw.cuda and shape.engine and shape.compute_bytes < 4) or res.placement.cast_on_device:
        return False
    p = replace(res.placement, cast_on_device=True)
    return any(casts_on_device(u, p, shape) for u in res.profile.units)


PACKED_GRADS = "gradients: a step's first leave the GPU in the compute dtype"
"""How a plan's reasons start the line that says its first gradients leave packed (`search_fastest_grads`)."""


def search_fastest_grads(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape,
                         checkpointing: str) -> SearchResult:
    """The search with a step's first gradients landing as fp32 ([Note: gradients land converted] in
    offload/step/gradients.py), and, where the link is what phase A waits on, again with them packed in the compute
    dtype and widened on the host (half the link's bytes, a pass over host memory more): of the two, as of the two
    checkpointing searches (`_search_units`), the least scarce memory within TRIM_TOLERANCE of the faster's fullest
    plan. Raises `_NoFit`."""
    res = _search_units(profile, hw, b, shape, checkpointing)
    if not _link_binds(res, hw, shape):
        return res
    try:
        packed = _search_units(profile, hw, b, shape, checkpointing, Copies(land_grads_fp32=False))
    except _NoFit:
        return res
    if _fastest_then_smallest(res, packed, hw) is res:
        return res
    packed.reasons.append(f"{PACKED_GRADS} and are widened on the host "
                          f"({packed.prediction.step_s * 1e3:.0f} ms per step, against "
                          f"{res.prediction.step_s * 1e3:.0f} ms landing as fp32: the link is what the step waits on)")
    return packed


def _link_binds(res: SearchResult, hw: HardwareProfile, shape: TrainShape) -> bool:
    """Could gradients packed in the compute dtype shorten `res`'s step? On a GPU, with a compute dtype narrower than
    fp32, gradients leaving the device, and host<->device copies no shorter than the compute in phase A."""
    p, pred = res.placement, res.prediction
    if not (hw.cuda and shape.engine and shape.compute_bytes < 4 and p.land_grads_fp32):
        return False
    if not any(u.trainable and p.of(u.name).grads != Tier.DEVICE for u in res.profile.units):
        return False
    return link_time(pred.traffic, hw) >= pred.compute_s


def _search_units(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape,
                  checkpointing: str, copies: Copies = Copies()) -> SearchResult:
    """The search; with --checkpointing auto, also with every unit checkpointed, keeping the fastest, then within
    TRIM_TOLERANCE of it the smallest device peak (decision 5). Raises `_NoFit` when neither fits.

    Why both: auto checkpoints only as many units as it takes for the activations to fit beside the smallest
    streaming window, which can leave the device full of activations and every state streamed; checkpointing every
    unit frees that room for states that then need no transfer, or whose optimizer runs on the device (the 7B
    Llama on a 24 GiB GPU: 27.7 s -> 22.3 s predicted; a 1.2 B GPT under 12 GiB on an H200, whose activations fit
    without checkpointing: 536 -> 447 ms, docs/PLANNER.md). The greedy fill cannot see that trade, so both are
    searched, unless every state already sits on the device without recomputation."""
    everything = [u.name for u in profile.units if u.checkpointable]
    try:
        res = _search_joined(profile, hw, b, shape, checkpointing, copies)
    except _NoFit:
        if checkpointing != "auto" or not everything:  # no second search to try
            raise
        res = None
    if checkpointing != "auto" or not everything or (
            res is not None and (set(res.placement.checkpoint_units) >= set(everything) or _all_on_device(res))):
        return res
    try:
        alt = _search_joined(profile, hw, b, shape, "on", copies)
    except _NoFit:
        if res is None:
            raise
        return res
    if res is None:
        alt.reasons.insert(0, "activation checkpointing of every unit: the activations do not fit otherwise")
        return alt
    memory, what = _scarce_memory(hw)
    if _fastest_then_smallest(res, alt, hw) is res:
        if res.prediction.step_s < alt.prediction.step_s:
            return res
        res.reasons.insert(0, f"activation checkpointing of {len(res.placement.checkpoint_units)} unit(s), not all: "
                              f"{format_size(memory(res.prediction))} of {what} at "
                              f"{res.prediction.step_s * 1e3:.0f} ms per step, within {TRIM_TOLERANCE:.0%} of all "
                              f"checkpointed ({format_size(memory(alt.prediction))}, "
                              f"{alt.prediction.step_s * 1e3:.0f} ms)")
        return res
    why = ("its room on the device holds states instead" if alt.prediction.step_s < res.prediction.step_s else
           f"less {what} within {TRIM_TOLERANCE:.0%} of the fastest plan's step")
    alt.reasons.insert(0, f"activation checkpointing of every unit: {why} ({res.prediction.step_s * 1e3:.0f} ms per "
                          f"step and {format_size(memory(res.prediction))} of {what} with "
                          f"{len(res.placement.checkpoint_units)} checkpointed, {alt.prediction.step_s * 1e3:.0f} ms "
                          f"and {format_size(memory(alt.prediction))} with all)")
    return alt


def _fastest_then_smallest(a: SearchResult, b: SearchResult, hw: HardwareProfile) -> SearchResult:
    """Of two searches' plans (decision 5): the least scarce memory among those within TRIM_TOLERANCE of the faster
    search's fullest plan, or the faster where neither is. A plan is compared with the faster fullest plan, not
    with its own (each search's trim already spent up to TRIM_TOLERANCE of its own)."""
    fastest = min(a.fastest, b.fastest)
    within = [r for r in (a, b) if r.prediction.step_s <= fastest * (1 + TRIM_TOLERANCE)]
    within = within or [min((a, b), key=lambda r: r.prediction.step_s)]
    memory, _ = _scarce_memory(hw)
    return min(within, key=lambda r: (memory(r.prediction), r.prediction.step_s))


def _scarce_memory(hw: HardwareProfile):
    """(prediction -> bytes, its name): what "the smallest plan" saves. A GPU's memory where the device is one; on
    a CPU-only machine the device tier is the same RAM as the host tier, so the process's RSS: a plan that keeps
    less on the device tier but more on the host saves nothing there."""
    if hw.cuda:
        return (lambda pred: pred.peak.get("device", 0)), "device"
    return (lambda pred: pred.rss(False)), "RAM"


def _all_on_device(res: SearchResult) -> bool:
    """Every state of every unit on the device tier and nothing recomputed: no plan is faster."""
    p = res.placement
    return not p.checkpoint_units and all(p.of(u.name).tier(s) == Tier.DEVICE for u in res.profile.units
                                          for s in State)


def _search_joined(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape,
                   checkpointing: str, copies: Copies = Copies()) -> SearchResult:
    """The search, run again with small blocks joined into larger units when the first answer puts them on NVMe
    (unit_size.py). Raises `_NoFit`."""
    res = _search(profile, hw, b, shape, checkpointing, copies)
    found = small_block_groups(res.placement, res.profile)
    if found is None:
        return res
    groups, target = found
    grouped = profile.grouped(groups)
    # Joined units must fit with 2 of their parameters and gradients of host memory left over: the memory benchmark
    # with joined pairs under a small budget measured 1.116x budget + overhead, and 1.002x once a retained staging
    # buffer was fixed, where one block per unit stayed at 0.97 (benchmarks/RESULTS.md, "Batch H").
    margin = 2 * max(4 * (u.numel + u.trainable) for u in grouped.units if u.name != ROOT_UNIT)
    try:
        joined = _search(grouped, hw, replace(b, host=b.host - margin), shape, checkpointing, copies)
    except _NoFit:
        joined = None
    if joined is None or not joined.placement.uses(Tier.NVME) or joined.placement.tiled_linears:
        res.reasons.append(f"units: one block each; joining them into units of {format_size(target)} for larger "
                           "NVMe transfers would exceed a budget")
        return res
    joined.placement = replace(joined.placement, min_unit_bytes=target)
    joined.reasons.append(joined_reason(profile, groups, target))
    return joined


def _search(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape,
            checkpointing: str, copies: Copies = Copies()) -> SearchResult:
    reasons: list[str] = []
    ckable = sorted((u for u in profile.units if u.checkpointable), key=lambda u: u.act_input - u.act_saved)
    ck: set[str] = {u.name for u in ckable} if checkpointing == "on" else set()

    everything = _finish(Placement.everywhere(Tier.DEVICE, checkpoint_units=sorted(ck)), profile, hw, b, shape,
                         copies)
    pred = predict(profile, everything, hw, shape)
    if not violations(pred, b):
        reasons.append("everything fits on the device tier: no offload")
        return SearchResult(engine_budgets(everything, pred), pred, profile, reasons)

    dev_room = b.device if b.device is not None else b.host
    stream_min = _min_streaming(profile, shape)
    m = shape.resident_micro_batches
    if checkpointing == "auto":
        for u in ckable:
            if act_bytes(profile, ck, m, shape.boundaries_on_host) + stream_min <= dev_room:
                break
            ck.add(u.name)
        if ck:
            held = f"{m} micro-batches' " if m > 1 else ""
            reasons.append(f"activation checkpointing of {len(ck)} unit(s): {held}activations of all units "
                           f"({format_size(act_bytes(profile, set(), m, shape.boundaries_on_host))}) do not fit "
                           "beside the streaming window")
    profile, tiled = _tile(profile, shape, dev_room - act_bytes(profile, ck, m, shape.boundaries_on_host),
                           reasons)

    p = Placement.everywhere(Tier.HOST, checkpoint_units=sorted(ck), tiled_linears=tiled)
    p = _finish(p, profile, hw, b, shape, copies)
    items = _items(profile, shape, ck)
    groups = _groups(shape)
    p = _promote(p, items, groups, profile, hw, b, shape)
    p = _demote(p, items, groups, profile, hw, b, shape)
    p = _promote(p, items, groups, profile, hw, b, shape)
    fullest = predict(profile, p, hw, shape)
    p, pred, best = _rework(p, fullest, items, groups, profile, hw, b, shape, reasons)
    while violations(pred, b) and p.prefetch_depth > 1:  # a shallower window may be what makes it fit
        p = replace(p, prefetch_depth=p.prefetch_depth - 1)
        pred = predict(profile, p, hw, shape)
    bad = violations(pred, b)
    if bad:
        raise _NoFit(bad[0], profile, p, pred)
    reasons += _explain(profile, p, groups, shape)
    # A tiled placement keeps each tile's own entry: `tile_as_planned` makes every tile a unit, and
    # `Placement.for_units` gives a tile its own entry before its block's (without one it would take the block's
    # tiers: a block whose few untiled parameters the search left on the device took all its tiles there, and the
    # engine refused the plan's device budget at wrap time).
    if tiled:
        p = p.with_units(**{u.name: p.of(u.name) for u in profile.units if ".tiles." in u.name})
    fastest = best.step_s if not violations(fullest, b) else 0.0
    return SearchResult(engine_budgets(p, pred), pred, profile, reasons, fastest)


def _min_streaming(profile: ModelProfile, shape: TrainShape) -> int:
    """Device bytes of the smallest streaming schedule (prefetch depth 1, see costs.memory): the root, three blocks'
    parameters (previous, running, prefetched) and unshipped gradients of the root and two blocks."""
    c = shape.compute_bytes
    root = sum(u.numel for u in profile.units if u.name == ROOT_UNIT)
    root_g = sum(u.trainable for u in profile.units if u.name == ROOT_UNIT)
    block = max((u.numel for u in profile.units if u.name != ROOT_UNIT), default=0)
    block_g = max((u.trainable for u in profile.units if u.name != ROOT_UNIT), default=0)
    g = c + (4 if shape.unit_major and c < 4 else 0)  # with a pass's fp32 sums (memory_model.autograd_grad_bytes)
    return (root + 3 * block) * c + (root_g + 2 * block_g) * g


def _promote(p, items, groups, profile, hw, b, shape) -> Placement:
    for unit, group in items:
        up = p.of(unit)
        states = groups[group]
        if up.tier(states[0]) == Tier.DEVICE:
            continue
        if group == "optimizer" and (up.grads != Tier.DEVICE or (State.MASTER not in states
                                                                 and up.master != Tier.DEVICE)):
            continue  # the device optimizer needs this unit's gradients (and master) on the device too
        trial = _set(p, unit, states, Tier.DEVICE)
        if _device_ok(predict_mem(profile, trial, hw, shape), b):
            p = trial
    return p


def _demote(p, items, groups, profile, hw, b, shape) -> Placement:
    pred = predict_mem(profile, p, hw, shape)
    if _host_ok(pred, b) or not b.nvme_dir:
        return p
    for unit, group in reversed(items):
        up = p.of(unit)
        if up.tier(groups[group][0]) != Tier.HOST:
            continue
        p = _set(p, unit, groups[group], Tier.NVME)
        pred = predict_mem(profile, p, hw, shape)
        if _host_ok(pred, b):
            break
    return p


TRIM_TOLERANCE = 0.03
"""Device residency that makes the predicted step faster by less than this fraction is given back."""
REFILL_GAIN = 0.002
"""A refill move is made only where it shortens the predicted step by more than this fraction."""
REFILL_BUNDLES = (("params", "grads", "optimizer"), ("params",), ("grads",))
"""What one refill move promotes of a unit: the whole unit (its optimizer then steps on the device), its params, or
its gradients. The optimizer goes to the device only with the whole unit: its step then needs no copy either way,
where one with the compute copy in host memory would send the new params down the link each step."""


def _rework(p: Placement, fullest: Prediction, items, groups, profile, hw, b, shape,
            reasons: list[str]) -> tuple[Placement, Prediction, Prediction]:
    """The fastest plan, then the smallest (decision 5): the fill's residency given back where it does not shorten
    the step (`_trim`), the room spent on the states that do (`_refill`), then given back again where the refill
    made earlier residency useless. Returns the placement, its prediction and the fastest plan seen; one reason
    says what this did to the fill's plan."""
    p, pred, best = _trim(p, fullest, fullest, items, groups, profile, hw, b, shape)
    trimmed = pred
    p, pred, moves = _refill(p, pred, profile, hw, b, shape, groups)
    if moves:
        p, pred, best = _trim(p, pred, min(best, pred, key=lambda x: x.step_s), items, groups, profile, hw, b,
                              shape)

    def dev(x: Prediction) -> str:
        return format_size(x.peak.get("device", 0))

    saved = fullest.peak.get("device", 0) - pred.peak.get("device", 0)
    if pred.step_s < trimmed.step_s * (1 - REFILL_GAIN):
        reasons.append(f"device: {pred.step_s * 1e3:.0f} ms in {dev(pred)}, against the fill's "
                       f"{fullest.step_s * 1e3:.0f} ms in {dev(fullest)} (bound by {fullest.bottleneck}): what did "
                       f"not shorten the step given back ({trimmed.step_s * 1e3:.0f} ms in {dev(trimmed)}), then "
                       f"the room spent a unit's states at a time on what shortened it most per byte "
                       f"(bound by {pred.bottleneck})")
    elif saved > 0 and best is fullest:
        reasons.append(f"device: {format_size(saved)} less than the fullest plan, for a predicted step within "
                       f"{TRIM_TOLERANCE:.0%} of its {fullest.step_s * 1e3:.0f} ms (bound by {fullest.bottleneck}: "
                       "more residency would not shorten it)")
    elif saved > 0:
        reasons.append(f"device: {format_size(saved)} less than the fullest plan, which is slower "
                       f"({fullest.step_s * 1e3:.0f} ms, bound by {fullest.bottleneck}), for a predicted step within "
                       f"{TRIM_TOLERANCE:.0%} of the fastest found ({best.step_s * 1e3:.0f} ms)")
    return p, pred, best


def _trim(p, pred: Prediction, fastest: Prediction, items, groups, profile, hw, b,
          shape) -> tuple[Placement, Prediction, Prediction]:
    """Give back, least touched first, every device-resident group whose return to host memory keeps the predicted
    step within TRIM_TOLERANCE of the fastest seen (`fastest`: the fill's own prediction, or a faster plan the walk
    found) and the plan within its budgets (`pred`: `p`'s prediction): the fill promotes whatever fits, also where
    the step is bound by something device residency does not shorten (the CPU optimizer, the disk). Returns the
    placement, its prediction and the fastest plan's.

    Giving residency back can make a step faster: params returned to the host are masters the GPU casts
    (`Placement.cast_on_device`), which takes their cast off the CPU's step, until the link binds. So the tolerance
    is measured from the fastest plan seen so far; every accepted plan is within it of the fastest accepted one."""
    if fastest.step_s <= 0 or violations(fastest, b):
        return p, pred, fastest
    best, after = fastest, pred
    for unit, group in reversed(items):
        up = p.of(unit)
        states = groups[group]
        if up.tier(states[0]) != Tier.DEVICE:
            continue
        if group != "optimizer" and up.optim == Tier.DEVICE:
            continue  # the device optimizer needs this unit's gradients (and master) on the device
        trial = _set(p, unit, states, Tier.HOST)
        t = predict(profile, trial, hw, shape)
        if t.step_s <= best.step_s * (1 + TRIM_TOLERANCE) and not violations(t, b):
            p, after = trial, t
            best = min(best, t, key=lambda x: x.step_s)
    return p, after, best


def _refill(p: Placement, pred: Prediction, profile, hw, b, shape, groups) -> tuple[Placement, Prediction, int]:
    """Device room spent on the states that shorten the step ([Note: refill]): each move promotes, of the first
    unit that has them off the device, one of REFILL_BUNDLES, the one that shortens the predicted step most per
    byte of device peak it adds, while one shortens it by more than REFILL_GAIN and the plan stays within its
    budgets. Returns the placement, its prediction and the number of moves.

    [Note: refill] The fill promotes in order of touches per step (params before gradients before the optimizer),
    which saves link bytes. Where the CPU's optimizer bounds the step, link bytes buy nothing and a unit's optimizer
    on the device is what shortens it; the fill never gets there, its room spent on parameters, which the trim then
    gives back (a 1.2 B GPT under 8 GiB on the H200's figures: the fill's 25 units' params on the device, 892 ms;
    trimmed, 787 ms and the room empty; refilled and trimmed again, 7 units whole on the device, 560 ms). Units of one kind are alike,
    so a move looks at the first unit that can take each bundle: a few predictions a move."""
    moves = 0
    trainable = {u.name for u in profile.units if u.trainable}
    while True:
        best = None
        for bundle in REFILL_BUNDLES:
            for u in profile.units:
                if u.name not in trainable and bundle != ("params",):
                    continue
                up = p.of(u.name)
                states = tuple(s for g in bundle for s in groups[g] if up.tier(s) != Tier.DEVICE)
                if not states or ("optimizer" not in bundle and up.optim == Tier.DEVICE):
                    continue
                trial = _set(p, u.name, states, Tier.DEVICE)
                t = predict(profile, trial, hw, shape)
                gain = (pred.step_s - t.step_s) / max(1, t.peak.get("device", 0) - pred.peak.get("device", 0))
                if t.step_s < pred.step_s * (1 - REFILL_GAIN) and not violations(t, b) and (
                        best is None or gain > best[0]):
                    best = (gain, trial, t)
                break
        if best is None:
            return p, pred, moves
        _, p, pred = best
        moves += 1


def predict_mem(profile, p, hw, shape) -> Prediction:
    return memory(profile, p, hw, shape, Prediction())


MAX_TILES = 256
"""The most tiles one Linear is split into; a plan that needs more does not tile it (and does not fit)."""


def _tile(profile: ModelProfile, shape: TrainShape, room: int, reasons: list[str]):
    """Split the Linears of units too large to stream through `room` device bytes; tiles become units."""
    if _min_streaming(profile, shape) <= room:
        return profile, {}
    if room <= 0:
        # Activations alone exceed the device: no tiling fits (and tiles of 1 byte would be millions of units,
        # which made the search for a refusal's figure, [Note: true figures] in suggest.py, run for minutes).
        return profile, {}
    from tightfit.tiling import plan_tiles
    from tightfit.tiling.linear import split_sizes

    # Three tiles resident (previous, running, prefetched), two with their gradients; plan_tiles' byte limit
    # covers one tile's parameters + gradient.
    max_tile = max(1, room // 3)
    units: list[UnitProfile] = []
    tiled: dict[str, int] = {}
    for u in profile.units:
        if 2 * u.numel * shape.compute_bytes <= max_tile or not u.linears or u.name == ROOT_UNIT:
            units.append(u)
            continue
        rest_numel, tiles = u.numel, []
        for path, in_f, out_f in u.linears:
            try:
                in_s, out_s = plan_tiles(in_f, out_f, shape.compute_bytes, max_tile)
            except UsageError:
                continue
            n = max(1, in_s * out_s)
            if n > MAX_TILES:
                continue  # a room this small fits no sensible split: each tile is a transfer and a kernel launch
            if n == 1 and 2 * rest_numel * shape.compute_bytes <= max_tile:
                break  # what is left of the unit fits as one piece
            tiled[path] = n
            # The engine's flat sizes, padding included. The profile does not say whether the Linear has a bias:
            # counting one errs on the large side (a budget a little above what the engine holds, never below).
            rows, cols = split_sizes(out_f, out_s), split_sizes(in_f, in_s)
            rest_numel -= padded(in_f * out_f) + padded(out_f)
            sizes = [padded(r * c) + (padded(r) if i == 0 else 0) for r in rows for i, c in enumerate(cols)]
            tiles += [UnitProfile(f"{path}.tiles.{k}", numel, numel, None, 0, 0, Work(), Work(),
                                  checkpointable=False) for k, numel in enumerate(sizes)]
            reasons.append(f"tiling {path} ({in_f}x{out_f}) into {n} tile(s): unit {u.name} "
                           f"({format_size(u.numel * shape.compute_bytes)}) does not fit the device window")
        trainable = max(0, u.trainable - (u.numel - rest_numel))
        units.append(replace(u, numel=rest_numel, trainable=trainable))
        units += tiles
    return replace(profile, units=units), tiled


def _explain(profile: ModelProfile, p: Placement, groups: dict[str, tuple[State, ...]],
             shape: TrainShape) -> list[str]:
    out = []
    for group, states in groups.items():
        tiers: dict[str, int] = {}
        for u in profile.units:
            if group != "params" and not u.trainable:
                continue
            t = p.of(u.name).tier(states[0]).value
            tiers[t] = tiers.get(t, 0) + 1
        label = " + ".join("optimizer" if s is State.OPTIM else s.value for s in states)
        out.append(f"{label}: " + ", ".join(f"{n} unit(s) on {t}" for t, n in tiers.items()))
    summed = sum(u.trainable for u in profile.units if u.trainable and p.of(u.name).grads == Tier.DEVICE)
    if shape.grad_accum > 1 and not shape.unit_major and summed and not all(
            p.of(u.name).optim == Tier.DEVICE for u in profile.units if u.trainable):
        share = summed / max(1, sum(u.trainable for u in profile.units))
        out.append(f"gradients on the device ({share:.0%} of them): the {shape.grad_accum} micro-batches are summed "
                   "there in fp32 and leave once a step, for the optimizer on the host")
    if any(p.of(u.name).params != Tier.DEVICE for u in profile.units):
        out.append(f"prefetch depth {p.prefetch_depth}: hides one unit's fetch behind the compute before it")
    return out
