"""Which ZeRO-3 runs `--strategy zero3 --offload host`: FSDP2's, or the offload engine's exchange. `decide`.

[Note: two ZeRO-3s with the offload] Both keep each rank's 1/N of the states in its host memory; they differ in how
a unit's parameters reach the ranks that compute it.
- **FSDP2** (`fully_shard` with `CPUOffloadPolicy`, the optimizer `ShardStatesAdamW`: shard_states.py): every rank
  holds 1/N of every parameter; FSDP2 all-gathers each unit for each micro-batch (a block twice: its forward and
  its backward) and reduce-scatters its gradients, and only the rank's own shard crosses its host link, beside the
  compute on a GPU. The collectives are FSDP2's; parameters never go to a disk (the moments may: past the rank's
  host room with `--nvme`).
- **The exchange** (params_exchange.py): each unit has one owner, which alone holds its states on any tier of its
  own plan (NVMe too) and broadcasts its parameters for each use; in unit-major order a unit is used once per pass
  whatever the micro-batches. On a GPU every rank's copy of each use goes through its host memory (costs.py
  `exchange_copies`): twice the unit's bytes over every rank's host link.
So FSDP2's traffic grows with the micro-batches and its link bytes shrink with the ranks; the exchange's the other
way round. `decide` prices FSDP2's step beside the exchange's plan and runs the faster one where FSDP2's shards fit
(`--zero3-params auto`), or the one `--zero3-params` names; `tightfit plan` prints both. Under `--offload nvme` auto
keeps the exchange: only it puts parameters on the disk.

FSDP2's step (`fsdp2_step`), from the exchange plan's own compute (the same forwards and backwards):
- its collectives, `costs.comm_per_step`'s bytes at the group's bus bandwidth: on a CPU-only machine gloo on the
  compute's cores, added at `GLOO_BESIDE_A_STEP` of the idle rate (planner/averaging.py); on a GPU beside the
  compute;
- on a GPU the host link's bytes (`unit_split.host_link_bytes`) at the probe's host<->device rates, beside the
  compute;
- the CPU's AdamW over the rank's shard (`cpu_adam_rate`): on a CPU-only machine added; on a GPU what the next
  forward's first micro-batch does not hide (each unit steps before its forward: shard_states.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn as nn

from tightfit.parallel.plan import ParallelPlan

FSDP2_BY = 0.95
"""FSDP2 is chosen where its predicted step is at most this share of the exchange's: the two predictions share their
compute, and what FSDP2's leaves out (its hooks and copies for each unit, each micro-batch) costs it a few percent
where the two are close (2 CPU ranks, one micro-batch: 820 against 823 ms predicted, 0.93-0.97x the exchange's
tokens/s measured; benchmarks/RESULTS.md batch AU)."""


@dataclass(frozen=True)
class Fsdp2Step:
    """FSDP2's predicted step under `--offload host` and its terms (seconds), and whether its states fit."""

    step_s: float
    compute_s: float
    collectives_s: float
    link_s: float
    optimizer_s: float
    host_bytes: int
    """A rank's host memory for its fp32 shards, their gradients and AdamW moments (16 bytes a parameter)."""
    device_bytes: int
    """A GPU's: the gathered units and the activations (`costs.memory_per_gpu`; every unit offloaded)."""
    fits: bool

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "collectives_s": self.collectives_s,
                "link_s": self.link_s, "optimizer_s": self.optimizer_s, "host_bytes": self.host_bytes,
                "device_bytes": self.device_bytes, "fits": self.fits}


def fsdp2_plan(plan: ParallelPlan) -> ParallelPlan:
    """`plan` (zero3 with the engine) as FSDP2's ZeRO-3 with every unit's shards in host memory."""
    return replace(plan, engine=False, cpu_offload=True, kept_on_device=())


def fsdp2_step(exchange, model: nn.Module, prof, plan: ParallelPlan, bus_bw: float, cuda: bool,
               host_budget: int | None, gpu_budget: int | None) -> Fsdp2Step:
    """FSDP2's predicted step for `plan`'s ranks beside `exchange` (the engine's plan of rank 0: its compute, its
    machine), `prof` the model's `costs.ModelProfile` (recomputed or not, as FSDP2's run would). `bus_bw`: the
    group's bus bandwidth; the budgets: a rank's host memory and a GPU's (None: no limit). [Note: two ZeRO-3s with
    the offload]"""
    from tightfit.parallel.costs import comm_per_step, memory_per_gpu
    from tightfit.parallel.unit_split import host_link_bytes, zero3_units
    from tightfit.planner.averaging import GLOO_BESIDE_A_STEP

    offloaded = fsdp2_plan(plan)
    n = plan.dims.dp
    shape, hw = exchange.shape, exchange.hardware
    micro = shape.grad_accum
    compute = exchange.prediction.compute_s
    sent = comm_per_step(offloaded, prof, micro_batches=micro)["dp"]
    collectives = sent / bus_bw if bus_bw else 0.0
    units = zero3_units(model, n)
    shard = sum(k for _, k in units)
    optimizer = shard / hw.cpu_adam_rate
    link = 0.0
    if cuda:
        up, down = host_link_bytes(units, frozenset(), micro)
        link = up / hw.h2d_bw + down / hw.d2h_bw
        first_forward = compute / (3 * micro)  # the forward of one micro-batch, of its forward and backward
        step = max(compute, collectives, link) + max(0.0, optimizer - first_forward)
    else:  # one set of cores: the compute, gloo and the optimizer take turns
        step = compute + collectives / GLOO_BESIDE_A_STEP + optimizer
    host = 16 * shard
    device = memory_per_gpu(offloaded, prof)["total"] if cuda else 0
    fits = (host_budget is None or host <= host_budget) and (gpu_budget is None or not cuda or device <= gpu_budget)
    return Fsdp2Step(step, compute, collectives, link, optimizer, host, device, fits)


def choose(asked: str, offload: str, fsdp2: Fsdp2Step | None, exchange_s: float) -> tuple[str, str]:
    """("fsdp2" or "exchange", the line that says why). `asked`: `--zero3-params`; `fsdp2`: its step (None: not
    priced, where nothing was left to choose)."""
    if asked != "auto":
        return asked, f"--zero3-params {asked}"
    if offload == "nvme":
        return "exchange", "--offload nvme: only the exchange puts the parameters on the disk"
    if fsdp2 is None or not fsdp2.fits:
        return "exchange", ("FSDP2's shards do not fit a rank's host memory or its GPU" if fsdp2 else
                            "the exchange could not be planned, so neither was priced")
    path = "fsdp2" if fsdp2.step_s <= FSDP2_BY * exchange_s else "exchange"
    return path, (f"predicted step: FSDP2's all-gathers {fsdp2.step_s * 1e3:,.0f} ms, the exchange "
                  f"{exchange_s * 1e3:,.0f} ms")


def describe(path: str, why: str) -> str:
    what = ("FSDP2's (each rank's shards in its host memory, each unit all-gathered for each micro-batch, "
            "ShardStatesAdamW stepping them under the next forward)" if path == "fsdp2" else
            "the offload engine's exchange (each unit's owner holds its states and broadcasts its parameters for "
            "each use)")
    return f"tightfit: ZeRO-3 with --offload: {what}: {why}"


def price(cfg, model: nn.Module, plan: ParallelPlan, exchange, bus_bw: float, cuda: bool) -> Fsdp2Step:
    """FSDP2's step beside `exchange` for a run or a what-if of `cfg` (its budgets per rank: `exchange`'s)."""
    from tightfit.parallel.activation_checkpoint import wanted
    from tightfit.parallel.costs import ModelProfile

    mixed = exchange.shape.compute_bytes != 4
    prof = ModelProfile.from_model(model, cfg.train.seq_len, cfg.train.micro_batch, mixed)
    gpu = exchange.budgets.get("device") if cuda else None
    recompute, _ = wanted(cfg.memory.checkpointing, fsdp2_plan(plan), prof, gpu)
    return fsdp2_step(exchange, model, replace(prof, checkpointed=recompute), plan, bus_bw, cuda,
                      exchange.budgets.get("host"), gpu)


def decide(model: nn.Module, cfg, world, plan: ParallelPlan, say) -> tuple[ParallelPlan, tuple | None]:
    """The ZeRO-3 this rank runs for `plan` (zero3 with the engine): `plan` itself (the exchange) or FSDP2's
    (`fsdp2_plan`), as `--zero3-params` asks or, with auto under `--offload host`, the faster by the plan, the same
    on every rank (one vote). Prices what it must in the group: the machine's profile, the bus bandwidth. Returns the
    plan and, where it measured them, the gradients' group and averaging (`replicas.gradients_group`), for the
    exchange's engine to average over."""
    asked, offload = cfg.parallel.zero3_params, cfg.memory.offload
    fsdp2, exchange_s, averaged = None, 0.0, None
    if asked == "auto" and offload == "host":
        from tightfit.errors import UsageError
        from tightfit.parallel.rank_plan import rank_config
        from tightfit.parallel.replicas import gradients_group
        from tightfit.parallel.sharded_optimizer import shard_averaging
        from tightfit.planner import make_plan
        from tightfit.planner.probe import load_or_probe

        if world.is_main:
            load_or_probe(None)
        world.barrier("the hardware probe")
        device = world.env.device
        averaged = gradients_group(world, device, cfg)
        _, averaging = shard_averaging(model, 0, world.size, "zero3", averaged[1])  # rank 0's plan, on every rank
        mine, _ = rank_config(cfg, 0, folder=False)
        try:
            exchange = make_plan(model, mine, None, averaging=averaging)
            exchange_s = exchange.prediction.step_s
            fsdp2 = price(cfg, model, plan, exchange, averaging.bus_bw, device.type == "cuda")
        except UsageError:  # the exchange cannot be planned: it will say why; nothing to choose
            fsdp2 = None
    path, why = choose(asked, offload, fsdp2, exchange_s)
    agreed = world.max_over_ranks([int(path == "fsdp2")], "the choice of ZeRO-3's path")[0]
    path = "fsdp2" if agreed else "exchange"
    say(describe(path, why))
    return (fsdp2_plan(plan), None) if path == "fsdp2" else (plan, averaged)
