"""What the machine offers: memory per tier and measured speeds, cached per machine.

Why measured rather than looked up: the planner's step-time prediction is only as good as its speeds, and a shared
VM, a throttled NVMe or a busy PCIe switch differ from any data sheet. `tightfit probe` (see `probe.py`) measures
once and caches the result under ~/.cache/tightfit/hardware.json, keyed by hostname + devices; `tightfit plan`
and `tightfit train` reuse it. Capacities that change from minute to minute (free GPU memory, available RAM, free
disk) are re-read live by `current()` each time a plan is made.

Tests never measure: they build a `HardwareProfile` by hand (see `HardwareProfile.synthetic`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from tightfit.utils.sizes import format_size

GiB = 1024**3


@dataclass
class HardwareProfile:
    """Capacities (bytes) and speeds (bytes/s, FLOP/s, elements/s) of one machine."""

    key: str
    """Cache key: hostname + device names."""
    cuda: bool
    """The device tier is a CUDA GPU; otherwise the device tier is the CPU with a byte budget."""
    device_name: str
    """"cpu" or the GPU's name."""
    gpu_total: int
    """GPU memory in bytes (0 without CUDA)."""
    gpu_free: int
    """GPU memory free right now (0 without CUDA)."""
    host_total: int
    """Physical RAM."""
    host_available: int
    """RAM available right now (psutil's `available`: free + reclaimable page cache)."""
    nvme_free: int
    """Free bytes in the swap folder (0 when none was given)."""
    nvme_read_bw: float
    """Sequential O_DIRECT read bandwidth of the swap folder's disk."""
    nvme_write_bw: float
    """Sequential O_DIRECT write bandwidth of the swap folder's disk."""
    h2d_bw: float
    """Host -> device copy bandwidth (pinned, CUDA); on a CPU-only machine the memcpy bandwidth."""
    d2h_bw: float
    """Device -> host copy bandwidth (pinned, CUDA); on a CPU-only machine the memcpy bandwidth."""
    mem_bw: float
    """Memory bandwidth of the compute device for memory-bound ops (copy of a large tensor: read + write bytes)."""
    cpu_adam_rate: float
    """Parameters per second of torch's fused AdamW on CPU (fp32 master + moments + fp32 grads), over states larger
    than the host's caches, on the cores the engine's step thread has (`probe.measure_cpu_adam`)."""
    device_adam_rate: float
    """Parameters per second of AdamW on the device (equals cpu_adam_rate on a CPU-only machine)."""
    matmul_flops: dict[int, float] = field(default_factory=dict)
    """Matmul FLOP/s of the compute device by the smallest side of the matmul (size -> FLOP/s: the forward and
    both gradients of a 2048 -> 5632 linear layer with `size` tokens), in the compute dtype ([Note: matmul rate by
    the smallest side] in work.py)."""
    attention_flops: dict[int, float] = field(default_factory=dict)
    """FLOP/s of the fused attention kernel (forward and backward, causal: FLOPs of the tiles it computes) by
    problem size, the cube root of t_q * head_dim * t_k ([Note: attention's own rate] in work.py).
    Empty: not measured (attention runs at the matmul rate of its size)."""
    timed_op_bw: dict[str, float] = field(default_factory=dict)
    """Bytes per second (read + written) of each elementwise op the probe times alone (`work.TIMED_OPS`: dropout's
    mask, tanh, exp, ...), by aten op ([Note: ops slower than their bytes] in work.py). An op not here, or faster
    than `mem_bw`, runs at `mem_bw`."""
    duplex_bw: float = 0.0
    """Bytes per second host->device and device->host together, with copies in flight both ways at once, as an
    offloaded step has them (fetches up, gradients down); a link rarely carries both directions at full rate at once.
    0: not measured (each direction then runs at its own rate beside the other). CUDA only."""
    host_pass_bw: float = 0.0
    """Bytes per second (read + written) of the engine's elementwise passes over host memory besides AdamW on a GPU
    machine: gradient sums and norms, the clip multiply, the master's cast ([Note: host passes] in costs.py).
    0: not measured (AdamW's 28 bytes per parameter at `cpu_adam_rate` stand in)."""
    op_overhead_s: float = 10e-6
    """Seconds of fixed dispatch overhead per aten op (dominates small models on CPU). On a GPU the probe times it
    under autocast to bf16, as a GPU run dispatches its ops ([Note: the host floor's precision] in probe.py)."""
    unit_overhead_s: float = 0.0
    """Host seconds the offload engine spends per unit and micro-batch beyond the model's own ops: its hooks, the
    parameter views it hands the unit, the gradient hand-off and the unit's share of the optimizer's dispatch.
    Measured by running the engine itself on a tiny model ([Note: the host floor] in costs.py; on a GPU computing
    in bf16 under autocast); 0 where unknown."""
    stream_overhead_s: float = 0.0
    """Host seconds a unit whose parameters stream (its states off the device tier) costs per micro-batch beyond
    `unit_overhead_s`: its fetch, the gradient hand-off to the host, its CPU optimizer step's dispatch. Measured
    with every state on the host tier; 0 where unknown."""
    step_overhead_s: float = 0.0
    """Host seconds per optimizer step that no unit accounts for: the loss's read-back, the global norm for
    clipping, the optimizer's and zero_grad's fixed dispatch. Measured with `unit_overhead_s`."""
    device_workspace: int = 0
    """Device bytes the math libraries allocate through torch's caching allocator besides any tensor: cuBLAS's
    workspace for the compute stream (PyTorch's default: 32 MiB from compute capability 9.0, Hopper; 8 MiB before).
    Counted in `torch.cuda.max_memory_allocated`, not in the engine's meter; the probe measures it (0 on a CPU)."""
    nvme_device: str = ""
    """The filesystem the disk figures were measured on, as "major:minor" (`offload.tiers.nvme.store.device_of`); the
    NVMe tier takes the two below only for a swap folder there ([Note: disk tuning] in
    tightfit/offload/tiers/nvme/tuning.py)."""
    nvme_io_threads: int = 8
    """I/O threads of the NVMe tier on that disk (= transfers in flight): the fewest reading within 10% of the best."""
    nvme_chunk_bytes: int = 4 << 20
    """Largest transfer of the NVMe tier on that disk: the device's largest request, at most 4 MiB."""
    nvme_mixed_bw: float = 0.0
    """Bytes read + written per second with reads and writes in flight at once, as a step's are (0: not measured;
    the model then adds read time and write time). [Note: sustained bandwidth] in disk_probe.py."""
    nvme_measured_bytes: int = 0
    """The volume the disk rates were measured over (0: unknown, a profile written by hand or an older probe's).
    A swap file larger than this may outgrow a cache the rates were measured inside ([Note: sustained bandwidth])."""
    nvme_volumes: dict[int, list[float]] = field(default_factory=dict)
    """Every volume the disk under `nvme_device` was measured over -> [read, write, both at once] bytes/s. Each
    `tightfit probe --nvme` adds its own; a plan takes the rates of the smallest volume that holds its swap
    (`at_disk_volume`)."""
    runtime_rss: int = 0
    """RSS of a process that imported torch and ran a tiny step: the floor under every host measurement."""
    threads: int = 1
    """torch intra-op threads during the measurements."""
    cpu_pressure: float = -1.0
    """Share of the matmul measurement's wall time during which a runnable task waited for a core (Linux PSI "some",
    /proc/pressure/cpu): other work on a shared machine slows every compute-side figure with it (-1: not known).
    The plan warns above PRESSURE_WARNING."""
    measured_at: float = 0.0
    """Unix time of the measurement (0: synthetic, or a profile stated by hand)."""
    probe_version: int = 0
    """`PROBE_VERSION` of the probe that measured it: a cached profile of an older probe, whose figures mean
    something else, is measured again (`load_cached`)."""
    assumptions: list[str] = field(default_factory=list)
    """What a hand-written or named profile assumes rather than measured (the plan prints these)."""

    def matmul_rate(self, size: int) -> float:
        """FLOP/s for a matmul of problem size `size`: log-linear interpolation between measured sizes."""
        return _by_size(self.matmul_flops, size) if self.matmul_flops else 1e11

    def timed_op_rate(self, op: str) -> float:
        """Bytes per second of the elementwise aten op `op`: its measured rate, but no faster than memory."""
        return min(self.timed_op_bw.get(op) or self.mem_bw, self.mem_bw)

    def attention_rate(self, size: int) -> float:
        """FLOP/s of fused attention of problem size `size`; the matmul rate where the probe did not measure it."""
        return _by_size(self.attention_flops, size) if self.attention_flops else self.matmul_rate(size)

    def at_disk_volume(self, nbytes: float) -> "HardwareProfile":
        """This profile with the disk rates of the smallest measured volume holding `nbytes` (the largest volume
        when none does; itself when no volume was measured, or the rates are that volume's already)."""
        table = dict(self.nvme_volumes)
        if self.nvme_measured_bytes:
            table[self.nvme_measured_bytes] = [self.nvme_read_bw, self.nvme_write_bw, self.nvme_mixed_bw]
        volumes = sorted(table)
        volume = next((v for v in volumes if v >= nbytes), volumes[-1]) if volumes else 0
        if volume == self.nvme_measured_bytes:
            return self
        read, write, mixed = table[volume]
        return replace(self, nvme_read_bw=read, nvme_write_bw=write, nvme_mixed_bw=mixed,
                       nvme_measured_bytes=volume)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        """What `tightfit probe` prints."""
        g = 1e9
        mm = ", ".join(f"{k}: {v / 1e12:.2f}" for k, v in sorted(self.matmul_flops.items()))
        lines = [f"machine {self.key} ({'CUDA ' + self.device_name if self.cuda else 'CPU only'}, "
                 f"{self.threads} threads)",
                 f"  memory: GPU {self.gpu_free / GiB:.1f}/{self.gpu_total / GiB:.1f} GiB free, RAM "
                 f"{self.host_available / GiB:.1f}/{self.host_total / GiB:.1f} GiB available, swap folder "
                 f"{self.nvme_free / GiB:.1f} GiB free",
                 f"  matmul TFLOP/s by size: {mm}"
                 + (f" (other work kept a core busy {self.cpu_pressure:.0%} of that time)"
                    if self.cpu_pressure >= 0 else ""),
                 *(["  attention TFLOP/s by size: " + ", ".join(
                     f"{k}: {v / 1e12:.2f}" for k, v in sorted(self.attention_flops.items()))]
                   if self.attention_flops else []),
                 *(["  elementwise ops timed alone, GB/s: " + ", ".join(
                     f"{k} {v / g:.1f}" for k, v in self.timed_op_bw.items())] if self.timed_op_bw else []),
                 f"  memory bandwidth {self.mem_bw / g:.1f} GB/s, per-op overhead {self.op_overhead_s * 1e6:.1f} us",
                 f"  engine host time {self.unit_overhead_s * 1e3:.2f} ms per unit and micro-batch (+"
                 f"{self.stream_overhead_s * 1e3:.2f} ms streamed), {self.step_overhead_s * 1e3:.2f} ms per step",
                 f"  host->device {self.h2d_bw / g:.1f} GB/s, device->host {self.d2h_bw / g:.1f} GB/s"
                 + (f", both at once {self.duplex_bw / g:.1f} GB/s" if self.duplex_bw else ""),
                 f"  disk read {self.nvme_read_bw / g:.2f} GB/s, write {self.nvme_write_bw / g:.2f} GB/s"
                 + (f", both at once {self.nvme_mixed_bw / g:.2f} GB/s" if self.nvme_mixed_bw else "")
                 + (f" over {format_size(self.nvme_measured_bytes)}" if self.nvme_measured_bytes else "")
                 + " (O_DIRECT); "
                 f"the NVMe tier uses {self.nvme_io_threads} I/O threads, transfers up to "
                 f"{self.nvme_chunk_bytes >> 10} KiB",
                 *(["  disk read / write / both at once by volume measured: " + ", ".join(
                     f"{format_size(v)} {r / g:.2f} / {w / g:.2f} / {m / g:.2f} GB/s"
                     for v, (r, w, m) in sorted(self.nvme_volumes.items()))] if len(self.nvme_volumes) > 1 else []),
                 f"  AdamW: CPU {self.cpu_adam_rate / 1e6:.0f} M params/s, "
                 f"device {self.device_adam_rate / 1e6:.0f} M/s"
                 + (f"; the engine's other host passes {self.host_pass_bw / g:.1f} GB/s" if self.host_pass_bw else ""),
                 f"  runtime RSS {self.runtime_rss / 2**20:.0f} MiB; cached in {cache_path()}"]
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareProfile":
        d = dict(d)
        d["matmul_flops"] = {int(k): float(v) for k, v in d.get("matmul_flops", {}).items()}
        d["attention_flops"] = {int(k): float(v) for k, v in d.get("attention_flops", {}).items()}
        d["nvme_volumes"] = {int(k): [float(x) for x in v] for k, v in d.get("nvme_volumes", {}).items()}
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    @classmethod
    def synthetic(cls, **overrides) -> "HardwareProfile":
        """A plausible single-GPU workstation; tests override what they exercise."""
        base = cls(key="synthetic", cuda=True, device_name="synthetic-gpu", gpu_total=24 * GiB, gpu_free=24 * GiB,
                   host_total=64 * GiB, host_available=60 * GiB, nvme_free=0, nvme_read_bw=3e9, nvme_write_bw=2e9,
                   h2d_bw=20e9, d2h_bw=20e9, mem_bw=900e9, cpu_adam_rate=1e9, device_adam_rate=20e9,
                   matmul_flops={256: 20e12, 1024: 100e12, 4096: 150e12}, op_overhead_s=5e-6,
                   runtime_rss=400 * 2**20, threads=16, probe_version=PROBE_VERSION)
        return replace(base, **overrides)


def _by_size(rates: dict[int, float], size: int) -> float:
    """`rates` (size -> rate) at `size`: log-linear between measured sizes, the nearest one's outside them."""
    pts = sorted(rates.items())
    if size <= pts[0][0]:
        return pts[0][1]
    for (s0, f0), (s1, f1) in zip(pts, pts[1:]):
        if size <= s1:
            w = (math.log2(size) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
            return f0 + w * (f1 - f0)
    return pts[-1][1]


def machine_key() -> str:
    """hostname + compute devices: a cached profile is reused only on the same machine with the same GPUs."""
    devs = "cpu"
    if torch.cuda.is_available():
        devs = ",".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return f"{socket.gethostname()}|{devs}|threads={torch.get_num_threads()}"


PROBE_VERSION = 12
"""Bumped whenever a probed figure changes meaning (or a new one is measured). 2: matmul rates by the smallest side
([Note: matmul rate by the smallest side] in work.py; they were by square size). 3: the device's math
workspace. 4: the engine's host time per unit and per step. 5: and per streamed unit. 6: copies both ways at once.
7: the engine with its views built once ([Note: views built once] in offload/step/unit.py): a cached 6 overstates
its host time; and the host passes' rate (`host_pass_bw`); on a CPU, copies on one core, as the engine's copy
threads now make them. 8: fused attention's rate ([Note: attention's own rate] in work.py). 9: and the
elementwise ops timed alone ([Note: ops slower than their bytes]). 10: CPU AdamW over 64 M parameters on the
engine's step-thread cores (`probe.ADAM_NUMEL`), and on a GPU attention over enough heads to fill it. 11: on a GPU
the host's per-op and engine figures under autocast to bf16 ([Note: the host floor's precision] in probe.py). 12: on
a CPU, AdamW on the one thread the engine's step thread now runs it on ([Note: one OpenMP pool] in
offload/runtime/workers.py), and the engine's figures with every step on that thread."""


def cache_path() -> Path:
    root = os.environ.get("TIGHTFIT_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "tightfit")
    return Path(root).expanduser() / "hardware.json"


def load_cached() -> HardwareProfile | None:
    """The cached profile of this machine, or None (also when an older probe measured it)."""
    path = cache_path()
    try:
        entries = json.loads(path.read_text())
        d = entries.get(machine_key())
        return HardwareProfile.from_dict(d) if d and d.get("probe_version") == PROBE_VERSION else None
    except (OSError, ValueError, TypeError):
        return None


def save_cached(hw: HardwareProfile) -> Path:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries[hw.key] = hw.to_dict()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2))
    os.replace(tmp, path)
    return path


def free_bytes(folder: str | Path) -> int:
    """Free bytes on the disk of `folder`, which may not exist yet: its disk is its nearest existing parent's."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


PRESSURE_WARNING = 0.25
"""A profile measured while tasks waited for a core this share of the time was measured on a busy machine: on the
2-core VM two busy loops beside the probe gave 0.95 and half the matmul rate, a quiet minute 0.02."""


def current(hw: HardwareProfile, nvme_dir: str | None) -> HardwareProfile:
    """`hw` with the capacities that change over time re-read now (free GPU memory, available RAM, free disk)."""
    import psutil

    vm = psutil.virtual_memory()
    free_gpu = hw.gpu_free
    if hw.cuda and torch.cuda.is_available():
        free_gpu, _ = torch.cuda.mem_get_info()
    nvme_free = free_bytes(nvme_dir) if nvme_dir else 0
    return replace(hw, host_available=vm.available, host_total=vm.total, gpu_free=free_gpu, nvme_free=nvme_free,
                   measured_at=hw.measured_at or time.time())
