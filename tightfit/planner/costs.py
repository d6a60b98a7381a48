"""Predicted memory per tier and step time of one placement: the planner's model of the offload engine.

Why one file: the search (`search.py`) compares placements only through `predict`, the plan prints it, the trace
draws it and the benchmark checks it against measurement. Every assumption about how the engine spends memory and
time is written once, here; docs/PLANNER.md explains the model in prose.

[Note: memory] The bytes are the memory model's (`tightfit/offload/memory_model.py`, [Note: phases] and [Note: the
pool] there), the same functions the engine's wrap-time refusal calls; this file adds what only the planner knows:
the activations its meta-device trace measured, and the pool capacity it hands the engine (what the schedule needs,
cut to the host room the budgets leave). The engine's own budgets are set to the predicted figures
(`engine_budgets`), so its meters hold the plan to them.

[Note: process RSS] On a CPU-only machine the device tier is the same RAM: the process holds its floor (the torch
runtime, the data set, whatever it held before the engine, and on a GPU machine what CUDA keeps in host memory once
a step has run; `HardwareProfile.runtime_rss`, which `tightfit train` replaces by its own measurement,
`train.memory.process_floor`) + the device (states, materialised units, gradients in flight, activations) +
the host tier + the pool, all at once in backward. With CUDA the process holds the floor + host tier + pool.

[Note: the heap at the step's peak] On a CPU-only machine a step's activations are allocated from glibc's heap,
which keeps what they free for the next allocations (its mmap threshold rises to the largest block freed, so later
ones of that size come from the heap, not from fresh pages). At the step's peak in backward about half as many bytes
as the activations sit free in the heap, too fragmented for the gradients and recomputations allocated then, and
resident: the process's RSS is higher by that much than the tensors alive. Measured (benchmarks/RESULTS.md, batch
AD) on six GPT shapes from the default (72 MiB of activations) to 553 MiB: the heap's free bytes at the RSS peak,
and the RSS above the tensors' count, 0.40 to 0.76 of the activations, 0.53 on average; with a fixed mmap threshold
(`MALLOC_MMAP_THRESHOLD_=131072`) the gap is gone (RSS within 1% of the tensors) and the default run's step is 55%
slower, so the plan predicts the heap instead of changing it: HEAP_FREE_AT_PEAK of the activations, in the RSS
only (the tiers' peaks count tensors); a budget holds them beyond the room it left beside the tiers
(`Budgets.heap_share` in budgets.py). With CUDA the activations are the GPU's (the caching allocator's share,
[Note: reserved vs allocated] in budgets.py).

[Note: overlap] See `step_time`: streams that use different hardware run concurrently; on a CPU-only machine
compute, copies and the CPU optimizer share the cores and add up, only the disk runs beside them.

[Note: the host floor] Every op is issued by the host: the model's own ops (the trace counts them) at
`op_overhead_s` each, and the engine's work per unit and micro-batch (its hooks, the parameter views it hands a
unit, the gradient hand-off, the unit's share of the optimizer's dispatch) and per step, which the probe measures
by running the engine itself (`measure_engine_overhead`: ~0.3 ms per unit on a 2-core VM, where a tiny model's
traced ops cost ~0.1 ms). On a CPU-only machine this host time adds to the kernels' (the same cores run both). On
a GPU the host issues while the GPU runs what was issued before, so compute takes the longer of the two: a large
model is bound by its kernels, a small one by its host (the first GPU run's default model: 2.9 ms predicted from
kernels alone, 16.0 ms measured). `--offload none` runs no engine: its floor is the model's ops alone.

[Note: host passes] On a GPU machine the CPU makes elementwise passes over host memory besides AdamW's, for every
unit whose gradients or optimizer live there (offload/step/gradients.py, offload/step/optimizer.py):
- in backward, the gradient worker adds each micro-batch's packed gradients into their fp32 sum from the second
  micro-batch on (the pack read at the compute dtype, the sum read and written; the first micro-batch's land
  converted to fp32, with no host pass: [Note: gradients land converted] in offload/step/gradients.py, which
  `traffic` counts as 4 bytes a parameter over the link) and, in a step that clips, takes
  each parameter's norm once, of the last micro-batch's sum (read again; [Note: norms when asked] in
  offload/step/grad_norms.py: `tightfit train` declares its last micro-batch; a loss scaler's norms without
  clipping are not counted);
- in the step, the clip coefficient multiplies the gradients (read and written; skipped in a step whose norm is
  within max_norm, which the model cannot know: it counts the multiply), and where the compute copy is not the
  master the new master is cast to it (read; written at the compute dtype).
They move their bytes at the rate the probe measured running these passes (`host_pass_bw`; where unmeasured,
AdamW's 28 bytes per parameter at `cpu_adam_rate`: both are bound by the host's memory). The backward's run on the
gradient worker beside the GPU, one more stream of phase A; the step's add to the CPU optimizer's time. The first
GPU run's 1.2 B plan measured 840 ms where AdamW alone, which the model then counted, takes 484 ms. On a CPU-only
machine they are not added: there the same cores run compute, copies and optimizer, and the figures the CPU model
was checked against (benchmarks/RESULTS.md, batches N and T) already hold them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from tightfit.offload import memory_model as mm
from tightfit.offload.device_kind import separate_memory
from tightfit.offload.placement import ROOT_UNIT, Placement, State, Tier
from tightfit.planner.averaging import (
    allreduce_buffer_bytes,
    allreduce_in_step,
    exchange_bytes,
    exchange_time,
    sends_params,
    node_share,
)
from tightfit.planner.hardware import HardwareProfile
from tightfit.planner.model_profile import ModelProfile, UnitProfile
from tightfit.planner.work import Work


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
    checkpoints: bool = True
    """The run saves checkpoints (`--keep-checkpoints` > 0): a save's host bytes count in its RSS."""
    engine: bool = True
    """The offload engine runs the step (False: `--offload none`, plain PyTorch): its host time counts."""
    unit_major: bool = False
    """The micro-batches run unit by unit (offload/step/unit_major.py): each unit's params are fetched and its
    gradients leave the device once a step, summed there in fp32 with their norms; every micro-batch's activations
    are kept until its backward."""
    boundaries_on_host: bool = False
    """In unit-major order, the units' inputs saved for backward wait in host memory, not on the device
    ([Note: boundaries on the host] in offload/step/boundaries.py): down and up the link once a step each."""
    ranks: int = 1
    """Replicas whose engines average their gradients as they leave the device (`--strategy ddp --offload
    host|nvme`, tightfit/parallel/replicas.py): each pass's gradients cross the group once (planner/averaging.py)."""
    allreduce_bw: float = 0.0
    """The group's all-reduce bus bandwidth, bytes/s (tightfit/parallel/links.py); 0 with one rank."""
    allreduce_on_link: bool = False
    """The all-reduce crosses the lanes the host<->device copies use (GPUs on PCIe without NVLink)."""
    allreduce_source: str = ""
    """Where `allreduce_bw` comes from: measured in the run's group, or assumed for a named link."""
    node_ranks: int = 1
    """Ranks on this node, whose engines share its swap disk and, on a GPU machine, its CPU cores and host memory
    (`node_share` in planner/averaging.py)."""

    @property
    def passes(self) -> int:
        """How often per step a unit's params cross to the device and its gradients leave it: once a micro-batch, or
        once in unit-major order."""
        return 1 if self.unit_major else self.grad_accum

    @property
    def resident_micro_batches(self) -> int:
        """Micro-batches whose activations the device holds at once: one, or every one in unit-major order."""
        return self.grad_accum if self.unit_major else 1


HEAP_FREE_AT_PEAK = 0.5
"""Of a CPU-only step's activation bytes, what glibc's heap holds free and resident at the step's peak ([Note: the
heap at the step's peak])."""


@dataclass
class Prediction:
    """What `predict` expects of one placement."""

    peak: dict[str, int] = field(default_factory=dict)
    """Peak bytes per tier ("device", "host", "nvme")."""
    breakdown: dict[str, dict[str, int]] = field(default_factory=dict)
    """Tier -> component ("states", "window", "activations", "staging", ...) -> bytes at the peak."""
    runtime_rss: int = 0
    """The process's floor: the torch runtime (the probe's fresh process), or what `tightfit train` measured its own
    process to hold before the engine (the data set included). Added to host (and CPU device) bytes for its RSS."""
    compute_s: float = 0.0
    """Forward + backward (+ recomputation) time of all micro-batches on the compute device, the host's issuing
    included ([Note: the host floor])."""
    host_s: float = 0.0
    """Host time issuing the step: the model's ops and the engine's per-unit and per-step work ([Note: the host
    floor]). On a GPU compute is the longer of this and the kernels; on a CPU it is part of compute."""
    copy_s: float = 0.0
    """Host <-> device transfer time (on a CPU-only machine: memcpy between tier buffers)."""
    nvme_s: float = 0.0
    """Disk time: bytes read / read bandwidth + bytes written / write bandwidth."""
    optim_s: float = 0.0
    """Optimizer step time (CPU fused AdamW, or on the device for units whose states all live there)."""
    passes_s: float = 0.0
    """Of the terms above, the CPU's elementwise passes over host memory besides AdamW on a GPU machine ([Note: host
    passes]): the gradient worker's in backward (a stream of its own) and the step's (in `optim_s`)."""
    optim_after_s: float = 0.0
    """Of the CPU optimizer's time on a GPU machine, what runs after phase A: all of it with clipping, less when
    each unit steps under the last backward ([Note: the step under backward])."""
    optim_exposed_s: float = 0.0
    """Of `optim_after_s` (with its disk and upload), what the next forward cannot hide and adds to the step ([Note:
    the step under the next forward])."""
    exposed_s: float = 0.0
    """Latency nothing hides: fetching the first units before compute can start."""
    allreduce_s: float = 0.0
    """Of phase A, the gradients' average over the ranks: all of its time on a CPU-only machine, the part the
    backward does not hide on a GPU ([Note: the gradients' average in the step] in planner/averaging.py)."""
    exchange_s: float = 0.0
    """Of the exchange where the ranks' states are sharded by unit (`exchange_time` in planner/averaging.py: zero1/2's
    new values after the step, zero3's params for each use), what adds to the step: all of it on a CPU-only machine
    (gloo on the compute's cores), on a GPU what the compute beside it does not hide."""
    phase_a_s: float = 0.0
    """Phase A: the forward and backward of every micro-batch, with the streams that overlap them."""
    step_s: float = 0.0
    """Predicted step time under the overlap model."""
    bottleneck: str = ""
    """The term on the critical path: "compute", "host issuing ops", "host<->device", "nvme", "host gradient sums"
    or "cpu optimizer"."""
    traffic: dict[str, float] = field(default_factory=dict)
    """Bytes per step: "h2d", "d2h", "nvme_read", "nvme_write"."""
    tokens_per_s: float = 0.0

    engine_device: int = 0
    """What the engine itself meters on the device at its peak (everything but activations): its count in
    "backward end", where all the root's gradients are in flight, which need not be the device's peak phase."""

    save_bytes: int = 0
    """Host bytes a checkpoint's save holds beyond the process at rest ([Note: the save] in memory_model.py)."""
    allreduce_buffer: int = 0
    """Host bytes of the flat buffers a rank's gloo averages go through (`allreduce_buffer_bytes` in
    planner/averaging.py), in its RSS during a step."""
    device_states: int = 0
    """The device tier's states: what of the device a CPU-only machine's RAM still holds between steps."""

    def rss(self, cuda: bool) -> int:
        """Predicted peak RSS of the training process ([Note: process RSS]): floor + host tier and pool (+ the
        device on a CPU-only machine: the same RAM, at its peak in backward with the pool full), or the same at rest
        with a checkpoint being saved (`rss_parts` says which)."""
        return max(self.rss_parts(cuda).values())

    def rss_parts(self, cuda: bool) -> dict[str, int]:
        """{"step": the RSS at the step's peak, "save": the RSS while a checkpoint is saved}."""
        rest = self.runtime_rss + self.peak.get("host", 0) + self.allreduce_buffer
        return {"step": rest + (0 if cuda else self.peak.get("device", 0) + self.heap_free(cuda)),
                "save": rest + (0 if cuda else self.device_states) + self.save_bytes}

    def heap_free(self, cuda: bool) -> int:
        """Bytes the heap holds free at the step's peak on a CPU-only machine ([Note: the heap at the step's
        peak]); 0 with CUDA."""
        return 0 if cuda else int(HEAP_FREE_AT_PEAK * self.breakdown.get("device", {}).get("activations", 0))


def unit_size(u: UnitProfile) -> mm.UnitSize:
    """The memory model's view of one of the profile's units (the engine's flat size, padding included)."""
    return mm.UnitSize(u.name, u.numel, u.trainable, u.stepped, u.keeps_grads, u.holds_params, u.exchanged)


def unit_sizes(profile: ModelProfile) -> list[mm.UnitSize]:
    """The memory model's view of the profile's units."""
    return [unit_size(u) for u in profile.units]


def state_bytes(u: UnitProfile, state: State, placement: Placement, shape: TrainShape) -> int:
    """Bytes `state` of unit `u` occupies on its tier ([Note: bytes per state] in memory_model.py)."""
    return mm.state_bytes(unit_size(u), state, placement.of(u.name),
                          shape.compute_bytes, casts_on_device(u, placement, shape))


def casts_on_device(u: UnitProfile, placement: Placement, shape: TrainShape) -> bool:
    """Does a fetch of `u` upload its fp32 master for the device to cast? ([Note: the device casts the master] in
    offload/step/unit.py)"""
    return mm.casts_on_device(unit_size(u), placement.of(u.name), shape.compute_bytes,
                              placement.cast_on_device)


def fetch_bytes(u: UnitProfile, placement: Placement, shape: TrainShape) -> int:
    """Bytes one fetch of `u`'s params moves to the device: its compute copy, or the fp32 master the device casts."""
    return u.numel * (4 if casts_on_device(u, placement, shape) else shape.compute_bytes)


def act_bytes(profile: ModelProfile, checkpointed: set[str], micro_batches: int = 1,
              boundaries_on_host: bool = False) -> int:
    """Peak activation bytes on the device when the units in `checkpointed` recompute their forward in backward and
    the step holds `micro_batches` micro-batches' (`TrainShape.resident_micro_batches`)."""
    return activations(profile, checkpointed, micro_batches, boundaries_on_host).peak


BOUNDARY_WINDOW = 2
"""Boundaries back on the device ahead of the backward that needs them ([Note: boundaries on the host]: the
executor brings back the next segment's while one computes)."""


def activations(profile: ModelProfile, checkpointed: set[str], micro_batches: int = 1,
                boundaries_on_host: bool = False) -> mm.Activations:
    """Activations from the trace of one micro-batch: saved until backward (a checkpointed unit keeps its input),
    and the backward peak (+ the largest checkpointed unit's recomputation + the transient beyond what is saved).
    `micro_batches` > 1 (unit-major order): every micro-batch's are saved at once but the tail's, which runs its
    backward as its forward ends and leaves the gradient of the last unit's output instead ([Note: the tail per
    micro-batch] in offload/step/unit_major.py); the recomputation and the transient are one micro-batch's, which
    backward runs one at a time. `boundaries_on_host`: the checkpointed
    units' inputs wait in host memory ([Note: boundaries on the host] in offload/step/boundaries.py); the device
    holds a unit's M outputs and the inputs it has yet to compute (M + 1), or the backward's window."""
    ck = [u for u in profile.units if u.name in checkpointed and u.checkpointable]
    kept = micro_batches * sum(u.act_saved for u in profile.units if u not in ck)
    if micro_batches > 1 and profile.tail_saved:
        kept += micro_batches * profile.tail_input - (micro_batches - 1) * profile.tail_saved
    inputs = sum(u.act_input for u in ck)
    host = 0
    if boundaries_on_host and ck:
        host = micro_batches * inputs
        saved = kept + max(micro_batches + 1, BOUNDARY_WINDOW) * max(u.act_input for u in ck)
    else:
        saved = kept + micro_batches * inputs
    recompute = max((u.act_recompute or u.act_saved for u in ck), default=0)
    return mm.Activations(saved=saved, peak=saved + recompute + profile.act_transient,
                          root_grads_early=profile.root_grads_early, at_root_end=profile.act_at_root_end,
                          host_saved=host)


def host_pass_bytes(profile: ModelProfile, placement: Placement, shape: TrainShape) -> tuple[float, float]:
    """Bytes the CPU's elementwise passes move per step on a GPU machine besides AdamW's ([Note: host passes]):
    (in backward, on the gradient worker; in the step, on the step thread)."""
    parts = [unit_pass_bytes(u, placement, shape) for u in profile.units]
    return sum(b for b, _ in parts), sum(s for _, s in parts)


def unit_pass_bytes(u: UnitProfile, placement: Placement, shape: TrainShape) -> tuple[float, float]:
    """One unit's part of `host_pass_bytes`."""
    a, c = shape.grad_accum, shape.compute_bytes
    up, n = placement.of(u.name), u.trainable
    backward = step = 0.0
    if n and u.keeps_grads and up.grads != Tier.DEVICE and not shape.unit_major:  # unit-major: on the device
        backward = sum(micro_pass_bytes(u, placement, shape, m) for m in range(a))
    if u.stepped_numel and not _optimizer_on_device(placement, u.name):
        step = n * 8 if shape.grad_clip else 0  # the clip coefficient's multiply
        if (up.params != up.master or c != 4) and not casts_on_device(u, placement, shape):
            step += n * (4 + c)  # the compute copy is not the master: the cast (unless the device casts)
    return backward, step


def micro_pass_bytes(u: UnitProfile, placement: Placement, shape: TrainShape, micro: int) -> int:
    """Bytes the gradient worker moves over unit `u`'s gradients of micro-batch `micro` on a GPU machine: its add
    into the sum, and in a step that clips, the sum's norm after the last micro-batch."""
    if not u.trainable or not u.keeps_grads or placement.of(u.name).grads == Tier.DEVICE or shape.unit_major:
        return 0
    norm = 4 if shape.grad_clip and micro == shape.grad_accum - 1 else 0
    return u.trainable * (_sum_bytes(shape.compute_bytes, micro, placement) + norm)


def grads_off_bytes(u: UnitProfile, placement: Placement, shape: TrainShape, micro: int) -> int:
    """Bytes of unit `u`'s gradients of micro-batch `micro` over the link to their tier off the device: fp32 for a
    step's first where they land as the sum ([Note: gradients land converted]), else the compute dtype's."""
    if not u.trainable or not u.keeps_grads or placement.of(u.name).grads == Tier.DEVICE:
        return 0
    if shape.unit_major:  # the step's fp32 sums, once ([Note: gradient sums on the device] in offload/step/unit.py)
        return u.trainable * 4 if micro == 0 else 0
    fp32 = micro == 0 and mm.first_lands_as_sum(shape.compute_bytes, placement.land_grads_fp32)
    return u.trainable * (4 if fp32 else shape.compute_bytes)


def _sum_bytes(compute_bytes: int, micro: int, placement: Placement) -> int:
    """Bytes per parameter the gradient worker's add of micro-batch `micro` moves: from the second micro-batch on the
    pack read and the fp32 sum read and written; none for the first, which lands as the sum, unless it comes in the
    compute dtype (`Placement.land_grads_fp32` False): then the pack read and the sum written."""
    if micro:
        return compute_bytes + 8
    return 0 if mm.first_lands_as_sum(compute_bytes, placement.land_grads_fp32) else compute_bytes + 4


def host_pass_rate(hw: HardwareProfile) -> float:
    """Bytes per second of the engine's host passes ([Note: host passes]): measured, or AdamW's at its rate."""
    return hw.host_pass_bw or 28 * hw.cpu_adam_rate


def stream_unit_bytes(profile: ModelProfile, placement: Placement, shape: TrainShape) -> int:
    """Bytes of the largest fetch of a unit whose parameters are streamed (`fetch_bytes`; 0 when none is)."""
    sizes = [fetch_bytes(u, placement, shape) for u in profile.units
             if placement.of(u.name).params != Tier.DEVICE or not u.holds_params]
    return max(sizes, default=0)


def _optimizer_on_device(placement: Placement, name: str) -> bool:
    up = placement.of(name)
    return up.master == up.grads == up.optim == Tier.DEVICE


def shares_ram(placement: Placement, hw: HardwareProfile) -> bool:
    """Device and host tiers draw on one RAM budget: a CPU-only machine whose device tier has no budget of its own
    (the search's placements until `engine_budgets` gives it one)."""
    return not hw.cuda and placement.device_budget is None


def step_memory(profile: ModelProfile, placement: Placement, hw: HardwareProfile,
                shape: TrainShape) -> mm.StepMemory:
    """Bytes per phase and tier of `placement` ([Note: memory]). The pool is what the schedule needs, cut to the
    host room the budgets leave: the host budget less the host tier (and, when the RAM is shared, less the device
    at its peak), never below one working set."""
    units, c = unit_sizes(profile), shape.compute_bytes
    act = activations(profile, set(placement.checkpoint_units), shape.resident_micro_batches,
                      shape.boundaries_on_host)
    separate = separate_memory("cuda" if hw.cuda else "cpu")
    room = None
    if placement.host_budget is not None:
        room = placement.host_budget - mm.tier_states(units, placement, c, separate)[Tier.HOST]
        if shares_ram(placement, hw):
            room -= mm.step_memory(units, placement, c, hw.cuda, act, pool=0, separate=separate).peak("device")
    pool = mm.pool_bytes(units, placement, c, separate, room, accum=shape.passes)
    # The math libraries' workspace is per thread (cuBLAS: a handle per thread, a workspace per handle and stream,
    # kept): a unit-major pass's micro-batch threads hold one each besides the caller's.
    threads = 1 + (shape.grad_accum if shape.unit_major else 0)
    return mm.step_memory(units, placement, c, hw.cuda, act, pool, separate=separate,
                          workspace=threads * hw.device_workspace if hw.cuda else 0, sums=shape.unit_major)


def memory(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape,
           pred: Prediction) -> Prediction:
    """Fill `pred`'s memory figures: peak bytes per tier, their components in the phase of each peak, and the
    engine's own device count at its peak ([Note: memory])."""
    sm = step_memory(profile, placement, hw, shape)
    pred.peak = {t.value: sm.peak(t.value) for t in Tier}
    pred.breakdown = {t.value: sm.peak_parts(t.value) for t in Tier}
    pred.engine_device = sm.engine_device()
    units = unit_sizes(profile)
    pred.save_bytes = mm.save_bytes(units, placement, profile.largest_param) if shape.checkpoints else 0
    pred.device_states = mm.tier_states(units, placement, shape.compute_bytes)[Tier.DEVICE]
    pred.allreduce_buffer = allreduce_buffer_bytes(profile, shape, hw.cuda)
    return pred


def engine_budgets(placement: Placement, pred: Prediction) -> Placement:
    """`placement` with the budgets its engine enforces set to the predicted figures: the device budget to the
    engine's own count at its peak, the host budget to host tier + pool. The engine never prefetches past its
    device budget and its pool never grows past its host budget, so the prediction is the bound ([Note: the pool]
    in memory_model.py); any smaller figure would be refused at wrap time or not fit a step.

    Except the device budget of a tiled placement, which stays what the search gave it: tiles and leaves of a tiled
    block are units of their own, and those that take one input (q, k and v projections; tiles split along the
    output) all stay materialised in backward until that input's gradient is complete, more than the model's two
    overlapping units (the tiling test's engine peaked at 9.1 MiB against 7.2 MiB predicted)."""
    device = placement.device_budget if placement.tiled_linears else pred.engine_device
    return replace(placement, device_budget=device, host_budget=pred.peak["host"])


def work_time(w: Work, hw: HardwareProfile) -> float:
    """Roofline per bucket: matmul FLOPs at the measured rate for their size, memory-bound bytes at memory
    bandwidth, plus a fixed dispatch cost per op."""
    return kernel_time(w, hw) + w.n_ops * hw.op_overhead_s


def kernel_time(w: Work, hw: HardwareProfile) -> float:
    """The roofline alone (what the device spends, without the host's issuing): matmul FLOPs at the measured rate
    for their size, fused attention's at the attention rate for its size ([Note: attention's own rate] in
    work.py), the bytes of each elementwise op the probe timed alone at its rate where it is slower than memory
    ([Note: ops slower than their bytes]), the other ops' bytes at memory bandwidth."""
    t = sum(f / hw.matmul_rate(size) for size, f in w.gemm_flops.items())
    t += sum(f / hw.attention_rate(size) for size, f in w.attn_flops.items())
    t += sum(b / hw.timed_op_rate(op) for op, b in w.timed_bytes.items())
    return t + w.mem_bytes / hw.mem_bw


def unit_host_time(hw: HardwareProfile, shape: TrainShape, streamed: bool) -> float:
    """The engine's host time for one unit and micro-batch, forward and backward ([Note: the host floor]): more for
    a unit whose parameters stream (in micro-batch-major order, where each micro-batch streams it; see
    `engine_host_time` for unit-major order); none without the engine."""
    if not shape.engine:
        return 0.0
    return hw.unit_overhead_s + (hw.stream_overhead_s if streamed else 0.0)


def unit_pass_host_time(hw: HardwareProfile, shape: TrainShape, streamed: bool) -> float:
    """The engine's host time for one unit in one pass (forward and backward; [Note: the host floor]): its hooks
    for each micro-batch the pass runs (every one in unit-major order, one in micro-batch-major order), and for a
    streamed unit what streaming it costs beyond (`stream_overhead_s`: its fetch and release, its gradients' hand-off
    to the host), which comes with each crossing of the link: once a pass."""
    if not shape.engine:
        return 0.0
    micro = shape.grad_accum // shape.passes
    return micro * hw.unit_overhead_s + (hw.stream_overhead_s if streamed else 0.0)


def engine_host_time(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape) -> float:
    """The engine's own host time per step ([Note: the host floor]): each unit's per pass, and the step's."""
    if not shape.engine:
        return 0.0
    per_pass = sum(unit_pass_host_time(hw, shape, placement.of(u.name).params != Tier.DEVICE)
                   for u in profile.units)
    return shape.passes * per_pass + hw.step_overhead_s


def kept_for_backward(profile: ModelProfile, placement: Placement) -> set[str]:
    """Units whose params a forward's fetch leaves on the device for their backward ([Note: phases] in
    offload/memory_model.py): the root (materialised from forward start to its gradients) and the last
    `prefetch_depth` blocks of forward, the first of backward (the reuse distance)."""
    blocks = [u.name for u in profile.units if u.name != ROOT_UNIT]
    depth = min(placement.prefetch_depth, len(blocks))
    return {ROOT_UNIT, *blocks[len(blocks) - depth:]}


def fetches_per_micro(name: str, kept: set[str]) -> int:
    """Fetches of a streamed unit's params per micro-batch: its forward's, and its backward's unless its params were
    kept (`kept_for_backward`). A checkpointed unit's recomputation runs inside its backward, on the params that
    backward fetched: no fetch of its own (the engine's bytes to the device, tests/test_planner.py)."""
    return 1 if name in kept else 2


def traffic(profile: ModelProfile, placement: Placement, shape: TrainShape) -> dict[str, float]:
    """Bytes moved per optimizer step on each link (see docs/PLANNER.md, "Traffic")."""
    t = {"h2d": 0.0, "d2h": 0.0, "nvme_read": 0.0, "nvme_write": 0.0, "h2d_opt": 0.0, "nvme_read_opt": 0.0,
         "nvme_write_opt": 0.0}
    a = shape.passes  # unit-major: each unit's params and gradients cross once a step
    # Fetched last in forward and kept for backward: their staging buffer is their step's fp32 master ([Note: master
    # from the fetch] in offload/step/unit.py). (With a step declared before backward, as `tightfit train` does, every
    # unit's backward fetch is; counted only for these, the reads are an upper bound.)
    last_fetched = kept_for_backward(profile, placement)
    for u in profile.units:
        up = placement.of(u.name)
        p = u.numel * shape.compute_bytes
        uses = fetches_per_micro(u.name, last_fetched) * a
        if up.params != Tier.DEVICE or not u.holds_params:
            t["h2d"] += uses * fetch_bytes(u, placement, shape)
            if up.params == Tier.NVME and u.holds_params:  # ZeRO-3: its owner reads it once for every rank
                t["nvme_read"] += uses * p
        g = u.trainable * 4
        if up.grads != Tier.DEVICE and u.keeps_grads:  # another rank's (ZeRO-2) are reduced to it on the device
            t["d2h"] += sum(grads_off_bytes(u, placement, shape, m) for m in range(a))
            if up.grads == Tier.NVME:  # accumulate: write each micro-batch, read back all but the first
                t["nvme_write"] += a * g
                t["nvme_read"] += (a - 1) * g
                t["nvme_read_opt"] += g if u.stepped else 0
        if not u.stepped:  # its new values come from the rank that steps it, written to its params' tier
            if not u.holds_params:  # ZeRO-3: or sent for each use, kept nowhere here
                continue
            if up.params == Tier.DEVICE:
                t["h2d_opt"] += p
            elif up.params == Tier.NVME:
                t["nvme_write_opt"] += u.numel * shape.compute_bytes
            continue
        if not _optimizer_on_device(placement, u.name):
            if up.grads == Tier.DEVICE:
                t["d2h"] += g
            if up.params == Tier.DEVICE:
                t["h2d_opt"] += p  # updated compute parameters go back up
        elif up.params != Tier.DEVICE and state_bytes(u, State.MASTER, placement, shape):
            # The device's step casts the new master into the compute copy on its tier (`_cast_to` in
            # offload/step/optimizer.py): down the link (an NVMe copy's write is counted below).
            t["d2h"] += u.trainable * shape.compute_bytes
        for s in (State.MASTER, State.OPTIM):
            if up.tier(s) == Tier.NVME:
                nbytes = state_bytes(u, s, placement, shape)
                t["nvme_read_opt"] += nbytes
                t["nvme_write_opt"] += nbytes
        if up.params == Tier.NVME and u.trainable:
            if state_bytes(u, State.MASTER, placement, shape):  # a separate master, counted above
                t["nvme_write_opt"] += u.trainable * shape.compute_bytes  # the compute copy's refreshed prefix
            else:  # fp32 params are their own master: the step reads and rewrites their trainable prefix
                t["nvme_read_opt"] += 0 if u.name in last_fetched else g
                t["nvme_write_opt"] += g
    if shape.boundaries_on_host:  # each saved unit input down in forward, up in backward ([Note: boundaries ...])
        moved = activations(profile, set(placement.checkpoint_units), shape.resident_micro_batches, True).host_saved
        t["h2d"] += moved
        t["d2h"] += moved
    return t


def steps_under_backward(profile: ModelProfile, shape: TrainShape) -> bool:
    """Whether the engine steps each unit during the last backward: nothing needs every gradient first (no clip, no
    fp16 loss scaler: train/memory.py's `OffloadMemory.backward`)."""
    return not shape.grad_clip and profile.compute_dtype != "fp16" and shape.engine


def unit_cpu_step(u: UnitProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape) -> float:
    """Seconds of one unit's CPU optimizer step: AdamW and its host passes ([Note: host passes])."""
    return u.stepped_numel / hw.cpu_adam_rate + unit_pass_bytes(u, placement, shape)[1] / host_pass_rate(hw)


def last_gradient_pass(u: UnitProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape) -> float:
    """Seconds of the gradient worker's pass over one unit's gradients of the last micro-batch, in a step that steps
    under backward (no clip: no norm pass): where micro-batches came before, the pack read and the sum read and written
    ([Note: host passes], [Note: one memory under backward])."""
    if not u.trainable or not u.keeps_grads or placement.of(u.name).grads == Tier.DEVICE or shape.unit_major:
        return 0.0
    return u.trainable * _sum_bytes(shape.compute_bytes, shape.grad_accum - 1, placement) / host_pass_rate(hw)


def backward_arrivals(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape,
                      phase_a: float) -> list[tuple[UnitProfile, float]]:
    """(unit, when its gradients are complete, from the start of the step) in the last backward, in the order they
    complete: the blocks last to first, then the root (a language model's embedding gradient comes last). The last
    micro-batch takes its share of phase A, its backward the backward's share of that, and each unit its own share
    of the backward (its kernels', recomputation included).

    The backward's share is that of the stream that binds each half: the compute's (split by the kernels' times),
    or the link's where it takes longer (a forward fetches every streamed unit, a backward those not kept for it and
    sends every gradient down): a forward bound by its fetches ends later than its kernels' share says."""
    fwd = {u.name: kernel_time(u.fwd, hw) for u in profile.units}
    bwd = {u.name: kernel_time(u.bwd, hw) + (fwd[u.name] if u.name in placement.checkpoint_units else 0.0)
           for u in profile.units}
    total_bwd = sum(bwd.values())
    total = sum(fwd.values()) + total_bwd
    a = shape.passes  # the last backward: the last micro-batch's, or a unit-major pass's (all of them)
    compute = compute_time(profile, placement, hw, shape)[0] / a
    share = total_bwd / total if total else 0.0
    kept = kept_for_backward(profile, placement)
    streamed = [u for u in profile.units if placement.of(u.name).params != Tier.DEVICE]
    fetch_f = sum(fetch_bytes(u, placement, shape) for u in streamed) / hw.h2d_bw
    fetch_b = sum(fetch_bytes(u, placement, shape) for u in streamed if u.name not in kept) / hw.h2d_bw
    down = sum(grads_off_bytes(u, placement, shape, a - 1) for u in profile.units) / hw.d2h_bw
    f, b = max(compute * (1 - share), fetch_f), max(compute * share, fetch_b, down)
    backward = phase_a / a * (b / (f + b) if f + b else 0.0)
    order = [u for u in reversed(profile.units) if u.name != ROOT_UNIT] + \
        [u for u in profile.units if u.name == ROOT_UNIT]
    t, out = phase_a - backward, []
    for u in order:
        t += backward * bwd[u.name] / total_bwd if total_bwd else 0.0
        out.append((u, t))
    out[-1] = (out[-1][0], phase_a)
    return out


# [Note: the step under backward] Without clipping, on a GPU machine, the engine steps each unit on the CPU as soon as
# its gradients of the last micro-batch have landed and been added, while the GPU runs the rest of the backward
# (`step_during_backward`, docs/ENGINE.md "Clipping and overlap"). The CPU's steps run one after another, each no
# earlier than its unit's gradients: the optimizer ends at max(arrival + the steps from that unit on) over the
# units in arrival order, and phase B is what of it is left after phase A: the root's step at least (its embedding
# gradient lands last), all of it when the CPU is the slower side by more than the backward. A model with one
# block barely overlaps; one whose CPU step is short against its backward ends with the root's step.
#
# [Note: one memory under backward] Under the last backward two host threads pass over the same memory: the gradient
# worker adds each unit's last gradients into their sum, the step thread runs AdamW and the master's cast on the
# units whose sums are done. Each pass is bound by the host's memory and the probe measures each alone, on every
# core; at once they share it. The second H200 run (benchmarks/RESULTS.md, "GPU check") measured the 1.2 B GPT's step
# thread at 0.70 s for 1.21 G parameters while the worker's passes ran beside it (0.39 s), where AdamW alone runs
# 3.35-3.92 G parameters/s over 64 M. So a unit's CPU step follows its gradients' last pass on one queue: the
# worker's pass over a unit's last gradients is counted before that unit's step. The earlier micro-batches' passes,
# under backwards with no step beside them, stay a stream of phase A of their own.


def cpu_step_after_backward(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape,
                            phase_a: float) -> float:
    """Seconds the CPU optimizer runs after phase A when it steps during the last backward ([Note: the step under
    backward]), each unit's step after the gradient worker's last pass over its gradients ([Note: one memory under
    backward])."""
    end = 0.0
    for u, ready in backward_arrivals(profile, placement, hw, shape, phase_a):
        if u.stepped_numel and not _optimizer_on_device(placement, u.name):
            end = max(end, ready) + last_gradient_pass(u, placement, hw, shape) + unit_cpu_step(u, placement, hw, shape)
    return max(0.0, end - phase_a)


def last_passes_end(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape,
                    phase_a: float) -> float:
    """When the gradient worker's passes over the last micro-batch's gradients end, from the start of the step, in a
    step whose CPU optimizer waits for backward: each unit's pass no earlier than its gradients (`backward_arrivals`),
    one after another. (Phase A's stream of passes cannot end before it.)"""
    end = 0.0
    for u, ready in backward_arrivals(profile, placement, hw, shape, phase_a):
        end = max(end, ready) + last_gradient_pass(u, placement, hw, shape)
    return end


# [Note: the step under the next forward] The steps left after backward (every unit's with a clip, the last ones'
# without) run on the step thread under the next forward, in its order (offload/step/step_queue.py): the forward
# reaches unit k after the units before it, and waits there only if the step thread has not stepped unit k by then.
# The wait is what adds to the step. The root's step comes first and its forward (the embedding) is not worth
# counting, so it waits whole; a block's forward is one micro-batch's in micro-batch-major order (the first
# micro-batch of the next step needs the unit stepped), all of them in unit-major order. The work left is the steps
# of the units backward reached last, which are the first the next forward needs: it is laid on the units in the
# forward's order, each up to its whole step (the optimizer's time split among the units by their trainable
# parameters: it is per parameter), stretched where the work is bound by the disk or the uploads rather than the CPU.


def optimizer_under_forward(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape,
                            after_s: float, whole_s: float) -> float:
    """Seconds of the optimizer's `after_s` (its work left after backward: CPU, disk and uploads) that the next
    forward cannot hide, out of a whole step's CPU optimizer time `whole_s` ([Note: the step under the next
    forward])."""
    cpu = [(u, u.stepped_numel) for u in profile.units
           if u.stepped_numel and not _optimizer_on_device(placement, u.name)]
    total = sum(n for _, n in cpu)
    if not total or after_s <= 0:
        return max(0.0, after_s)
    reps = shape.grad_accum if shape.unit_major else 1
    fwd = {u.name: reps * work_time(u.fwd, hw) for u in profile.units if u.name != ROOT_UNIT}
    order = [(u, n) for u, n in cpu if u.name == ROOT_UNIT] + [(u, n) for u, n in cpu if u.name != ROOT_UNIT]
    stretch = max(1.0, after_s / whole_s) if whole_s > 0 else 1.0
    left, stepped, reached, exposed = after_s, 0.0, 0.0, 0.0
    for u, n in order:
        mine = min(left, stretch * whole_s * n / total) if whole_s > 0 else after_s * n / total
        left -= mine
        stepped += mine
        exposed += max(0.0, stepped - (reached + exposed))
        reached += fwd.get(u.name, 0.0)
    return exposed


def exchange_copies(tr: dict[str, float], profile: ModelProfile, shape: TrainShape) -> dict[str, float]:
    """`tr` with ZeRO-3's copies through the device on a GPU: NCCL carries device tensors, so for each use of a unit's
    parameters its owner uploads them from its exchange buffer and every other rank copies the broadcast down into
    its own ([Note: the wire's device buffer] in parallel/wire.py), before the use's fetch (in `traffic`) uploads
    them again: a rank owns one use in `ranks` (its upload) and receives the others (their downloads)."""
    if not sends_params(profile):
        return tr
    sent = exchange_bytes(profile, shape)
    return {**tr, "h2d": tr["h2d"] + sent / shape.ranks, "d2h": tr["d2h"] + sent * (shape.ranks - 1) / shape.ranks}


def link_time(tr: dict[str, float], hw: HardwareProfile) -> float:
    """Seconds phase A's host<->device copies (`traffic`) take on a GPU: each direction at its own rate, and both
    at once share the link, no less than all the bytes at the rate both together reach (`duplex_bw`)."""
    both = (tr["h2d"] + tr["d2h"]) / hw.duplex_bw if hw.duplex_bw else 0.0
    return max(tr["h2d"] / hw.h2d_bw, tr["d2h"] / hw.d2h_bw, both)


def disk_time(read: float, write: float, hw: HardwareProfile) -> float:
    """Seconds the disk needs to read and write these bytes in one phase: each direction at its own sustained rate,
    one after the other; and where the probe measured both in flight at once (`nvme_mixed_bw`), no less than all
    the bytes at that rate ([Note: sustained bandwidth] in disk_probe.py: a disk written while it is read may
    deliver less in all than either direction alone)."""
    t = read / hw.nvme_read_bw + write / hw.nvme_write_bw
    if hw.nvme_mixed_bw and read and write:
        t = max(t, (read + write) / hw.nvme_mixed_bw)
    return t


UNIT_MAJOR_SWITCH_S = 60e-6
"""Host seconds a unit-major pass spends handing the turn from one micro-batch's thread to the next, per unit and
micro-batch (offload/step/unit_major.py; a condition variable's round trip and the GIL, 40-80 us on the 2-core VM)."""


def compute_time(profile: ModelProfile, placement: Placement, hw: HardwareProfile,
                 shape: TrainShape) -> tuple[float, float, float]:
    """(compute, its kernels, the host's issuing) of every micro-batch's forward and backward, recomputation
    included, in seconds. [Note: the host floor]: a GPU runs what the host issued before while the host issues more;
    a CPU does both on its cores.

    [Note: a unit-major forward on the CPU] A unit-major pass runs each micro-batch's forward on a thread of its own
    (offload/step/unit_major.py). Each thread that runs a parallel region gets an OpenMP pool of its own, and once
    the pools hold more threads than the machine has cores libgomp stops spinning at every barrier: on the 2-core VM
    the micro-batch threads' forward ran at one core's speed with one intra-op thread or two (benchmarks/RESULTS.md,
    batch AG). So on a CPU the forward's kernels of a unit-major pass are counted at one core (`hw.threads` times
    the measured rates'); backward and recomputation run on the caller's thread, once those threads have ended. A
    GPU's forward threads only launch kernels."""
    a = shape.grad_accum
    kernels, host = 0.0, engine_host_time(profile, placement, hw, shape)
    slow = hw.threads if shape.unit_major and not hw.cuda else 1
    for u in profile.units:
        recompute = u.name in placement.checkpoint_units  # recomputation runs the forward again, in backward
        kernels += a * ((slow + recompute) * kernel_time(u.fwd, hw) + kernel_time(u.bwd, hw))
        host += a * ((1 + recompute) * u.fwd.n_ops + u.bwd.n_ops) * hw.op_overhead_s
    if shape.unit_major:
        host += a * len(profile.units) * UNIT_MAJOR_SWITCH_S
    return (max(kernels, host) if hw.cuda else kernels + host), kernels, host


def step_time(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape,
              pred: Prediction) -> None:
    """Fill the time terms of `pred`.

    Phase A (forward + backward of every micro-batch): compute, host->device, device->host and disk run on
    separate hardware and overlap; phase time = slowest stream + the exposed fetch of the first unit. The two
    directions of copies together take no less than their bytes at the measured both-ways rate (`duplex_bw`).
    Phase B (optimizer): the CPU optimizer overlaps the disk traffic of the states it updates.
    Gradient clipping makes B wait for all of A; without clipping, on a GPU machine, the CPU steps each unit as its
    gradients land in the last backward, and B is what is left of it after A ([Note: the step under backward]).
    On a CPU-only machine compute, memcpy and the optimizer share the cores, so those terms add instead of
    overlapping; only the disk runs beside them.
    """
    a = shape.grad_accum
    hw = node_share(hw, shape.node_ranks)
    compute, kernels, host = compute_time(profile, placement, hw, shape)
    tr = traffic(profile, placement, shape)
    if hw.cuda:
        tr = exchange_copies(tr, profile, shape)
    pred.traffic = {k: v for k, v in tr.items()}
    h2d = tr["h2d"] / hw.h2d_bw
    d2h = tr["d2h"] / hw.d2h_bw
    disk_a = disk_time(tr["nvme_read"], tr["nvme_write"], hw)
    disk_b = disk_time(tr["nvme_read_opt"], tr["nvme_write_opt"], hw)
    h2d_b = tr["h2d_opt"] / hw.h2d_bw
    cpu_opt = sum(u.stepped_numel for u in profile.units if not _optimizer_on_device(placement, u.name))
    dev_opt = sum(u.stepped_numel for u in profile.units if _optimizer_on_device(placement, u.name))
    opt = cpu_opt / hw.cpu_adam_rate + dev_opt / hw.device_adam_rate

    first = stream_unit_bytes(profile, placement, shape)
    exposed = first / hw.h2d_bw if first else 0.0
    if any(placement.of(u.name).params == Tier.NVME for u in profile.units):
        exposed += first / hw.nvme_read_bw
    reduce, tail = allreduce_in_step(profile, shape, hw.cuda)
    if hw.cuda:
        alone = link_time(tr, hw)
        # ZeRO-3's broadcasts cross the links as the average does where they are the copies' lanes (PCIe)
        sent = exchange_time(profile, shape) if sends_params(profile) else 0.0
        link = alone + ((reduce + sent) if shape.allreduce_on_link else 0.0)
        backward_passes, step_passes = (b / host_pass_rate(hw) for b in host_pass_bytes(profile, placement, shape))
        early = steps_under_backward(profile, shape)
        # The last micro-batch's passes follow its gradients' arrivals: stepping under backward they queue with the
        # steps ([Note: one memory under backward]), otherwise phase A ends no earlier than they do. Phase A's
        # stream of passes holds the earlier micro-batches'.
        last_passes = sum(last_gradient_pass(u, placement, hw, shape) for u in profile.units)
        floor = max(compute, alone, disk_a, backward_passes - last_passes)
        averaged = max(floor, link - sent, reduce) + tail  # phase A with the average, without the broadcasts
        phase_a = max(floor, link, reduce) + tail
        pred.allreduce_s = averaged - floor
        if sent and shape.allreduce_on_link:  # the broadcasts in the link's stream: what they added to phase A
            pred.exchange_s = phase_a - averaged
        cpu_step = cpu_opt / hw.cpu_adam_rate + step_passes
        if early:
            cpu_step = cpu_step_after_backward(profile, placement, hw, shape, phase_a)
        elif last_passes:
            phase_a = max(phase_a, backward_passes, last_passes_end(profile, placement, hw, shape, phase_a))
        after = max(cpu_step, disk_b, h2d_b)
        whole = cpu_opt / hw.cpu_adam_rate + step_passes + (sum(last_gradient_pass(u, placement, hw, shape)
                                                                 for u in profile.units) if early else 0.0)
        pred.optim_exposed_s = optimizer_under_forward(profile, placement, hw, shape, after, whole)
        # NCCL's exchange: ZeRO-3's each use's params beside the compute, as fetches are (in phase A; on PCIe in the
        # link's stream, above); zero1/zero2's new values beside the next forward ([Note: the exchange under the
        # next forward] in parallel/sharded_optimizer.py): what that compute does not hide
        exchange_b = 0.0
        if sent and not shape.allreduce_on_link:  # their own lanes (NVLink): what the compute does not hide
            pred.exchange_s = max(0.0, sent - phase_a)
            phase_a += pred.exchange_s
        elif not sent:
            forward = sum(work_time(u.fwd, hw) for u in profile.units) * (a if shape.unit_major else 1)
            pred.exchange_s = exchange_b = max(0.0, exchange_time(profile, shape) - forward)
        phase_b = pred.optim_exposed_s + dev_opt / hw.device_adam_rate + exchange_b
        pred.optim_after_s = cpu_step
        opt += step_passes
        pred.passes_s = backward_passes + step_passes
        terms = {"compute" if kernels >= host else "host issuing ops": compute, "host<->device": link,
                 "nvme": disk_a, "host gradient sums": backward_passes - last_passes, "all-reduce": reduce + tail}
    else:
        # One set of cores: compute and memcpy serialise; the disk threads wait on DMA and overlap.
        phase_a = max(compute + h2d + d2h + reduce, disk_a)
        pred.allreduce_s = reduce
        # gloo on the cores that compute: ZeRO-3's beside forward and backward, zero1/2's beside the next forward
        pred.exchange_s = exchange_time(profile, shape)
        phase_a += pred.exchange_s if sends_params(profile) else 0.0
        phase_b = max(opt + h2d_b, disk_b) + (0.0 if sends_params(profile) else pred.exchange_s)
        terms = {"compute": compute, "host<->device": h2d + d2h, "nvme": disk_a, "all-reduce": reduce}
    pred.compute_s, pred.copy_s, pred.nvme_s, pred.optim_s = compute, h2d + d2h + h2d_b, disk_a + disk_b, opt
    pred.host_s = host
    pred.exposed_s = exposed
    pred.phase_a_s = phase_a
    pred.step_s = phase_a + phase_b + exposed
    # The bottleneck is the largest contributor to the critical path of the longer phase.
    if phase_b > phase_a:
        pred.bottleneck = "nvme" if disk_b > (cpu_step if hw.cuda else opt + h2d_b) else "cpu optimizer"
    elif hw.cuda:
        pred.bottleneck = max(terms, key=terms.get)
    else:
        pred.bottleneck = "nvme" if disk_a > compute + h2d + d2h + reduce else \
            max((k for k in terms if k != "nvme"), key=terms.get)
    tokens = shape.tokens_per_micro * a
    pred.tokens_per_s = tokens / pred.step_s if pred.step_s > 0 else 0.0


def predict(profile: ModelProfile, placement: Placement, hw: HardwareProfile, shape: TrainShape) -> Prediction:
    """Memory and time of `placement`."""
    pred = memory(profile, placement, hw, shape, Prediction(runtime_rss=hw.runtime_rss))
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
    fetch = max(fetch_bytes(u, placement, shape) for u in streamed) / fetch_bw
    # A unit's forward: its kernels and ops, and the forward's half of the engine's host time for it.
    per_unit = min(work_time(u.fwd, hw) for u in streamed) + unit_host_time(hw, shape, streamed=True) / 2
    per_unit = per_unit or 1e-9
    return max(1, min(4, math.ceil(fetch / per_unit)))
