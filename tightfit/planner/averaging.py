"""The gradients' average over replicas, priced in a rank's step: the planner's model of parallel/replicas.py.

[Note: the gradients' average in the step] With `--strategy ddp --offload host|nvme` each rank's engine averages
its gradients over the group as they leave the device (parallel/replicas.py): every trainable gradient once per
pass (per micro-batch in micro-batch-major order, in the compute dtype; once a step as fp32 sums in unit-major
order), `allreduce_bytes`. A ring all-reduce of B bytes over n ranks takes 2(n-1)/n x B / bus bandwidth; the bus
bandwidth is measured in the run's group before it plans, or assumed for `tightfit plan` (parallel/links.py).
- On a CPU-only machine gloo adds, sums and copies through loopback on the cores the step computes on, and a
  message waits for its peer's thread to be scheduled beside them: beside a step it moved its bytes at 0.35-0.46
  of the bus bandwidth its group measured idle just before (GLOO_BESIDE_A_STEP = 0.4; 2 ranks on the 2-core VM,
  13 M parameters, six runs: 206 MB a step costing 314-361 ms more than one process's step in micro-batch-major
  order, 52 MB costing 102-113 ms in unit-major order; benchmarks/RESULTS.md batch AK). It adds to phase A.
- On a GPU, NCCL runs beside the backward on its own stream: phase A is the longer of the backward's streams and
  the all-reduces, plus the root's average, which starts when the backward ends (its gradients are the last). Over
  PCIe without NVLink the all-reduce crosses the lanes the offload's copies use, and is added to the link's time.
Nothing here is measured on a GPU yet.

[Note: a node's ranks share it] The ranks on one node each plan for their share of its host memory and swap disk
(parallel/rank_plan.py, `rank_config`), and they also share what moves the bytes: one swap disk's bandwidth, and on
a GPU machine the CPU cores that step AdamW and make the host passes, and the host memory they stream. Each rank's
step is priced at its share (`node_share`: the disk's rates, and on a GPU the CPU optimizer's and the host passes'
rates, divided by the node's ranks); a GPU's own link to the host and its compute are its own. On a CPU-only
machine the ranks' `--threads` divide the cores, and the probe measured the rates at a rank's threads.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from tightfit.offload.placement import ROOT_UNIT

if TYPE_CHECKING:
    from tightfit.planner.costs import TrainShape
    from tightfit.planner.hardware import HardwareProfile
    from tightfit.planner.model_profile import ModelProfile


GLOO_BESIDE_A_STEP = 0.4
"""On a CPU-only machine a gloo all-reduce runs on the cores the step computes on: beside a step it moved its bytes
at 0.35-0.46 of the bus bandwidth measured idle ([Note: the gradients' average in the step])."""


def grad_itemsize(shape: TrainShape) -> int:
    """Bytes per element of a gradient as it leaves the device: the fp32 sums in unit-major order, else the compute
    dtype's `param.grad` ([Note: gradient sums on the device] in offload/step/unit.py)."""
    return 4 if shape.unit_major else shape.compute_bytes


def allreduce_bytes(profile: ModelProfile, shape: TrainShape) -> int:
    """Bytes each rank averages per step: every trainable gradient once per pass, as the engine holds it when it
    leaves the device (`grad_itemsize`)."""
    if shape.ranks < 2:
        return 0
    return sum(u.trainable for u in profile.units) * grad_itemsize(shape) * shape.passes


def allreduce_time(nbytes: float, shape: TrainShape) -> float:
    """Seconds a ring all-reduce of `nbytes` takes over the group at its bus bandwidth, idle."""
    if shape.ranks < 2 or not nbytes:
        return 0.0
    return 2 * (shape.ranks - 1) / shape.ranks * nbytes / shape.allreduce_bw


def allreduce_in_step(profile: ModelProfile, shape: TrainShape, cuda: bool) -> tuple[float, float]:
    """(the all-reduces' time beside phase A, the tail after the backward) of a step ([Note: the gradients' average
    in the step])."""
    whole = allreduce_time(allreduce_bytes(profile, shape), shape)
    if any(not u.keeps_grads for u in profile.units):  # ZeRO-2: reduced to each unit's rank, half a ring all-reduce
        whole /= 2
    if not whole:
        return 0.0, 0.0
    if not cuda:
        return whole / GLOO_BESIDE_A_STEP, 0.0
    root = sum(u.trainable for u in profile.units if u.name == ROOT_UNIT)  # its gradients are the backward's last
    return whole, allreduce_time(root * grad_itemsize(shape), shape)


def shards_optimizer(profile: ModelProfile) -> bool:
    """Does another rank step some of the units ([Note: optimizer states sharded by unit] in
    parallel/sharded_optimizer.py)?"""
    return any(not u.stepped for u in profile.units)


def sends_params(profile: ModelProfile) -> bool:
    """Are the units' params held by their owners and sent for each use (ZeRO-3, [Note: parameters sent for each
    use] in parallel/params_exchange.py)?"""
    return any(u.exchanged for u in profile.units)


def exchange_bytes(profile: ModelProfile, shape: TrainShape) -> int:
    """Bytes each step's exchange moves where the ranks' optimizer states are sharded by unit: every unit's
    compute-dtype values, broadcast by the rank that stepped it (0 otherwise); under ZeRO-3 for each use, in every
    pass's forward and (but the root, kept on the device from its forward to its gradients) backward."""
    if shape.ranks < 2 or not shards_optimizer(profile):
        return 0
    if sends_params(profile):
        return sum(shape.compute_bytes * u.numel * (1 if u.name == ROOT_UNIT else 2)
                   for u in profile.units if u.exchanged) * shape.passes
    return sum(shape.compute_bytes * u.numel for u in profile.units if u.trainable)


def exchange_time(profile: ModelProfile, shape: TrainShape) -> float:
    """Seconds of the exchange (`exchange_bytes`), after the step and before the next forward, at the bus
    bandwidth (a broadcast's bus bandwidth is its bytes over its time)."""
    nbytes = exchange_bytes(profile, shape)
    return nbytes / shape.allreduce_bw if nbytes else 0.0


def node_share(hw: HardwareProfile, node_ranks: int) -> HardwareProfile:
    """`hw` as one of `node_ranks` ranks on the node sees it ([Note: a node's ranks share it])."""
    if node_ranks <= 1:
        return hw
    n = node_ranks
    share = replace(hw, nvme_read_bw=hw.nvme_read_bw / n, nvme_write_bw=hw.nvme_write_bw / n,
                    nvme_mixed_bw=hw.nvme_mixed_bw / n)
    if hw.cuda:
        share = replace(share, cpu_adam_rate=hw.cpu_adam_rate / n, host_pass_bw=hw.host_pass_bw / n)
    return share


def allreduce_buffer_bytes(profile: ModelProfile, shape: TrainShape, cuda: bool) -> int:
    """Host bytes of the flat buffers gloo's averages go through ([Note: gloo through a flat buffer of our own] in
    parallel/replicas.py): each as large as the largest unit's gradients, one per average in flight: one where the
    device shares host memory (a unit's average is waited for where its gradients are read, at once), two where it
    is apart (waited for in the copy off the device, as two units' gradients can be in flight). 0 with one rank, or
    on a GPU (NCCL needs none)."""
    from tightfit.offload.device_kind import separate_memory

    if shape.ranks < 2 or cuda:
        return 0
    return max(u.trainable for u in profile.units) * grad_itemsize(shape) * (2 if separate_memory("cpu") else 1)
