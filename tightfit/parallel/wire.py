"""Where a broadcast of one unit's values travels between ranks: the host buffer itself on gloo; on NCCL, which
carries device tensors only, one device buffer of the exchange's own.

[Note: the wire's device buffer] On NCCL the owner copies the unit's values up from its host buffer into the wire,
the broadcast fills every other rank's wire, and each of those copies it down into its own host buffer, which the
unit's fetch (ZeRO-3) or the write of its new values (ZeRO-1/2) then reads: one upload, on the owner, and one
download on each other rank. The wire is allocated once, as large as the largest unit the exchange sends, and
charged to the engine's device meter, so the device budget holds it (a tensor made for each broadcast was device
memory no budget counted: a 7B Llama's root is 0.5 GB in bf16) and the planner's device peak counts it
(`memory_model.exchange_wire_bytes`, "exchange wire"). A CPU device apart from host memory (TIGHTFIT_CPU_DEVICE=
separate, the GPU's code path on a CPU: device_kind.py) goes through a wire of its own too, on gloo, so the suite
runs the uploads, the downloads and the meter's charge that a GPU's NCCL would.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Wire:
    """One exchange's way across: `broadcast(values, src)` leaves `src`'s `values` (a host buffer) in every rank's
    `values`. `numel`: the most elements a broadcast sends; `engine`: whose meter is charged for the device buffer
    and whose `separate` device (a GPU, or the CPU standing in for one) has one."""

    def __init__(self, engine, group, numel: int) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        gloo = dist.get_backend(group) == "gloo"
        self.device = torch.device("cpu") if gloo else torch.device("cuda", torch.cuda.current_device())
        self.buffer: torch.Tensor | None = None
        if (engine.separate or not gloo) and numel:
            self.buffer = torch.empty(numel, dtype=engine.compute_dtype, device=self.device)
            engine.meter.charge(numel * self.buffer.element_size())

    def broadcast(self, values: torch.Tensor, src: int) -> None:
        """`src`'s `values` into every rank's `values` (same shape and dtype on every rank)."""
        if self.buffer is None:
            dist.broadcast(values, src=src, group=self.group)
            return
        wire = self.buffer[:values.numel()]
        if self.rank == src:
            wire.copy_(values)
        dist.broadcast(wire, src=src, group=self.group)
        if self.rank != src:
            values.copy_(wire)
