"""`tightfit plan` for several GPUs: `what_if(cfg)` answers without the hardware.

Given `--nproc-per-node`, `--nnodes`, `--gpu-mem`, `--interconnect` and the model settings, it profiles the model
on the meta device (no memory, no download), runs `choose_strategy` (or takes `--strategy` as given), and reports
the mesh shape, memory per GPU by kind and communication per step by dimension (costs.py has the formulas).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tightfit.errors import UsageError
from tightfit.parallel.activation_checkpoint import wanted
from tightfit.parallel.auto import NOTE_ZERO3_OFFLOAD, StrategyChoice, choose_strategy
from tightfit.parallel.costs import Hardware, ModelProfile, comm_per_step, memory_per_gpu
from tightfit.parallel.plan import plan_from_config
from tightfit.utils.sizes import format_size, parse_size

CPU_OFFLOAD_BYTES = 16
"""Host bytes per parameter of FSDP2's CPU offload: the fp32 sharded parameter, its fp32 gradient, AdamW's two
moments."""
MOMENT_BYTES = 8
"""Of those, AdamW's two fp32 moments: with `--nvme` they live in each rank's swap folder instead
(tightfit/parallel/shard_states.py)."""

DEFAULT_GPU_MEM = "80GiB"
"""Assumed per-GPU memory when --gpu-mem is not given (an H100/A100-80GB)."""


@dataclass
class WhatIfReport:
    hardware: Hardware
    profile: ModelProfile
    choice: StrategyChoice
    memory: dict[str, int] | None
    comm: dict[str, int] | None

    @property
    def bus_bw(self) -> float:
        """The bus bandwidth assumed for the interconnect (parallel/links.py's figures)."""
        from tightfit.parallel.links import ASSUMED_BUS_BW

        return ASSUMED_BUS_BW[self.hardware.interconnect]

    @property
    def comm_s(self) -> float | None:
        """Seconds a GPU's collectives take a step at `bus_bw`: the bytes each GPU sends (comm_per_step's ring
        figures: 2(n-1)/n of an all-reduce's, (n-1)/n of a gather's) over the bus bandwidth, which nccl-tests defines
        so. Not a step time: dp's overlap the backward, tp's and pp's are in its path, and compute is not estimated
        here."""
        return None if self.comm is None else self.comm["total"] / self.bus_bw

    def to_dict(self) -> dict:
        c = self.choice
        return {"hardware": vars(self.hardware), "model": self.profile.to_dict(), "strategy": c.strategy,
                "mesh": {"pp": c.dims.pp, "dp": c.dims.dp, "tp": c.dims.tp}, "rule": c.rule, "reason": c.reason,
                "dp_mode": c.plan.dp_mode if c.plan else None,
                "cpu_offload": bool(c.plan and c.plan.cpu_offload),
                "memory_per_gpu": self.memory, "comm_per_step_per_gpu": self.comm, "comm_s_per_step": self.comm_s,
                "bus_bw_assumed": self.bus_bw, "notes": c.notes}

    def __str__(self) -> str:
        hw, c, p = self.hardware, self.choice, self.profile
        lines = [f"hardware: {hw.nnodes} node(s) x {hw.gpus_per_node} GPU(s), {format_size(hw.gpu_mem)} each, "
                 f"{hw.interconnect}",
                 f"model: {p.n_params / 1e6:.1f}M parameters, {p.n_layers} blocks, largest layer "
                 f"{p.largest_layer_params / 1e6:.1f}M, micro-batch {p.micro_batch} x {p.seq_len} tokens",
                 f"strategy: {c.strategy}" + (f" (dp={c.plan.dp_mode}{', cpu offload' if c.plan.cpu_offload else ''})"
                                              if c.plan and c.dims.dp > 1 else ""),
                 f"mesh: {c.dims}",
                 f"why: {c.reason}"]
        if self.memory:
            m = self.memory
            lines.append(f"memory per GPU: {format_size(m['total'])} = " + ", ".join(
                f"{k} {format_size(v)}" for k, v in m.items() if k != "total" and v))
        if self.comm:
            cm = self.comm
            lines.append(f"communication per step per GPU: {format_size(cm['total'])}" + (" (" + ", ".join(
                f"{k} {format_size(v)}" for k, v in cm.items() if k != "total" and v) + ")" if cm["total"] else ""))
            if cm["total"]:
                lines.append(f"its time: about {self.comm_s * 1e3:,.0f} ms a step at {self.bus_bw / 1e9:.0f} GB/s bus "
                             f"bandwidth (assumed for {hw.interconnect}); dp's overlaps the backward, tp's and pp's "
                             "are in its path")
        lines += [f"note: {n}" for n in c.notes]
        return "\n".join(lines)


def _meta_model(cfg) -> torch.nn.Module:
    """The configured model on the meta device (shapes only), built as the single-process trainer builds it."""
    from tightfit.train.loop import build_meta_model

    return build_meta_model(cfg)


def hardware_from_config(cfg) -> Hardware:
    p = cfg.parallel
    mem = parse_size(cfg.memory.gpu_mem or DEFAULT_GPU_MEM, "--gpu-mem")
    link = p.interconnect
    if link == "auto":  # the conservative guess: PCIe inside a node, Ethernet between nodes
        link = "pcie" if p.nnodes == 1 else "ethernet"
    return Hardware(gpus_per_node=p.nproc_per_node, nnodes=p.nnodes, gpu_mem=mem, interconnect=link)


def what_if(cfg, model: torch.nn.Module | None = None, log=None) -> WhatIfReport:
    """Plan for the hardware described by `cfg` (see module docstring). `model` overrides the configured one."""
    hw = hardware_from_config(cfg)
    precision = cfg.train.precision
    mixed = precision in ("bf16", "fp16") or precision == "auto"  # auto means bf16 on GPUs
    model = model if model is not None else _meta_model(cfg)
    prof = ModelProfile.from_model(model, cfg.train.seq_len, cfg.train.micro_batch, mixed)
    if cfg.parallel.strategy == "auto":
        choice = choose_strategy(hw, prof, log=log)
        if choice.plan is not None and choice.plan.cpu_offload and cfg.memory.offload == "auto":  # as the run does
            from dataclasses import replace

            from tightfit.parallel.unit_split import split_offload

            plan, why = split_offload(choice.plan, model, prof, hw.gpu_mem, cfg.memory.checkpointing != "off")
            choice = replace(choice, plan=plan, notes=[n for n in choice.notes if n != NOTE_ZERO3_OFFLOAD]
                             + ([why] if why else []))
    else:  # as the run takes it
        plan = plan_from_config(cfg.parallel, hw.world_size, cfg.memory.offload)
        if plan.engine:  # `tightfit plan` plans each rank's engine instead (parallel/rank_plan.py)
            raise UsageError(f"--offload {cfg.memory.offload} --strategy {cfg.parallel.strategy}: the offload engine "
                             "on every rank; `tightfit plan` with these flags prints a rank's plan")
        why = None
        if cfg.memory.offload == "auto":  # as the run decides it (run.resolve_plan)
            from tightfit.parallel.unit_split import split_units

            plan, why = split_units(plan, model, prof, hw.gpu_mem, cfg.memory.checkpointing != "off")
        choice = StrategyChoice(cfg.parallel.strategy, plan.dims, "given by --strategy",
                                f"given by --strategy {cfg.parallel.strategy}", plan, notes=[why] if why else [])
    memory = comm = None
    if choice.plan is not None:
        plan = choice.plan
        if cfg.parallel.strategy == "auto":  # auto's micro-batch count is a floor (1F1B needs one per stage)
            from dataclasses import replace

            plan = replace(plan, pp_schedule=cfg.parallel.pp_schedule,
                           pp_microbatches=max(cfg.parallel.pp_microbatches, plan.pp_microbatches))
        recompute, why = wanted(cfg.memory.checkpointing, plan, prof, hw.gpu_mem)
        if recompute:  # as the run would: every block recomputes its forward in backward
            from dataclasses import replace

            prof = replace(prof, checkpointed=True)
            choice.notes.append(f"activation checkpointing of every block ({why})")
        memory, comm = memory_per_gpu(plan, prof), comm_per_step(plan, prof, micro_batches=cfg.train.grad_accum)
        if plan.cpu_offload:  # FSDP2's CPUOffloadPolicy: the fp32 shard, its gradient and AdamW's moments
            shard = prof.n_params / (plan.dims.pp * plan.dims.tp * plan.dims.dp) - sum(
                n for _, n in plan.kept_on_device)
            if cfg.memory.nvme:  # the moments in each rank's swap folder (shard_states.py)
                rank, disk = int(shard * (CPU_OFFLOAD_BYTES - MOMENT_BYTES)), int(shard * MOMENT_BYTES)
                choice.notes.append(f"host memory for the offloaded shards: {format_size(rank)} per rank, "
                                    f"{format_size(rank * hw.gpus_per_node)} per node (fp32 parameters and "
                                    f"gradients, {CPU_OFFLOAD_BYTES - MOMENT_BYTES} bytes a parameter); AdamW's "
                                    f"moments beside them while the rank's host memory holds them, the rest on "
                                    f"each rank's NVMe: at most {format_size(disk)} per rank, "
                                    f"{format_size(disk * hw.gpus_per_node)} per node")
            else:
                rank = int(shard * CPU_OFFLOAD_BYTES)
                choice.notes.append(f"host memory for the offloaded shards: {format_size(rank)} per rank, "
                                    f"{format_size(rank * hw.gpus_per_node)} per node (fp32 parameters, gradients "
                                    f"and AdamW moments, {CPU_OFFLOAD_BYTES} bytes a parameter; with --nvme the "
                                    f"moments go to each rank's swap folder)")
        if plan.cpu_offload and plan.dims.pp == plan.dims.tp == 1:  # what the offloaded units cost the host link
            from tightfit.parallel.unit_split import HOST_LINK_BW, host_link_bytes, zero3_units

            up, down = host_link_bytes(zero3_units(model, plan.dims.dp), plan.kept_names, cfg.train.grad_accum)
            choice.notes.append(f"the offloaded units cross each GPU's host link {format_size(up)} up a step (their "
                                f"fp32 shards at every all-gather: a block's twice a micro-batch, the root's once, "
                                f"{cfg.train.grad_accum} micro-batches) and {format_size(down)} down (their gradients "
                                f"each micro-batch): about {max(up, down) / HOST_LINK_BW * 1e3:,.0f} ms a step at "
                                f"{HOST_LINK_BW / 1e9:.0f} GB/s each way (assumed: PCIe 4.0 x16)")
        if memory["total"] > hw.gpu_mem:
            what = ("lower --micro-batch or --seq-len" if plan.cpu_offload and prof.checkpointed else
                    "add --checkpointing on" if plan.cpu_offload else "combine with offload or raise the degrees")
            choice.notes.append(f"the plan needs {format_size(memory['total'])} per GPU, more than "
                                f"{format_size(hw.gpu_mem)}: {what}")
    return WhatIfReport(hw, prof, choice, memory, comm)
