"""What to change when no placement fits: the one-line message of `Infeasible`, with figures that fit.

Why apart from the search: the search decides placements; this module asks it again with other budgets, another
micro-batch or checkpointing on, to find the smallest change that fits, and words it in the caller's `Naming`.

[Note: true figures] Every figure a message suggests is one the planner was run with and found to fit. The
shortfall of the failed search is no such figure: its checkpointing, tiling, prefetch depth and pool were chosen
for the budget that failed, and a larger budget makes other choices (fewer checkpointed units, a deeper window, a
larger pool), so "needs X" read off the failed plan understated what a second run asked for (14.5 MiB -> "needs
15.0 MiB", which then asked for 15.3 MiB), and on a CPU-only machine it left out the process floor that --cpu-mem
includes. Here the budget is searched instead: doubled until the planner fits, then bisected to 1/1000 of the
figure, and printed rounded up.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tightfit.planner.budgets import Budgets, host_side, with_given
from tightfit.planner.costs import TrainShape
from tightfit.planner.hardware import HardwareProfile
from tightfit.planner.model_profile import ModelProfile
from tightfit.planner.naming import Naming
from tightfit.planner.search import _fits, _NoFit, _search_units, search_fastest
from tightfit.utils.sizes import format_size, parse_size

def _round_up_text(n: int) -> str:
    """`format_size(n)`, rounded up at its printed precision so that the printed figure is at least `n`."""
    text = format_size(n)
    while parse_size(text) < n:
        value, unit = text.split()
        text = f"{float(value) + 0.1:.1f} {unit}"
    return text


def _smallest(fits, lo: int, hi: int) -> int | None:
    """The smallest figure in (lo, ...] for which `fits` holds, to 1/1000 (`lo` is known not to fit); None when
    nothing up to 2^60 bytes fits."""
    hi = max(hi, lo + 1, 1 << 20)
    while not fits(hi):
        if hi > 1 << 60:
            return None
        lo, hi = hi, hi * 2
    while hi - lo > max(hi // 1000, 1 << 12):
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    # Printed rounded up: make sure the printed figure itself fits.
    for _ in range(20):
        if fits(parse_size(_round_up_text(hi))):
            return parse_size(_round_up_text(hi))
        hi = parse_size(_round_up_text(hi)) + (1 << 12)
    return None


def _figure(key: str, profile, hw, b, shape, ck, names) -> int | None:
    """The smallest value of the byte setting `key` ("gpu_mem", "cpu_mem", "nvme") with which the planner fits."""
    now = b.given.get(key)
    if now is None:
        now = {"gpu_mem": b.device or 0, "cpu_mem": b.host, "nvme": b.nvme}[key]
    return _smallest(lambda v: _fits(profile, hw, with_given(b, hw, names, key, v), shape, ck), now, 2 * now)


def _largest_micro_batch(profile: ModelProfile, hw, b, shape, ck) -> int | None:
    """The largest micro-batch below the profile's with which the planner fits (activations and work scale with
    it), or None."""
    def fits(mb: int) -> bool:
        return _fits(profile.with_micro_batch(mb), hw, b, replace(shape, tokens_per_micro=mb * profile.seq_len), ck)

    lo, hi = 1, profile.micro_batch - 1
    if hi < 1 or not fits(1):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def suggest(nf: _NoFit, profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape,
             checkpointing: str, names: Naming) -> str:
    """One line: what is short, by how much, and the smallest changes that fit ([Note: true figures])."""
    tier, need, have = nf.bad
    pred, p = nf.pred, nf.placement
    if tier == "device" or (tier == "host" and b.shared and not b.nvme_dir and
                            pred.breakdown["device"]["activations"] > have):
        key = "cpu_mem" if b.shared else "gpu_mem"
        figure = _figure(key, profile, hw, b, shape, checkpointing, names)
        if figure is not None:  # the figures of the plan that fits, not of the one that failed
            fits = with_given(b, hw, names, key, figure)
            pred = _search_units(profile, hw, fits, shape, checkpointing).prediction
            need = pred.peak["device"] + (host_side(pred, fits) if b.shared else 0)
        act = pred.breakdown["device"]["activations"]
        batch = names.set("micro_batch", profile.micro_batch)
        msg = (f"needs {format_size(need)} device memory (activations of {batch}: {format_size(act)}, "
               f"everything else: {format_size(need - act)}), {format_size(have)} available")
        if b.shared:
            msg += f" ({names.of('cpu_mem')} bounds the whole process: the process floor " \
                   f"{format_size(hw.runtime_rss)} comes out of it)"
        options = []
        mb = _largest_micro_batch(profile, hw, b, shape, checkpointing)
        if mb is not None:
            accum = math.ceil(shape.grad_accum * profile.micro_batch / mb)
            options.append(names.join(names.set("micro_batch", mb), names.set("grad_accum", accum)))
        if not p.checkpoint_units and checkpointing != "on" and _fits(profile, hw, b, shape, "on"):
            options.append(names.set("checkpointing", "on"))
        if figure is not None:
            options.append(names.set(key, _round_up_text(figure)))
        return msg + (": use " + ", or ".join(options) if options else ": no budget fits this model and shape")
    if tier == "host":
        figure = _figure("cpu_mem", profile, hw, b, shape, checkpointing, names)
        if figure is not None:  # the figures of the plan that fits, not of the one that failed
            fits = with_given(b, hw, names, "cpu_mem", figure)
            pred = _search_units(profile, hw, fits, shape, checkpointing).prediction
            need = host_side(pred, fits) + (pred.peak["device"] if b.shared else 0)
        msg = f"needs {format_size(need)} host memory, {format_size(have)} available"
        more = "" if figure is None else f" ({format_size(fits.host - b.host)} more)"
        raise_to = "" if figure is None else names.set("cpu_mem", _round_up_text(figure))
        if not b.nvme_dir:
            spill = _nvme_need(profile, hw, b, shape, checkpointing)
            return (msg + f": add {names.set('nvme', 'PATH')} with {_round_up_text(spill)} free"
                    + (f", or {raise_to}{more}" if raise_to and b.given.get("cpu_mem") is not None else "")
                    + (f", or free RAM{more}" if raise_to and b.given.get("cpu_mem") is None else ""))
        if not raise_to:
            return msg + f" even with the NVMe tier: no {names.of('cpu_mem')} fits this model and shape"
        if b.given.get("cpu_mem") is None:
            return msg + f" even with the NVMe tier: free RAM{more}, or give {raise_to}"
        return msg + f" even with the NVMe tier: use {raise_to}{more}"
    figure = _figure("nvme", profile, hw, b, shape, checkpointing, names)
    size = _round_up_text(figure if figure is not None else need)
    return (f"needs {size} on the NVMe tier ({b.nvme_dir}), {format_size(have)} allowed: point "
            f"{names.of('nvme')} at a disk with {size} free, or raise its SIZE")


def _nvme_need(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape, checkpointing: str) -> int:
    """Swap space the plan would use if an unlimited NVMe tier were added (with the caller's checkpointing: with
    another, the plan may need no swap at all)."""
    trial = replace(b, nvme=1 << 62, nvme_dir=b.nvme_dir or "<nvme>")
    try:
        return _search_units(profile, hw, trial, shape, checkpointing).prediction.peak["nvme"]
    except _NoFit:
        return sum(u.trainable * 16 + u.numel * shape.compute_bytes for u in profile.units)


def _ms(seconds: float) -> str:
    """Milliseconds to three significant figures or the whole number (12.3, 1.25, 22802)."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def what_more_buys(profile: ModelProfile, hw: HardwareProfile, b: Budgets, shape: TrainShape, checkpointing: str,
                   names: Naming, step_s: float, bottleneck: str) -> str | None:
    """One line for a plan that fits: what twice the GPU memory, and twice the host memory, would make of the
    predicted step, each planned again with that figure ([Note: true figures]). None when neither can be planned."""
    out = []
    for key, tier in ((("gpu_mem", "GPU"),) if not b.shared else ()) + (("cpu_mem", "host"),):
        now = b.given.get(key)
        if now is None:
            now = b.device if key == "gpu_mem" else b.host + (0 if hw.cuda else hw.runtime_rss)
        if not now:
            continue
        try:
            more = search_fastest(profile, hw, with_given(b, hw, names, key, 2 * now), shape, checkpointing)
        except _NoFit:
            continue
        t = more.prediction.step_s
        if t < step_s * 0.97:
            out.append(f"2x the {tier} memory ({names.set(key, _round_up_text(2 * now))}): {_ms(step_s)} -> "
                       f"{_ms(t)} ms")
        else:
            out.append(f"2x the {tier} memory: no faster")
    if not out:
        return None
    return f"what more memory buys (the step is bound by {bottleneck}): " + "; ".join(out)
