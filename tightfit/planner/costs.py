"""Predicted memory per tier and step time of one placement: the planner's model of the offload engine.

Why one file: the search (`search.py`) compares placements only through `predict`, the plan prints it, the trace
draws it and the benchmark checks it against measurement. Every assumption about how the engine spends memory and
time is written once, here; docs/PLANNER.md explains the model in prose.

[Note: bytes per state] For a unit with N parameters (n trainable), compute dtype of c bytes:
  params N*c; master n*4 (none when compute is fp32 and master shares the params' tier: the same tensor);
  grads n*4 (fp32, accumulated across micro-batches); optim n*8 (Adam exp_avg + exp_avg_sq, fp32).

[Note: device peak] resident states on the device tier + the live window of streamed parameters
(prefetch_depth + 2 blocks, or all streamed blocks when fewer are, + the root unit) + autograd gradients not yet
shipped (the root's and two blocks') + activations (with checkpointing: unit inputs, plus one unit's recomputed
activations) + the transient working set of backward. All but the activations are what the engine itself counts against `device_budget`.

[Note: host peak] resident host states + staging: on CUDA, `staging_buffers` pinned buffers of the largest
streamed unit; for NVMe-resident states, read/write buffers for the unit being updated and the one prefetched.

[Note: overlap] See `step_time`: streams that use different hardware run concurrently; on a CPU-only machine
compute, copies and the CPU optimizer share the cores and add up, only the disk runs beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tightfit.offload.placement import ROOT_UNIT, Placement, State, Tier
from tightfit.planner.hardware import HardwareProfile
from tightfit.planner.model_profile import ModelProfile, UnitProfile, Work


@dataclass
class TrainShape:
    """The training settings that change cost (everything else in Config does not)."""

    compute_bytes: int = 4
    """Bytes per element of compute parameters and activations (4 fp32, 2 bf16/fp16)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    tokens_per_micro: int = 0
    """micro_batch * seq_len, for tokens/s."""
    grad_clip: bool = True
    """Clipping needs the global gradient norm before any unit's update: the optimizer cannot overlap backward."""


@dataclass
class Prediction:
    """What `predict` expects of one placement."""

    peak: dict[str, int] = field(default_factory=dict)
    """Peak bytes per tier ("device", "host", "nvme")."""
    breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    """Tier -> component ("states", "window", "activations", "staging", ...) -> bytes at the peak."""
    runtime_rss: int = 0
    """Fixed RSS of the torch runtime, added to host (and CPU device) bytes when comparing with a process's RSS."""
    compute_s: float = 0.0
    """Forward + backward (+ recomputation) time of all micro-batches on the compute device."""
    copy_s: float = 0.0
    """Host <-> device transfer time (on a CPU-only machine: memcpy between tier buffers)."""
    nvme_s: float = 0.0
    """Disk time: bytes read / read bandwidth + bytes written / write bandwidth."""
    optim_s: float = 0.0
    """Optimizer step time (CPU fused AdamW, or on the device for units whose states all live there)."""
    exposed_s: float = 0.0
    """Latency nothing hides: fetching the first units before compute can start."""
    step_s: float = 0.0
    """Predicted step time under the overlap model."""
    bottleneck: str = ""
    """The term on the critical path: "compute", "host<->device", "nvme" or "cpu optimizer"."""
    traffic: dict[str, float] = field(default_factory=dict)
    """Bytes per step: "h2d", "d2h", "nvme_read", "nvme_write"."""
    tokens_per_s: float = 0.0

    def rss(self, cuda: bool) -> int:
        """Predicted peak RSS of the training process: runtime + host tier (+ device tier on a CPU-only machine)."""
        return self.runtime_rss + self.peak.get("host", 0) + (0 if cuda else self.peak.get("device", 0))


def state_bytes(u: UnitProfile, state: State, placement: Placement, shape: TrainShape) -> int:
    """Bytes `state` of unit `u` occupies on its tier ([Note: bytes per state])."""
    up = placement.of(u.name)
    if state is State.PARAMS:
        return u.numel * shape.compute_bytes
    if state is State.MASTER:
        aliased = shape.compute_bytes == 4 and up.master == up.params
        return 0 if aliased else u.numel * 4
    if state is State.GRADS:
        return u.trainable * 4
    return u.trainable * 8


def act_bytes(profile: ModelProfile, checkpointed: set[str]) -> int:
    """Peak activation bytes when the units in `checkpointed` recompute their forward in backward."""
    ck = [u for u in profile.units if u.name in checkpointed and u.checkpointable]
    saved = sum(u.act_saved for u in profile.units if u not in ck) + sum(u.act_input for u in ck)
    recompute = max((u.act_recompute or u.act_saved for u in ck), default=0)
    return saved + recompute + profile.act_transient


def stream_unit_bytes(profile: ModelProfile, placement: Placement, shape: TrainShape) -> int:
    """Compute-parameter bytes of the largest unit whose parameters are streamed (0 when none is)."""
    sizes = [u.numel * shape.compute_bytes for u in profile.units if placement.of(u.name).params != Tier.DEVICE]
    return max(sizes, default=0)


def _optimizer_on_device(placement: Placement, name: str) -> bool:
    up = placement.of(name)
    return up.master == up.grads == up.optim == Tier.DEVICE


def memory(profile: ModelProfile, placement: Placement, hw: HardwareProfile,
           shape: TrainShape) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """Peak bytes per tier and their breakdown ([Note: device peak], [Note: host peak])."""
    parts: dict[str, dict[str, int]] = {t.value: {"states": 0} for t in Tier}
    for u in profile.units:
        for s in State:
            parts[placement.of(u.name).tier(s).value]["states"] += state_bytes(u, s, placement, shape)
    c = shape.compute_bytes
    streamed = [u for u in profile.units if placement.of(u.name).params != Tier.DEVICE]
    blocks = [u.numel * c for u in streamed if u.checkpointable or u.name != ROOT_UNIT]
    root = [u.numel * c for u in streamed if u.name == ROOT_UNIT]
    dev = parts["device"]
    # The engine keeps the root unit materialised from forward start to its gradients; in backward the running
    # block, `prefetch_depth` prefetched ones and the previous block (released when its gradients are shipped,
    # after its input-gradient hook, i.e. once the running block has started). Only streamed blocks take a slot:
    # when fewer than `prefetch_depth + 2` are streamed (the rest resident), the window holds just those.
    dev["window"] = min(placement.prefetch_depth + 2, len(blocks)) * max(blocks, default=0) + sum(root)
    off = [u for u in profile.units if u.trainable and placement.of(u.name).grads != Tier.DEVICE]
    # autograd's param.grads (compute dtype), counted by the engine from a unit's backward start until shipped:
    # the root's (charged when backward starts, shipped last), the running block's and the previous block's
    # (its gradients are shipped once its input-gradient hook has fired, after the next block has started).
    root_g = sum(u.trainable * c for u in profile.units if u.name == ROOT_UNIT)
    dev["grads in flight"] = root_g + 2 * max((u.trainable * c for u in profile.units if u.name != ROOT_UNIT),
                                              default=0)
    dev["activations"] = act_bytes(profile, set(placement.checkpoint_units))
    host = parts["host"]
    pool = 0
    # fp32 pack buffers of gradients leaving the device, reused per size (the root's differs). On a CPU-only
    # machine host-tier gradients are added in place (same memory), so only NVMe-bound gradients are packed.
    packed = [u for u in off if hw.cuda or placement.of(u.name).grads == Tier.NVME]
    if any(u.name != ROOT_UNIT for u in packed):
        pool += 2 * max(u.trainable * 4 for u in packed if u.name != ROOT_UNIT)
    pool += sum(u.trainable * 4 for u in packed if u.name == ROOT_UNIT)
    opt_sets = []
    for u in profile.units:
        up = placement.of(u.name)
        if not u.trainable:
            continue
        on_nvme = [s for s in (State.MASTER, State.GRADS, State.OPTIM) if up.tier(s) == Tier.NVME]
        if hw.cuda and not (up.master == up.grads == up.optim == Tier.DEVICE):
            on_nvme = [s for s in (State.MASTER, State.GRADS, State.OPTIM) if up.tier(s) != Tier.HOST]
        if on_nvme:
            ws = sum(u.numel * 4 if s is State.MASTER else state_bytes(u, s, placement, shape) for s in on_nvme)
            if up.params == Tier.NVME and state_bytes(u, State.MASTER, placement, shape):
                ws += u.numel * c  # cast buffer for the refreshed compute copy
            opt_sets.append((u.name, ws))
    if opt_sets:  # the unit being stepped + `prefetch_depth` read ahead (write-backs reuse their buffers)
        block_ws = [w for n, w in opt_sets if n != ROOT_UNIT]
        pool += (placement.prefetch_depth + 1) * max(block_ws, default=0) + sum(
            w for n, w in opt_sets if n == ROOT_UNIT)
    if hw.cuda and any(placement.of(u.name).params == Tier.NVME for u in streamed):
        pool += (placement.prefetch_depth + 1) * max(blocks + root)  # pinned staging for disk -> GPU fetches
    if placement.host_budget is not None:  # the engine's pool blocks instead of growing past the budget
        pool = min(pool, max(0, placement.host_budget - parts["host"]["states"]))
    # ... but one unit's optimizer working set must fit (the engine refuses a budget without it).
    pool = max(pool, staged_working_set(profile, placement, hw, shape))
    host["buffers"] = pool
    peak = {t: sum(v.values()) for t, v in parts.items()}
    return peak, parts


def staged_working_set(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape) -> int:
    """Host bytes of the largest optimizer step that goes through pool buffers (fp32 master, grads and moments plus
    the compute copy), as the engine reserves it: units with a state on NVMe, or on CUDA split across tiers."""
    out = 0
    for u in profile.units:
        up = placement.of(u.name)
        tiers = {up.master, up.grads, up.optim}
        if Tier.NVME in tiers or (hw.cuda and Tier.DEVICE in tiers and len(tiers) > 1):
            out = max(out, 4 * u.numel + 12 * u.trainable + u.numel * shape.compute_bytes)
    return out


def engine_device_bytes(breakdown: dict[str, dict[str, int]]) -> int:
    """What the engine itself counts against the device budget: device-tier states + materialised units +
    autograd gradients not yet shipped (everything but activations)."""
    d = breakdown.get("device", {})
    return d.get("states", 0) + d.get("window", 0) + d.get("grads in flight", 0)


def work_time(w: Work, hw: HardwareProfile) -> float:
    """Roofline per bucket: matmul FLOPs at the measured rate for their size, memory-bound bytes at memory
    bandwidth, plus a fixed dispatch cost per op."""
    t = sum(f / hw.matmul_rate(size) for size, f in w.gemm_flops.items())
    return t + w.mem_bytes / hw.mem_bw + w.n_ops * hw.op_overhead_s


def traffic(profile: ModelProfile, placement: Placement, shape: TrainShape) -> dict[str, float]:
    """Bytes moved per optimizer step on each link (see docs/PLANNER.md, "Traffic")."""
    t = {"h2d": 0.0, "d2h": 0.0, "nvme_read": 0.0, "nvme_write": 0.0, "h2d_opt": 0.0, "nvme_read_opt": 0.0,
         "nvme_write_opt": 0.0}
    a = shape.grad_accum
    for u in profile.units:
        up = placement.of(u.name)
        p = u.numel * shape.compute_bytes
        uses = (3 if u.name in placement.checkpoint_units else 2) * a  # forward, backward (+ recompute)
        if up.params != Tier.DEVICE:
            t["h2d"] += uses * p
            if up.params == Tier.NVME:
                t["nvme_read"] += uses * p
        g = u.trainable * 4
        if up.grads != Tier.DEVICE:
            t["d2h"] += a * u.trainable * shape.compute_bytes
            if up.grads == Tier.NVME:  # accumulate: write each micro-batch, read back all but the first
                t["nvme_write"] += a * g
                t["nvme_read"] += (a - 1) * g
                t["nvme_read_opt"] += g
        if not _optimizer_on_device(placement, u.name):
            if up.grads == Tier.DEVICE:
                t["d2h"] += g
            if up.params == Tier.DEVICE:
                t["h2d_opt"] += p  # updated compute parameters go back up
        for s in (State.MASTER, State.OPTIM):
            if up.tier(s) == Tier.NVME:
                nbytes = state_bytes(u, s, placement, shape)
                t["nvme_read_opt"] += nbytes
                t["nvme_write_opt"] += nbytes
        if up.params == Tier.NVME and state_bytes(u, State.MASTER, placement, shape):
            t["nvme_write_opt"] += p  # compute params rewritten after the update (aliased master: counted above)
    return t


def step_time(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape,
              pred: Prediction) -> None:
    """Fill the time terms of `pred`.

    Phase A (forward + backward of every micro-batch): compute, host->device, device->host and disk run on
    separate hardware and overlap; phase time = slowest stream + the exposed fetch of the first unit.
    Phase B (optimizer): the CPU optimizer overlaps the disk traffic of the states it updates.
    Gradient clipping makes B wait for all of A; without clipping B overlaps the last backward (not modelled: the
    prediction is then an upper bound). On a CPU-only machine compute, memcpy and the optimizer share the cores,
    so those terms add instead of overlapping; only the disk runs beside them.
    """
    a = shape.grad_accum
    compute = 0.0
    for u in profile.units:
        per_micro = work_time(u.fwd, hw) + work_time(u.bwd, hw)
        if u.name in placement.checkpoint_units:
            per_micro += work_time(u.fwd, hw)
        compute += a * per_micro
    tr = traffic(profile, placement, shape)
    pred.traffic = {k: v for k, v in tr.items()}
    h2d = tr["h2d"] / hw.h2d_bw
    d2h = tr["d2h"] / hw.d2h_bw
    disk_a = tr["nvme_read"] / hw.nvme_read_bw + tr["nvme_write"] / hw.nvme_write_bw
    disk_b = tr["nvme_read_opt"] / hw.nvme_read_bw + tr["nvme_write_opt"] / hw.nvme_write_bw
    h2d_b = tr["h2d_opt"] / hw.h2d_bw
    cpu_opt = sum(u.trainable for u in profile.units if not _optimizer_on_device(placement, u.name))
    dev_opt = sum(u.trainable for u in profile.units if _optimizer_on_device(placement, u.name))
    opt = cpu_opt / hw.cpu_adam_rate + dev_opt / hw.device_adam_rate

    first = stream_unit_bytes(profile, placement, shape)
    exposed = first / hw.h2d_bw if first else 0.0
    if any(placement.of(u.name).params == Tier.NVME for u in profile.units):
        exposed += first / hw.nvme_read_bw
    if hw.cuda:
        phase_a = max(compute, h2d, d2h, disk_a)
        phase_b = max(cpu_opt / hw.cpu_adam_rate, disk_b, h2d_b) + dev_opt / hw.device_adam_rate
        terms = {"compute": compute, "host<->device": max(h2d, d2h), "nvme": disk_a}
    else:
        # One set of cores: compute and memcpy serialise; the disk threads wait on DMA and overlap.
        phase_a = max(compute + h2d + d2h, disk_a)
        phase_b = max(opt + h2d_b, disk_b)
        terms = {"compute": compute, "host<->device": h2d + d2h, "nvme": disk_a}
    pred.compute_s, pred.copy_s, pred.nvme_s, pred.optim_s = compute, h2d + d2h + h2d_b, disk_a + disk_b, opt
    pred.exposed_s = exposed
    pred.step_s = phase_a + phase_b + exposed
    # The bottleneck is the largest contributor to the critical path of the longer phase.
    if phase_b > phase_a:
        pred.bottleneck = "nvme" if disk_b > opt + (0 if hw.cuda else h2d_b) else "cpu optimizer"
    elif hw.cuda:
        pred.bottleneck = max(terms, key=terms.get)
    else:
        pred.bottleneck = "nvme" if disk_a > compute + h2d + d2h else ("compute" if compute >= h2d + d2h
                                                                      else "host<->device")
    tokens = shape.tokens_per_micro * a
    pred.tokens_per_s = tokens / pred.step_s if pred.step_s > 0 else 0.0


def predict(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape) -> Prediction:
    """Memory and time of `placement`."""
    pred = Prediction(runtime_rss=hw.runtime_rss)
    pred.peak, pred.breakdown = memory(profile, placement, hw, shape)
    step_time(profile, placement, hw, shape, pred)
    return pred


def units_per_window(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape) -> int:
    """Prefetch depth that hides one unit's fetch behind the compute of the units before it (1 .. 4)."""
    streamed = [u for u in profile.units if placement.of(u.name).params != Tier.DEVICE]
    if not streamed:
        return 1
    fetch_bw = hw.h2d_bw
    if any(placement.of(u.name).params == Tier.NVME for u in streamed):
        fetch_bw = min(fetch_bw, hw.nvme_read_bw)
    fetch = max(u.numel * shape.compute_bytes for u in streamed) / fetch_bw
    per_unit = min(work_time(u.fwd, hw) for u in streamed) or 1e-9
    return max(1, min(4, math.ceil(fetch / per_unit)))
