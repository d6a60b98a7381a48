"""What the engine reports about itself: its timers, its counters and its memory, per tier and per unit.

Why apart from the engine: these read the engine's collaborators (the timers, the mover's and the disk's byte
counts, the meter, the pool, the stores) and decide nothing; the engine's `timings`, `counters` and `memory_report`
are these functions.
"""

from __future__ import annotations

from tightfit.offload.memory_model import state_bytes
from tightfit.offload.placement import State, Tier
from tightfit.offload.step.unit import PARAMS, OffloadUnit


def timings(engine) -> dict:
    """Amounts accumulated since the last `reset_timings`: forward_s, backward_s (wall), params_wait_s (the main
    thread blocked on parameter fetches), grad_wait_s (grad worker waiting for copies off the device and a unit's
    earlier micro-batch), grad_accumulate_s (grad worker adding and writing), optimizer_s (step compute),
    optimizer_io_wait_s (step blocked on loads), optimizer_wall_s (the step thread's time in steps),
    optimizer_exposed_s and step_grads_wait_s (the main thread waiting for a unit's step, and before it for its
    gradients); plus the disk store's stats ("nvme")."""
    out: dict = engine.timers.snapshot()
    if Tier.NVME in engine.stores:
        out["nvme"] = engine.stores[Tier.NVME].stats()
    return out


def counters(engine) -> dict[str, float]:
    """What the engine moved and spent since it was built ([Note: engine counters] in docs/ENGINE.md); a loop takes
    differences around a step. h2d_bytes / d2h_bytes: copies between host and device memory (the mover's: fetches,
    uploads, gradient packs and sums, device-tier states of a CPU step); host_grad_bytes: gradient bytes the host's
    cores read or wrote (the gradient worker's sums and norms, norms on demand, the CPU step's clip multiply and
    AdamW's read); nvme_read_bytes / nvme_write_bytes: the swap files'; optimizer_s: the optimizer's time, its steps
    from start to end (their loads, AdamW, the write-backs started: the step thread's `optimizer_wall_s`);
    optimizer_exposed_s: the part of it the thread running forward and backward waited for; micro_batches:
    forwards under grad."""
    t = engine.timers.totals()
    out = {"h2d_bytes": float(engine.mover.stats["bytes_to_device"]),
           "d2h_bytes": float(engine.mover.stats["bytes_to_host"]),
           "host_grad_bytes": t.get("host_grad_bytes", 0.0), "nvme_read_bytes": 0.0, "nvme_write_bytes": 0.0,
           "optimizer_s": t.get("optimizer_wall_s", 0.0),
           "optimizer_exposed_s": t.get("optimizer_exposed_s", 0.0),
           "micro_batches": t.get("micro_batches", 0.0)}
    if Tier.NVME in engine.stores:
        disk = engine.stores[Tier.NVME].stats()
        out["nvme_read_bytes"], out["nvme_write_bytes"] = float(disk["bytes_read"]), float(disk["bytes_written"])
    return out


def memory_report(engine) -> dict:
    """Bytes per tier (in use and peak) and, per unit, bytes and placement of each state."""
    disk = engine.stores.get(Tier.NVME)
    p = engine.placement
    return {
        "device": {"in_use": engine.device_in_use, "peak": engine.device_peak, "budget": p.device_budget},
        "host": {"tier": engine.stores[Tier.HOST].bytes, "staging": engine.pool.bytes,
                 "staging_peak": engine.pool.peak, "budget": p.host_budget,
                 "boundaries": engine.boundaries.bytes if engine.boundaries is not None else 0},
        "nvme": {"bytes": disk.disk_bytes if disk else 0, "budget": p.nvme_budget},
        "units": {u.name: unit_report(u) for u in engine.units.values()},
    }


def unit_report(unit: OffloadUnit) -> dict:
    """One unit's elements, and each state's tier, where it is now and its bytes."""
    c = unit.compute_dtype.itemsize
    sizes = {State.PARAMS: unit.compute_bytes,
             State.MASTER: 0 if unit.master_entry == PARAMS else 4 * unit.master_numel,
             **{s: state_bytes(unit.size, s, unit.placement, c) for s in (State.GRADS, State.OPTIM)}}
    return {"numel": unit.spec.numel, "trainable_numel": unit.spec.train_numel,
            "states": {s.value: {"tier": unit.placement.tier(s).value, "where": unit.where[s].value,
                                 "bytes": sizes[s]} for s in State}}
