"""How fast the ranks average gradients: the all-reduce's bus bandwidth, measured in a run's group or assumed.

Why: with `--strategy ddp --offload host|nvme` every rank's engine averages its gradients over the group as they
leave the device (replicas.py), once per micro-batch in micro-batch-major order, once a step in unit-major order.
What that costs belongs in each rank's predicted step (planner/averaging.py, `allreduce_in_step`), so that the planner can
weigh the two orders by it and the plan can be checked against the run.

The figure is the bus bandwidth nccl-tests reports: a ring all-reduce of B bytes over n ranks sends and receives
2(n-1)/n x B per rank, and takes 2(n-1)/n x B / bus_bw seconds, whatever n. A run measures it in its own group
before it plans (`measure_bus_bw`: the median of five all-reduces of 16 MiB, idle, on the process group the
gradients use). `tightfit plan` has no group: it assumes the figure of the link named by `--interconnect`
(`ASSUMED_BUS_BW`), or, planning this machine's CPU ranks, gloo between processes on one machine; the plan says
which.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

ASSUMED_BUS_BW = {
    "nvlink": 360e9,  # H100/H200 SXM, NVLink 4 through NVSwitch: nccl-tests all_reduce_perf at 1 GiB (assumed)
    "nvswitch": 360e9,
    "pcie": 10e9,  # GPUs without NVLink or P2P (e.g. RTX 4090), through host memory over PCIe 4 x16 (assumed)
    "infiniband": 40e9,  # across nodes, one 400 Gb/s NDR port per GPU (assumed)
    "ethernet": 10e9,  # across nodes, 100 Gb/s per node (assumed)
}
"""Bus bandwidth (bytes/s) of a large all-reduce over each interconnect: assumed, never measured by tightfit."""

GLOO_ONE_MACHINE_BW = 1.5e9
"""gloo between CPU processes on one machine, idle: 1.5-1.95 GB/s at 25 MiB on the 2-core VM (benchmarks/RESULTS.md
batch AK); what `tightfit plan` assumes for this machine's CPU ranks."""

SHARES_LINK = ("pcie",)
"""Interconnects whose all-reduce crosses the lanes the offload's copies use: its bytes queue with theirs."""

PROBE_BYTES = 16 << 20
"""The probe's all-reduce: large enough that its fixed cost (~0.5 ms on gloo) is a small part of it (on the 2-core
VM the median of five at 8 MiB ranged 1.4-2.8 GB/s from one probe to the next, at 16 MiB 1.4-1.8)."""


@dataclass(frozen=True)
class Averaging:
    """What a rank's plan needs to price the gradients' average: the ranks, the bus bandwidth (bytes/s) and where
    it comes from ("measured in this run's group", "assumed for nvlink", ...), and whether the all-reduce shares
    the host<->device link."""

    ranks: int
    bus_bw: float
    source: str
    on_link: bool = False
    node_ranks: int = 1
    """Of `ranks`, those on this node, sharing its disk and CPU ([Note: a node's ranks share it] in
    planner/averaging.py)."""
    stepped_elsewhere: frozenset = frozenset()
    """Units another rank steps, where the ranks' optimizer states are sharded by unit ([Note: optimizer states
    sharded by unit] in parallel/sharded_optimizer.py): this rank's plan holds no master or moments for them."""
    grads_elsewhere: bool = False
    """ZeRO-2: nor their gradients, reduced to the rank that steps them."""
    exchanged: frozenset = frozenset()
    """ZeRO-3: the units one rank owns, whose params it alone holds and sends for each use ([Note: parameters sent
    for each use] in parallel/params_exchange.py): this rank's plan holds no params of the others'."""


def assumed(ranks: int, interconnect: str | None, cuda: bool, node_ranks: int = 1) -> Averaging:
    """The averaging `tightfit plan` assumes for `ranks` ranks, `node_ranks` of them on each node: the named
    interconnect's figure on a GPU machine (PCIe when "auto"/None), gloo on one machine for CPU ranks."""
    if not cuda:
        return Averaging(ranks, GLOO_ONE_MACHINE_BW, "assumed for gloo between processes on one machine",
                         node_ranks=node_ranks)
    link = interconnect if interconnect in ASSUMED_BUS_BW else "pcie"
    return Averaging(ranks, ASSUMED_BUS_BW[link], f"assumed for {link}", link in SHARES_LINK, node_ranks)


def measure_bus_bw(group, device: torch.device, repeats: int = 5) -> float:
    """The bus bandwidth of an all-reduce of PROBE_BYTES over `group`, idle (the median of `repeats` after one to
    warm up). Collective: every rank of `group` calls it, and every rank gets the same figure (the slowest rank's
    time, which is what an all-reduce waits for)."""
    n = dist.get_world_size(group)
    t = torch.ones(PROBE_BYTES // 4, device=device)
    dist.all_reduce(t, group=group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dist.all_reduce(t, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([sorted(times)[repeats // 2]], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return 2 * (n - 1) / n * PROBE_BYTES / float(slowest[0])


def measured(group, device: torch.device, interconnect: str | None, node_ranks: int) -> Averaging:
    """The averaging of this run's `group` (`node_ranks` of its ranks on this node), its bus bandwidth measured
    now."""
    bw = measure_bus_bw(group, device)
    return Averaging(dist.get_world_size(group), bw, "measured in this run's group",
                     device.type == "cuda" and interconnect in SHARES_LINK, node_ranks)
