"""Whether the compute device's memory is apart from host memory: the one fact that picks the engine's code path.

Why one function: on a GPU every byte between the device and the host crosses by an asynchronous copy through a
page-locked buffer (gradients packed in their own dtype and upcast on the host, states of a CPU step copied in and
out). On a CPU-only machine the "device" is host memory with a budget, and the engine can add gradients, step and
read states in place, with no copy at all. The engine, its budget checks and the planner's pool sizing must agree on
which of the two runs, so they all ask here.

The CPU test suite runs the GPU's path: under TIGHTFIT_STRICT_MOVER=1 (copies complete late, runtime/movers.py) a
CPU device is treated as apart from host memory unless TIGHTFIT_CPU_DEVICE=shared asks for the CPU's own path;
TIGHTFIT_CPU_DEVICE=separate asks for the GPU's path without the strict mover.
"""

from __future__ import annotations

import os


def separate_memory(device_type: str) -> bool:
    """Is memory on a `device_type` ("cuda", "cpu") device apart from host memory for the engine?"""
    if device_type != "cpu":
        return True
    mode = os.environ.get("TIGHTFIT_CPU_DEVICE", "")
    if mode in ("shared", "separate"):
        return mode == "separate"
    return os.environ.get("TIGHTFIT_STRICT_MOVER", "") == "1"
