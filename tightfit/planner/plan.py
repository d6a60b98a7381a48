"""The planner's output: a placement, what it is predicted to cost, why, and how to print it.

Why one object: `tightfit plan` prints it, `tightfit train` prints its summary before training and compares it with
what was measured after, the engine consumes its `placement`, and `--json` / `--trace` serialise it. The plan
keeps the model and hardware profiles it was made from, so a saved plan can be re-drawn (`trace.py`) or
re-predicted without the model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from tightfit.offload import memory_model as mm
from tightfit.offload.placement import Placement, State
from tightfit.planner.costs import Prediction, TrainShape, casts_on_device, state_bytes, unit_sizes
from tightfit.planner.hardware import PRESSURE_WARNING, GiB, HardwareProfile
from tightfit.planner.model_profile import ModelProfile
from tightfit.utils.sizes import format_size

TIERS = ("device", "host", "nvme")


@dataclass
class Plan:
    """A placement with its predictions and reasons. JSON round-trips (`to_json` / `from_json`)."""

    placement: Placement
    """What the engine consumes."""
    prediction: Prediction
    """Peak bytes per tier and step-time terms of `placement`."""
    budgets: dict[str, int | None]
    """Tier -> byte budget the plan honours (None: no limit; on a CPU-only machine "device" shares "host")."""
    budget_sources: dict[str, str]
    """Tier -> the flag or "machine" the budget came from."""
    reasons: list[str]
    """One line per decision, in the order they were made."""
    mode: str
    """--offload: "auto", "none", or the single tier every state was put on."""
    shape: TrainShape
    """The training settings the costs depend on."""
    profile: ModelProfile
    """Per-unit bytes and work the plan was made from (tile units included when tiling was applied)."""
    hardware: HardwareProfile
    """Capacities and speeds the plan was made with."""
    shared_pool: bool = False
    """CPU-only machine without --gpu-mem: device and host tiers share the host budget."""

    # --- serialisation ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"placement": self.placement.to_dict(), "prediction": asdict(self.prediction),
                "budgets": self.budgets, "budget_sources": self.budget_sources, "reasons": self.reasons,
                "mode": self.mode, "shape": asdict(self.shape), "profile": asdict(self.profile),
                "hardware": self.hardware.to_dict(), "shared_pool": self.shared_pool, "disk": self.disk_figures(),
                "rss": self.rss_figures()}

    def rss_figures(self) -> dict[str, int]:
        """The predicted process RSS and its moments ([Note: process RSS] in costs.py): the peak, in the step and
        while a checkpoint is saved, and what of the step's is the heap's free bytes ([Note: the heap at the
        step's peak])."""
        pr, cuda = self.prediction, self.hardware.cuda
        parts = pr.rss_parts(cuda)
        return {"peak": max(parts.values()), **parts, "heap_free": pr.heap_free(cuda)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        pred = dict(d["prediction"])
        if "engine_device" not in pred:  # written before the field: the device breakdown was the engine's count
            device = pred.get("breakdown", {}).get("device", {})
            pred["engine_device"] = sum(v for k, v in device.items() if k != "activations")
        return cls(Placement.from_dict(d["placement"]), Prediction(**pred), d["budgets"],
                   d["budget_sources"], d["reasons"], d["mode"], TrainShape(**d["shape"]),
                   ModelProfile.from_dict(d["profile"]), HardwareProfile.from_dict(d["hardware"]),
                   d.get("shared_pool", False))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    # --- views --------------------------------------------------------------------------------------------------
    def tier_bytes(self) -> dict[str, int]:
        """Bytes of states resident on each tier (buffers and activations excluded)."""
        out = dict.fromkeys(TIERS, 0)
        for u in self.profile.units:
            for s in State:
                out[self.placement.of(u.name).tier(s).value] += state_bytes(u, s, self.placement, self.shape)
        return out

    def disk_warning(self) -> str | None:
        """A warning when the plan keeps more on the disk than the volume its rates were measured over: past a cache
        in front of the disk the rates may drop several-fold ([Note: sustained bandwidth] in disk_probe.py)."""
        swap, measured = self.prediction.peak.get("nvme", 0), self.hardware.nvme_measured_bytes
        if not measured or swap <= measured:
            return None
        gib = -(-int(swap) // GiB)
        return (f"warning: the disk's rates were measured over {format_size(measured)}, this plan keeps "
                f"{format_size(swap)} on it: past a cache in front of the disk, steps may be slower than predicted; "
                f"measure that volume with `tightfit probe --nvme {self.placement.nvme_dir} --disk-volume {gib}GiB`")

    def pressure_warning(self) -> str | None:
        """A warning when the machine's speeds were measured while other work kept its cores busy: every time
        the plan predicts is then too slow by as much (`HardwareProfile.cpu_pressure`)."""
        if self.hardware.cpu_pressure <= PRESSURE_WARNING:
            return None
        return (f"warning: this machine's speeds were measured while other work kept its cores busy (a task waited "
                f"for a core {self.hardware.cpu_pressure:.0%} of the time): steps may be faster than predicted; run "
                "`tightfit probe` again when the machine is quiet")

    def last_save_takes_over(self) -> int:
        """Bytes of disk the run's last save needs less than a whole checkpoint where --out-dir shares the swap's
        disk ([Note: the last save takes the swap's place] in offload/memory_model.py: `handed_over`)."""
        return mm.handed_over(unit_sizes(self.profile), self.placement, self.shape.compute_bytes)

    def disk_figures(self) -> dict[str, int] | None:
        """The disk a run with NVMe states needs at its end: its swap, a checkpoint, and what the last save adds
        beyond the swap where --out-dir shares its disk (it takes the swap's place as it is written: [Note: the last
        save takes the swap's place] in offload/memory_model.py). None without NVMe states."""
        swap = self.prediction.peak.get("nvme", 0)
        if not swap:
            return None
        checkpoint = sum(mm.export_bytes(u) for u in unit_sizes(self.profile))
        return {"swap": swap, "checkpoint": checkpoint,
                "last_save_beyond_swap": checkpoint - self.last_save_takes_over()}

    def disk_line(self) -> str | None:
        """`disk_figures` in words, for `tightfit plan`."""
        d = self.disk_figures()
        if d is None:
            return None
        return (f"disk: the swap {format_size(d['swap'])}; a checkpoint about {format_size(d['checkpoint'])}, and "
                f"where --out-dir is on the swap's disk the run's last save needs "
                f"{format_size(d['last_save_beyond_swap'])} beyond the swap (it takes the swap's place as it writes; "
                "a save before it, the whole checkpoint)")

    def _budget_text(self, tier: str) -> str:
        b = self.budgets.get(tier)
        if tier == "device" and self.shared_pool:
            return "shares host"
        if tier == "nvme" and not self.placement.nvme_dir:
            return "-"
        return "none" if b is None else format_size(b)

    def figures(self) -> list[tuple[str, str, float, bool]]:
        """Every predicted figure the plan states, each computed once: (label, the key of `compare`'s measured
        dict, value, is bytes). `summary`, `table` and `compare` all print these, so the figure a run is compared
        with is the figure it was promised (the summary once printed the device peak with activations, 3.9 MiB,
        where the comparison showed the engine's own count, 1.0 MiB, under a similar name)."""
        pr = self.prediction
        return [("device peak", "device_peak", pr.peak.get("device", 0), True),
                ("device (engine)", "device_engine_peak", pr.engine_device, True),
                ("host peak", "host_peak", pr.peak.get("host", 0), True),
                ("nvme peak", "nvme_peak", pr.peak.get("nvme", 0), True),
                ("process RSS", "rss_peak", pr.rss(self.hardware.cuda), True),
                ("step time", "step_s", pr.step_s, False)]

    def _save_bound(self) -> bool:
        parts = self.prediction.rss_parts(self.hardware.cuda)
        return parts["save"] > parts["step"]

    def _figure(self, key: str) -> str:
        _, _, value, is_bytes = next(f for f in self.figures() if f[1] == key)
        return format_size(value) if is_bytes else f"{value * 1e3:.1f} ms"

    def summary(self) -> str:
        """A few lines for `tightfit train` to print before training."""
        p, pr = self.placement, self.prediction
        where = states_by_tier(p, self.profile)
        peaks = ", ".join(f"{t} {self._figure(t + '_peak')}/{self._budget_text(t)}" for t in TIERS
                          if pr.peak.get(t, 0) or t != "nvme")
        lines = [f"plan ({self.mode}): {len(self.profile.units)} units x 4 states: {where}",
                 f"  predicted peak: {peaks}, process RSS {self._figure('rss_peak')}"
                 + (" (saving a checkpoint)" if self._save_bound() else ""),
                 (f"  device: the engine's own count at most {self._figure('device_engine_peak')}; activations "
                  if self.shape.engine else "  device: plain PyTorch, no offload engine; activations ")
                 + f"{format_size(pr.breakdown.get('device', {}).get('activations', 0))} at the device's peak",
                 f"  predicted step: {self._figure('step_s')} ({pr.tokens_per_s:,.0f} tokens/s), "
                 f"bottleneck: {pr.bottleneck}; the host issues its ops in {pr.host_s * 1e3:.1f} ms"]
        if self.shape.ranks > 1:
            lines.append(f"  {self.averaging_line()}")
        extras = []
        if p.checkpoint_units:
            extras.append(f"checkpointing {len(p.checkpoint_units)} unit(s)")
        if p.tiled_linears:
            extras.append("tiling " + ", ".join(f"{k} x{v}" for k, v in p.tiled_linears.items()))
        cast = sum(casts_on_device(u, p, self.shape) for u in self.profile.units)
        if cast:
            extras.append(f"the GPU casts {cast} unit(s)' fp32 masters as it uploads them (no compute copy on the "
                          "host)")
        if extras:
            lines.append("  " + "; ".join(extras))
        lines += [f"  {r}" for r in self.reasons if r.startswith(("engine:", "accumulation:", "boundaries:", "warning:",
                                                                  "what more memory buys"))]
        return "\n".join(lines)

    @property
    def accumulation(self) -> str:
        """"unit" when the plan runs a step's micro-batches unit by unit (offload/step/unit_major.py), else
        "micro"."""
        return "unit" if self.shape.unit_major else "micro"

    def _cell(self, u, s: State) -> str:
        """One state's bytes and tier in the unit table; a compute copy the GPU casts from the master it uploads
        has none at rest ([Note: the device casts the master] in offload/step/unit.py)."""
        if s is State.PARAMS and casts_on_device(u, self.placement, self.shape):
            return "cast on GPU"
        return f"{format_size(state_bytes(u, s, self.placement, self.shape))} {self.placement.of(u.name).tier(s).value}"

    def _order(self) -> str:
        if not self.shape.unit_major:
            return ""
        return " (unit-major, block inputs in host memory)" if self.shape.boundaries_on_host else " (unit-major)"

    def table(self) -> str:
        """The full `tightfit plan` output."""
        p, pr = self.placement, self.prediction
        compute = self.profile.compute_dtype + (" under autocast" if self.profile.autocast else "")
        lines = [f"tightfit plan: {self.hardware.device_name}, compute {compute}, micro-batch "
                 f"{self.profile.micro_batch} x {self.profile.seq_len} tokens, grad-accum {self.shape.grad_accum}"
                 f"{self._order()}, --offload {self.mode}", ""]
        head = f"{'unit':<28}{'params':>10}  " + "".join(f"{s.value:>18}" for s in State)
        lines += [head, "-" * len(head)]
        for u in self.profile.units:
            cells = "".join(f"{self._cell(u, s):>18}" for s in State)
            lines.append(f"{u.name:<28}{u.numel:>10,}  {cells}")
        lines.append("")
        tb = self.tier_bytes()
        lines.append(f"{'tier':<8}{'states':>12}{'predicted peak':>16}{'budget':>14}   breakdown at peak")
        for t in TIERS:
            parts = ", ".join(f"{k} {format_size(v)}" for k, v in pr.breakdown.get(t, {}).items() if v)
            lines.append(f"{t:<8}{format_size(tb[t]):>12}{format_size(pr.peak.get(t, 0)):>16}"
                         f"{self._budget_text(t):>14}   {parts}")
        # The process's RSS holds the host tier; a GPU's memory is not in it ([Note: process RSS] in costs.py).
        parts = pr.rss_parts(self.hardware.cuda)
        heap = pr.heap_free(self.hardware.cuda)
        lines.append(f"predicted RSS (process floor {format_size(pr.runtime_rss)} + host"
                     f"{' + CPU device' if not self.hardware.cuda else ''}"
                     f"{f' + {format_size(heap)} the heap holds free at the peak' if heap else ''}"
                     f"{f' + {format_size(pr.allreduce_buffer)} of all-reduce buffers' if pr.allreduce_buffer else ''}"
                     "): "
                     f"{self._figure('rss_peak')}"
                     + (f", while a checkpoint is saved ({format_size(pr.save_bytes)} of it read for the writer; "
                        f"{format_size(parts['step'])} in the step)" if parts["save"] > parts["step"] else ""))
        disk = self.disk_line()
        if disk:
            lines.append(disk)
        lines.append("")
        lines.append(f"schedule: prefetch depth {p.prefetch_depth}, "
                     f"checkpointed units {len(p.checkpoint_units)}, tiled linears {len(p.tiled_linears)}")
        tr = pr.traffic
        lines.append(f"traffic per step: host->device {format_size(tr.get('h2d', 0) + tr.get('h2d_opt', 0))}, "
                     f"device->host {format_size(tr.get('d2h', 0))}, nvme read "
                     f"{format_size(tr.get('nvme_read', 0) + tr.get('nvme_read_opt', 0))}, nvme write "
                     f"{format_size(tr.get('nvme_write', 0) + tr.get('nvme_write_opt', 0))}")
        lines.append(f"step time terms: compute {pr.compute_s * 1e3:.1f} ms (the host issuing ops "
                     f"{pr.host_s * 1e3:.1f} ms), host<->device {pr.copy_s * 1e3:.1f} ms, "
                     f"nvme {pr.nvme_s * 1e3:.1f} ms, optimizer {pr.optim_s * 1e3:.1f} ms, "
                     f"exposed latency {pr.exposed_s * 1e3:.1f} ms"
                     + (f"; after backward, what the next forward does not hide {pr.optim_exposed_s * 1e3:.1f} ms"
                        if self.hardware.cuda and self.shape.engine else "")
                     + (f"; the CPU's passes besides AdamW {pr.passes_s * 1e3:.1f} ms (gradient sums in backward, "
                        f"the rest in the optimizer's)" if pr.passes_s else ""))
        if self.shape.ranks > 1:
            lines.append(self.averaging_line())
        lines.append(f"predicted step: {pr.step_s * 1e3:.1f} ms ({pr.tokens_per_s:,.0f} tokens/s); "
                     f"bottleneck: {pr.bottleneck}")
        if self.reasons:
            lines.append("")
            lines += [f"- {r}" for r in self.reasons]
        if not self.profile.measured:
            lines.append(f"- note: {self.profile.note}")
        lines += [f"- assumed: {a}" for a in self.hardware.assumptions]
        return "\n".join(lines)

    def averaging_line(self) -> str:
        """One rank of replicas: what averaging the gradients over the group costs its step (and where the ranks'
        optimizer states are sharded by unit, exchanging the new values)."""
        from tightfit.planner.averaging import allreduce_bytes, exchange_bytes, shards_optimizer

        sh, pr = self.shape, self.prediction
        if not self.hardware.cuda:
            where = "on the cores the step computes on"
        else:
            where = "over the host<->device link's lanes" if sh.allreduce_on_link else "beside the backward"
        line = (f"gradients averaged over {sh.ranks} ranks: {format_size(allreduce_bytes(self.profile, sh))} a step "
                f"at {sh.allreduce_bw / 1e9:.2f} GB/s bus bandwidth ({sh.allreduce_source}): "
                f"{pr.allreduce_s * 1e3:.1f} ms added to the step ({where})")
        if shards_optimizer(self.profile):  # [Note: optimizer states sharded by unit] in parallel/sharded_optimizer.py
            from tightfit.planner.averaging import sends_params

            stepped = sum(1 for u in self.profile.units if u.stepped and u.trainable)
            held = sharded_states(self.profile)
            sent = ("each use's parameters broadcast by their rank beside the compute" if sends_params(self.profile)
                    else "the new values broadcast beside the next forward")
            line += (f"; this rank steps {stepped} of the {sum(1 for u in self.profile.units if u.trainable)} units "
                     f"and holds their {held} alone, {sent}: "
                     f"{format_size(exchange_bytes(self.profile, sh))}, {pr.exchange_s * 1e3:.1f} ms added")
        return line

    def compare(self, measured: dict) -> str:
        """Predicted vs measured, one line per quantity measured.

        Keys understood (any subset): "device_peak" (everything on the device: CUDA peak allocated),
        "device_engine_peak" (what the engine counts: device-tier states + materialised units), "host_peak"
        (host tier + buffer pool), "nvme_peak", "rss_peak" (bytes) and "step_s" (seconds per optimizer step).
        "rss_peak" is compared with runtime + host (+ CPU device) bytes.
        """
        lines = ["predicted vs measured:"]
        for name, key, pred, is_bytes in self.figures():
            meas = measured.get(key)
            if meas is None:
                continue
            fmt = format_size if is_bytes else (lambda s: f"{s * 1e3:.1f} ms")
            err = (pred - meas) / meas * 100 if meas else 0.0
            lines.append(f"  {name:<12} predicted {self._figure(key):>10}  measured {fmt(meas):>10}  ({err:+.0f}%)")
        return "\n".join(lines)

    def over_budget(self) -> list[str]:
        """Tiers whose predicted peak exceeds their budget (non-empty only for a forced --offload mode)."""
        out = []
        for t in TIERS:
            b = self.budgets.get(t)
            peak = self.prediction.peak.get(t, 0) + (self.prediction.peak.get("device", 0)
                                                     if t == "host" and self.shared_pool else 0)
            if b is not None and peak > b and not (t == "device" and self.shared_pool):
                out.append(t)
        return out


def states_by_tier(placement: Placement, profile: ModelProfile) -> str:
    """"16 on device, 76 on host": how many unit states each tier holds (the summary's first line)."""
    counts: dict[str, int] = {}
    for u in profile.units:
        for s in State:
            t = placement.of(u.name).tier(s).value
            counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{n} on {t}" for t, n in counts.items())


def sharded_states(profile) -> str:
    """The states a rank holds alone of the units it steps, where the ranks shard them by unit (zero1/2/3)."""
    if any(u.exchanged for u in profile.units):
        return "parameters, master, moments and gradients"
    if any(not u.keeps_grads for u in profile.units):
        return "master, moments and gradients"
    return "master and moments"
