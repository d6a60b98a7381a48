"""Process-group and device-mesh setup: one world, three named dimensions (pp, dp, tp); and how a rank leaves
([Note: leaving the process group]).

Why one mesh: every parallelism in tightfit is applied over a named slice of the same `DeviceMesh`, so the order
of the dimensions is decided once, here:

    mesh shape (pp, dp, tp), rank = (pp_index * dp + dp_index) * tp + tp_index

- tp is innermost: tensor parallelism all-reduces activations twice per block in forward and twice in backward, so
  its ranks must be the closest ones (same node, NVLink); consecutive ranks are on the same node under torchrun.
- dp is in the middle: one gradient reduction per step, tolerant of a slower link.
- pp is outermost: it only sends activations between neighbouring stages, so it is the dimension that can cross the
  slowest link (between nodes). Rank 0 is therefore on the first pipeline stage, which is the rank that prints.

A dimension of size 1 is still present in the mesh (the simple case is the general path with the work skipped).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tightfit.errors import UsageError

MESH_DIMS = ("pp", "dp", "tp")
"""Names of the mesh dimensions, outermost first."""

DEFAULT_TIMEOUT_S = 120.0
"""Collective timeout. Why bounded: a rank that dies mid-collective must not leave the others waiting forever;
gloo raises at once when a peer's socket closes, and this timeout covers the case where a peer hangs instead."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the three parallel dimensions; their product is the world size."""

    pp: int = 1
    """Pipeline stages."""
    dp: int = 1
    """Data-parallel replicas (or ZeRO shards)."""
    tp: int = 1
    """Tensor-parallel ranks splitting each layer."""

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            if getattr(self, name) < 1:
                raise UsageError(f"--{name if name != 'dp' else 'nproc-per-node'}: degree must be >= 1")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def __str__(self) -> str:
        return f"pp={self.pp} x dp={self.dp} x tp={self.tp}"


@dataclass(frozen=True)
class DistEnv:
    """What this process learned from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def env_world_size() -> int:
    """WORLD_SIZE as set by torchrun or a scheduler (1 when not launched that way)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S, device: str = "auto") -> DistEnv:
    """Join the process group described by RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT.

    nccl when CUDA is present (one GPU per local rank), gloo on CPU. Idempotent: a second call returns the same env.
    """
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise UsageError(f"distributed run: environment variable {var} is not set; launch with "
                             "`tightfit train --nproc-per-node N` or torchrun")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                                device_id=dev if use_cuda else None)
    return DistEnv(rank, world, local_rank, dev)


def build_mesh(dims: ParallelDims, device: torch.device) -> DeviceMesh:
    """The (pp, dp, tp) mesh over the current process group."""
    world = dist.get_world_size()
    if dims.world_size != world:
        raise UsageError(f"--strategy: mesh {dims} needs {dims.world_size} processes, but the world has {world}; "
                         "change --tp/--pp or --nproc-per-node")
    return init_device_mesh(device.type, dims.shape(), mesh_dim_names=MESH_DIMS)


def shutdown() -> None:
    """Destroy every process group (the world and the mesh's sub-groups) once; safe to call when none exists.

    The caller makes sure no collective is in flight on this rank (`run_distributed` ends its successful runs with
    a barrier first). This stops no gloo thread by itself: see [Note: leaving the process group]."""
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_process(code: int) -> NoReturn:
    """End a rank's process with status `code` without running the interpreter's teardown.

    [Note: leaving the process group] `destroy_process_group()` unregisters the groups, but a gloo group's C++
    backend (its worker threads, `pt_gloo_runloop`, and its transport's `gloo_tcp_loop` threads) lives as long as a
    Python reference to the group: every DeviceMesh keeps its groups in `_pg_registry`, and DTensor's
    sharding-propagation caches (in Python and in C++) keep DeviceMeshes (hence groups) for the life of the process.
    So whenever DTensors were used (FSDP2's zero2/zero3, tensor parallelism, `replicate`) the groups outlive
    `destroy_process_group`: after a 2-rank zero2 run, 3 groups and 9 native gloo threads were alive on each rank
    (torch 2.13). Left to the interpreter's teardown, they are destroyed in whatever order modules are cleared,
    possibly after a peer closed its sockets, while their threads may still drop a finished collective's tensors
    (a tensor with Python state takes the GIL to be freed; a thread taking the GIL during teardown is ended by
    Python with `pthread_exit`, which C++ cannot unwind through: "terminate called without an active exception",
    SIGABRT: the abort a finished zero2 rank once died of). A run whose work is done must not fail there. So a
    rank, once its collectives are over (a final barrier), its group destroyed, its checkpoint committed and its
    writer thread joined, flushes what it printed and ends with `os._exit`: nothing runs after that point,
    whatever torch still holds. Tested by tests/test_parallel_exit.py."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    logging.shutdown()  # what atexit would have flushed
    os._exit(code)
