"""The picture of a plan: a simulated step as a Chrome trace (opens in Perfetto) and a memory-per-tier timeline.

Why simulate: a user asking "why is my step slow?" needs to see which stream is busy and which waits, before
spending GPU hours. The plan's costs give each operation's duration; this file schedules them on their resources
with the engine's dependencies (a unit computes after its parameters arrived; a fetch starts when the window has
room; gradients leave after the unit's backward; the optimizer updates a unit after its states were read) and
records what each tier holds over time. The simulation is a picture of the plan; the plan's step time comes from
the analytic model in `costs.py` (the two agree within the exposed latencies the analytic model approximates).

Resources: on CUDA the GPU, the two PCIe directions, the disk and the CPU (optimizer) run concurrently; on a
CPU-only machine compute, copies and the optimizer share one "cpu" resource and only the disk runs beside it.

Files written to the folder: `plan_trace.json` (Chrome trace events), `memory_timeline.json` (time, bytes per
tier), and, when matplotlib is installed (`pip install tightfit[plot]`), `memory_timeline.png` and `plan.png` (the
placement: each unit's four states coloured by tier, its size, which units are checkpointed or tiled). Measured
engine events, when given, are added to the trace as a second process so prediction and measurement sit side by
side; `tightfit train --profile DIR` writes a torch.profiler trace of real steps beside these files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tightfit.offload.placement import ROOT_UNIT, State, Tier
from tightfit.planner.costs import (
    fetch_bytes,
    grads_off_bytes,
    host_pass_rate,
    kept_for_backward,
    last_gradient_pass,
    micro_pass_bytes,
    steps_under_backward,
    unit_pass_bytes,
    unit_pass_host_time,
    work_time,
)
from tightfit.planner.plan import TIERS, Plan


@dataclass
class Timeline:
    """A simulated step: trace events and memory samples."""

    events: list[dict] = field(default_factory=list)
    """Chrome "X" events: name, track, start and duration in microseconds."""
    memory: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    """(time in seconds, bytes per tier) after each change."""
    step_s: float = 0.0


class _Sim:
    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        cuda = plan.hardware.cuda
        # Track name -> resource it occupies. Tracks sharing a resource never overlap.
        self.resource = {"compute": "gpu" if cuda else "cpu", "host->device": "h2d" if cuda else "cpu",
                         "device->host": "d2h" if cuda else "cpu", "nvme read": "disk", "nvme write": "disk",
                         "optimizer": "cpu", "gradient worker": "cpu-grads" if cuda else "cpu"}
        self.free_at: dict[str, float] = {}
        self.tl = Timeline()
        self.mem = {t: 0 for t in TIERS}

    def run(self, track: str, name: str, dur: float, after: float = 0.0) -> float:
        """Schedule `dur` seconds on `track` no earlier than `after`; returns the end time."""
        res = self.resource[track]
        start = max(after, self.free_at.get(res, 0.0))
        end = start + dur
        self.free_at[res] = end
        if dur > 0:
            self.tl.events.append({"name": name, "ph": "X", "pid": 1, "tid": track, "ts": start * 1e6,
                                   "dur": dur * 1e6, "cat": track})
        return end

    def change(self, t: float, tier: str, delta: int) -> None:
        self.mem[tier] += delta
        self.tl.memory.append((t, dict(self.mem)))


def simulate(plan: Plan) -> Timeline:
    """Schedule one optimizer step of `plan` (all micro-batches, then the optimizer)."""
    p, hw, prof, shape = plan.placement, plan.hardware, plan.profile, plan.shape
    sim = _Sim(plan)
    streamed = {u.name for u in prof.units if p.of(u.name).params != Tier.DEVICE}
    kept = kept_for_backward(prof, p) & streamed  # fetched once a micro-batch: their forward's copy stays
    resident = plan.tier_bytes()
    for t in TIERS:
        sim.change(0.0, t, resident[t])
    sim.change(0.0, "host", sum(v for k, v in plan.prediction.breakdown.get("host", {}).items() if k != "states"))
    ck = set(p.checkpoint_units)
    units = prof.units
    t_done = 0.0
    grads_ready: dict[str, float] = {}  # unit -> its gradients of the last micro-batch complete on their tier
    landed: dict[str, float] = {}  # unit -> its gradients of the last micro-batch on the host, before their sum

    def hooks(u) -> float:  # the engine's host time for the unit in a pass, half in each direction
        return unit_pass_host_time(hw, shape, u.name in streamed) / 2

    # Unit-major order (offload/step/unit_major.py): one pass, each unit computing every micro-batch with its params
    # fetched once and its gradients leaving once; micro-batch-major order: one pass per micro-batch.
    passes, scale = (1, shape.grad_accum) if shape.unit_major else (shape.grad_accum, 1)
    for micro in range(passes):
        # Forward: fetch unit i when unit i - depth - 1 has released its window slot.
        released: list[float] = []
        for i, u in enumerate(units):
            pbytes, moved = u.numel * shape.compute_bytes, fetch_bytes(u, plan.placement, shape)
            ready = t_done
            if u.name in streamed:
                slot = released[i - p.prefetch_depth - 1] if i > p.prefetch_depth else 0.0
                if p.of(u.name).params == Tier.NVME:
                    slot = sim.run("nvme read", f"read {u.name} params", pbytes / hw.nvme_read_bw, slot)
                ready = sim.run("host->device", f"fetch {u.name}", moved / hw.h2d_bw, slot)
                sim.change(ready, "device", pbytes)
            end = sim.run("compute", f"fwd {u.name}", scale * work_time(u.fwd, hw) + hooks(u), ready)
            saved = scale * (u.act_input if u.name in ck else u.act_saved)
            sim.change(end, "device", saved)
            if u.name in streamed and u.name not in kept:
                sim.change(end, "device", -pbytes)
            released.append(end)
            t_done = end
        # Backward, last unit first.
        released = []
        for j, u in enumerate(reversed(units)):
            pbytes, moved = u.numel * shape.compute_bytes, fetch_bytes(u, plan.placement, shape)
            ready = t_done
            if u.name in streamed and u.name not in kept:
                slot = released[j - p.prefetch_depth - 1] if j > p.prefetch_depth else t_done
                if p.of(u.name).params == Tier.NVME:
                    slot = sim.run("nvme read", f"read {u.name} params", pbytes / hw.nvme_read_bw, slot)
                ready = sim.run("host->device", f"fetch {u.name}", moved / hw.h2d_bw, slot)
                sim.change(ready, "device", pbytes)
            if u.name in ck:
                ready = sim.run("compute", f"recompute {u.name}", scale * work_time(u.fwd, hw), ready)
                sim.change(ready, "device", u.act_saved - u.act_input)
            end = sim.run("compute", f"bwd {u.name}", scale * work_time(u.bwd, hw) + hooks(u), ready)
            sim.change(end, "device", -u.act_saved - (scale - 1) * (u.act_input if u.name in ck else u.act_saved))
            if u.name in streamed:
                sim.change(end, "device", -pbytes)
            released.append(end)
            t_done = end
            grads_ready[u.name] = landed[u.name] = end
            if u.trainable and p.of(u.name).grads != Tier.DEVICE:
                g = grads_off_bytes(u, p, shape, micro)
                out = grads_ready[u.name] = landed[u.name] = sim.run("device->host", f"grads {u.name}", g / hw.d2h_bw,
                                                                     end)
                passes = micro_pass_bytes(u, p, shape, micro) if hw.cuda else 0
                if passes:  # [Note: host passes] in costs.py: the sum and the norms, on the gradient worker
                    grads_ready[u.name] = sim.run("gradient worker", f"sum grads {u.name}",
                                                  passes / host_pass_rate(hw), out)
                if p.of(u.name).grads == Tier.NVME:
                    sim.run("nvme write", f"write {u.name} grads", u.trainable * 4 / hw.nvme_write_bw, out)
    # Optimizer: per unit, read its NVMe states, update, write them back. Without clipping, on a GPU machine, a
    # unit's CPU step starts when its gradients of the last backward are summed ([Note: the step under backward]
    # in costs.py), the units in the order they land.
    # Its step then follows the worker's pass over its last gradients on the host's one memory ([Note: one memory
    # under backward] in costs.py): it starts when they land, that pass counted first.
    early = hw.cuda and steps_under_backward(prof, shape)
    t_backward = t_done  # the step's compute ends here: the optimizer's steps run under the next forward
    if not early:  # a clip's norm (or a loss scaler's check) needs every gradient summed first
        t_done = max([t_done, *grads_ready.values()])
    stepped: dict[str, float] = {}  # unit -> its step's end
    for u in _step_order(units, early, grads_ready, landed, t_backward, sim, p, hw, shape):
        if not u.trainable:
            continue
        up = p.of(u.name)
        on_dev = up.master == up.grads == up.optim == Tier.DEVICE
        shared = early and not on_dev
        start = landed[u.name] if shared else t_done
        nv = sum(_state_nbytes(plan, u, s) for s in (State.MASTER, State.OPTIM, State.GRADS) if up.tier(s) == Tier.NVME)
        ready = sim.run("nvme read", f"read {u.name} optimizer states", nv / hw.nvme_read_bw, start) if nv else start
        rate = hw.device_adam_rate if on_dev else hw.cpu_adam_rate
        track = "compute" if on_dev else "optimizer"
        passes = unit_pass_bytes(u, p, shape)[1] / host_pass_rate(hw) if hw.cuda and not on_dev else 0.0
        if shared:
            passes += last_gradient_pass(u, p, hw, shape)
        end = sim.run(track, f"adamw {u.name}", u.trainable / rate + passes, ready)
        if nv:
            end = max(end, sim.run("nvme write", f"write {u.name} optimizer states", nv / hw.nvme_write_bw, end))
        if not on_dev and up.params == Tier.DEVICE:
            end = sim.run("host->device", f"params {u.name}", u.numel * shape.compute_bytes / hw.h2d_bw, end)
        stepped[u.name] = end
    # [Note: the step under the next forward] in costs.py: the next forward reaches each unit after the units before
    # it (one micro-batch's forward, all of them in unit-major order) and waits there for the unit's step; the step
    # lasts until the backward's end plus what the forward waits.
    if not hw.cuda:  # one set of cores: the steps take their time whenever they run
        sim.tl.step_s = max([t_done, *stepped.values(), *sim.free_at.values()])
        return sim.tl
    reached, waited = t_backward, 0.0
    for u in units:
        ready = stepped.get(u.name, 0.0)
        if ready > reached:
            waited, reached = waited + ready - reached, ready
        if u.name != ROOT_UNIT:
            reached += scale * work_time(u.fwd, hw)
    sim.tl.step_s = t_backward + waited
    return sim.tl


def _step_order(units, early: bool, grads_ready: dict, landed: dict, t_backward: float, sim: _Sim, p, hw,
                shape) -> list:
    """The order the step thread steps the units in ([Note: steps under the next forward] in
    offload/step/step_queue.py): during backward as their gradients land (no clip), and what has not started when
    backward ends, in the next forward's order; with a clip, all of it in that order."""
    if not early:
        return list(units)
    t = sim.free_at.get(sim.resource["optimizer"], 0.0)
    started, rest = [], []
    for u in sorted(units, key=lambda u: grads_ready[u.name]):
        up = p.of(u.name)
        on_dev = up.master == up.grads == up.optim == Tier.DEVICE
        start = max(t, landed[u.name]) if not on_dev else landed[u.name]
        if u.trainable and not on_dev and start < t_backward:
            started.append(u)
            t = start + u.trainable / hw.cpu_adam_rate + last_gradient_pass(u, p, hw, shape)
        else:
            rest.append(u)
    return started + [u for u in units if u in rest]


def _state_nbytes(plan: Plan, u, s: State) -> int:
    from tightfit.planner.costs import state_bytes

    return state_bytes(u, s, plan.placement, plan.shape)


def chrome_trace(tl: Timeline, measured: list[dict] | None = None) -> dict:
    """Chrome trace JSON: pid 1 the simulated plan (one thread per stream) with memory counters; pid 2 measured."""
    tracks = sorted({e["tid"] for e in tl.events})
    tid = {name: i + 1 for i, name in enumerate(tracks)}
    events = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "tightfit plan (simulated)"}}]
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": i, "args": {"name": n}} for n, i in tid.items()]
    events += [{**e, "tid": tid[e["tid"]]} for e in tl.events]
    for t, mem in tl.memory:
        events.append({"name": "memory (MiB)", "ph": "C", "pid": 1, "ts": t * 1e6,
                       "args": {k: round(v / 2**20, 3) for k, v in mem.items()}})
    if measured:
        mtracks = sorted({str(e.get("stream", "engine")) for e in measured})
        mtid = {n: i + 1 for i, n in enumerate(mtracks)}
        events.append({"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "engine (measured)"}})
        events += [{"name": "thread_name", "ph": "M", "pid": 2, "tid": i, "args": {"name": n}}
                   for n, i in mtid.items()]
        events += [{"name": str(e.get("name", "")), "ph": "X", "pid": 2, "tid": mtid[str(e.get("stream", "engine"))],
                    "ts": float(e["start_s"]) * 1e6, "dur": float(e["dur_s"]) * 1e6} for e in measured]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(plan: Plan, folder: str | Path, measured: list[dict] | None = None) -> list[Path]:
    """Write the trace, the memory timeline (JSON, and PNG with matplotlib) of one simulated step of `plan`.

    `measured`: engine events as dicts with "name", "stream", "start_s", "dur_s" (seconds), shown beside the plan.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tl = simulate(plan)
    out = [folder / "plan_trace.json", folder / "memory_timeline.json"]
    out[0].write_text(json.dumps(chrome_trace(tl, measured)))
    budgets = {t: plan.budgets.get(t) for t in TIERS}
    out[1].write_text(json.dumps({"step_s": tl.step_s, "budgets": budgets,
                                  "samples": [{"t": t, **m} for t, m in tl.memory]}))
    for png in (_plot(tl, plan, folder / "memory_timeline.png"), _plot_plan(plan, folder / "plan.png")):
        if png:
            out.append(png)
    return out


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)  # atomic: a viewer never opens half a file
    return path


_TIER_COLOURS = {Tier.DEVICE: "#4c72b0", Tier.HOST: "#55a868", Tier.NVME: "#c44e52"}


def _plot_plan(plan: Plan, path: Path) -> Path | None:
    """The placement as a grid: one row per unit (forward order), one column per state, coloured by tier."""
    plt = _pyplot()
    if plt is None:
        return None
    from matplotlib.patches import Patch

    p, units = plan.placement, plan.profile.units
    states = list(State)
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.28 * len(units) + 1.5)))
    for row, u in enumerate(units):
        up = p.of(u.name)
        for col, s in enumerate(states):
            ax.add_patch(plt.Rectangle((col, row), 0.95, 0.9, color=_TIER_COLOURS[up.tier(s)]))
        notes = [f"{u.numel * 4 / 2**20:,.1f} MiB fp32"]
        if u.name in p.checkpoint_units:
            notes.append("checkpointed")
        tiled = [k for k in p.tiled_linears if k == u.name or k.startswith(u.name + ".")]
        if tiled:
            notes.append(f"{len(tiled)} tiled")
        ax.text(len(states) + 0.1, row + 0.45, ", ".join(notes), va="center", fontsize=8)
    ax.set_xlim(0, len(states) + 3)
    ax.set_ylim(len(units), 0)
    ax.set_xticks([i + 0.475 for i in range(len(states))], [s.value for s in states])
    ax.set_yticks([i + 0.45 for i in range(len(units))], [u.name for u in units], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.legend(handles=[Patch(color=c, label=t.value) for t, c in _TIER_COLOURS.items()], loc="upper right",
              fontsize=8)
    ax.set_title(f"plan: where each unit's states live (--offload {plan.mode}, predicted step "
                 f"{plan.prediction.step_s * 1e3:,.1f} ms)", fontsize=10)
    return _save(fig, plt, path)


def _plot(tl: Timeline, plan: Plan, path: Path) -> Path | None:
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    ts = [t * 1e3 for t, _ in tl.memory]
    for tier in TIERS:
        ys = [m[tier] / 2**20 for _, m in tl.memory]
        if any(ys):
            ax.step(ts, ys, where="post", label=tier)
            b = plan.budgets.get(tier)
            if b is not None and not (tier == "device" and plan.shared_pool):
                ax.axhline(b / 2**20, linestyle="--", linewidth=0.8, color=ax.lines[-1].get_color())
    ax.set_xlabel("time in step (ms)")
    ax.set_ylabel("MiB")
    ax.set_title("predicted memory per tier over one step (dashed: budgets)")
    ax.legend()
    return _save(fig, plt, path)
