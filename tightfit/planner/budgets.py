"""Byte budgets per tier, where each came from, and what counts against them.

Why a module of its own: the search (search.py), the messages that suggest another figure (suggest.py) and the
trainer's checks read budgets the same way. A budget is derived once from the figures given or from the machine
(`derive_budgets`), so a suggested figure is checked by planning with exactly the budgets the user would get; and
`violations` is the one statement of what a prediction must hold within them: the device and host peaks, the
heap's free bytes at the step's peak on a CPU-only machine beyond the room the budget left beside the tiers
([Note: the heap at the step's peak] in costs.py), the swap folder's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tightfit.errors import UsageError
from tightfit.planner.costs import Prediction
from tightfit.planner.hardware import GiB, HardwareProfile
from tightfit.planner.naming import CLI, Naming
from tightfit.utils.sizes import format_size, parse_size


@dataclass
class Budgets:
    """Byte budgets per tier and where each came from."""

    device: int | None
    """Device tier (None on a CPU-only machine without --gpu-mem: the device shares `host`'s pool)."""
    host: int
    """Host memory for tier storage and buffers (the torch runtime's own RSS excluded)."""
    nvme: int = 0
    """Bytes the swap folder may use (0: no NVMe tier)."""
    nvme_dir: str | None = None
    """The swap folder (--nvme PATH)."""
    source: dict[str, str] = field(default_factory=dict)
    """Tier -> the setting that set it ("--gpu-mem", "gpu_mem") or "machine"."""
    given: dict[str, int | None] = field(default_factory=dict)
    """The byte figures the user gave, by key ("gpu_mem", "cpu_mem", "nvme"; None: not given): what a message
    suggesting another figure re-derives the budgets from (`with_given`)."""
    cpu_only: bool = False
    """No CUDA: the activations are the process heap's, which holds free bytes at the step's peak ([Note: the heap
    at the step's peak] in costs.py) that the host side of the budget must hold too."""
    heap_share: int = 0
    """The room the budget left beside the tiers (`allocator_share` of a --cpu-mem; the machine's `host_headroom`):
    only the heap's free bytes beyond it count against the host side."""

    @property
    def shared(self) -> bool:
        """Device and host tiers draw on one RAM pool (CPU-only machine, no --gpu-mem)."""
        return self.device is None

    def for_tier(self, tier: str) -> int | None:
        return {"device": self.device if self.device is not None else self.host, "host": self.host,
                "nvme": self.nvme if self.nvme_dir else 0}[tier]


def host_headroom(hw: HardwareProfile) -> int:
    """RAM left to the OS and other processes when no --cpu-mem is given: 10% of RAM, at least 1 GiB."""
    return max(GiB, hw.host_total // 10)


def device_headroom(hw: HardwareProfile) -> int:
    """GPU memory left to the CUDA context, allocator fragmentation and kernels' workspaces: 8%, at least 512 MiB."""
    return max(512 * 2**20, int(hw.gpu_total * 0.08))


def allocator_share(budget: int, cuda: bool = True) -> int:
    """What of a --gpu-mem budget the plan leaves to the CUDA caching allocator: 1/12 of it; of a --cpu-mem budget
    on a CPU-only machine, to the heap: 1/16.

    [Note: reserved vs allocated] The plan and the engine count allocated bytes (tensors); the GPU's memory is
    held as reserved bytes (the caching allocator's segments: block rounding, and freed blocks too small or too
    split for the next request). `tightfit train --gpu-mem X` caps reserved bytes at X (train/memory.py,
    `cap_device_memory`), so a plan that allocated all of X would fail at its first fragmented segment; this share
    keeps it clear. The CUDA context lies outside both counts.

    The same holds for RAM on a CPU-only machine, where the activations are the process's: glibc's heap keeps
    part of what it freed and fragments, RSS the plan does not count (measured in benchmarks/RESULTS.md, batch N).
    `--cpu-mem X` there leaves the heap 1/16 (a 1.3 B Llama planned to 6.00 GiB of 6 peaked at 6.06).

    Why 1/12 on a GPU: the first GPU run (2026-11-26, 8 GiB cap, `../shared/gpu-runs/2026-11-26/`) measured
    reserved bytes 7.2% above allocated for tightfit's plan (7.42 GiB allocated, 7.96 reserved: 0.53 GiB, more than
    the 0.50 GiB that 1/16 of the cap left; it fit because the plan allocated 80 MiB less than its budget) and 11.5%
    for FSDP2's; 1/12 (0.67 GiB of 8) covers the first with room."""
    return budget // 12 if cuda else budget // 16


def budgets_from(memory_cfg, hw: HardwareProfile, names: Naming = CLI) -> Budgets:
    """Budgets from --gpu-mem / --cpu-mem / --nvme (or their keyword arguments), or from the machine."""
    from tightfit.config import parse_nvme

    gpu = parse_size(memory_cfg.gpu_mem, names.of("gpu_mem")) if memory_cfg.gpu_mem is not None else None
    cpu = parse_size(memory_cfg.cpu_mem, names.of("cpu_mem")) if memory_cfg.cpu_mem is not None else None
    nvme_dir, nvme_size = parse_nvme(memory_cfg.nvme, names.of("nvme")) if memory_cfg.nvme is not None else (None,
                                                                                                          None)
    if nvme_dir and nvme_size is None and hw.nvme_free <= 0:
        raise UsageError(f"{names.of('nvme')}: the hardware profile states no free space for {nvme_dir} "
                         f"(nvme_free); give a size: {names.set('nvme', nvme_dir + ':SIZE')}")
    return derive_budgets(hw, names, gpu_mem=gpu, cpu_mem=cpu, nvme=nvme_size, nvme_dir=nvme_dir)


def derive_budgets(hw: HardwareProfile, names: Naming, gpu_mem: int | None, cpu_mem: int | None, nvme: int | None,
                   nvme_dir: str | None) -> Budgets:
    """Budgets from the byte figures given (None: the machine's, less headroom). The one statement of how a
    figure becomes a budget, so a suggested figure is checked by planning with exactly what the user would get."""
    src: dict[str, str] = {}
    # The room a CPU-only budget leaves beside the tiers, which the heap's free bytes at the step's peak use first: a
    # --cpu-mem's heap share, or the machine's headroom (a budget from the machine leaves its RAM's last 10%).
    heap = 0 if hw.cuda else host_headroom(hw)
    if gpu_mem is not None and hw.cuda:
        share = allocator_share(gpu_mem)
        device = max(0, gpu_mem - share)  # [Note: reserved vs allocated]
        src["device"] = f"{names.of('gpu_mem')} less {format_size(share)} for the CUDA allocator"
    elif gpu_mem is not None:
        device, src["device"] = gpu_mem, names.of("gpu_mem")
    elif hw.cuda:
        device, src["device"] = max(0, hw.gpu_free - device_headroom(hw)), "machine"
    else:
        device, src["device"] = None, "machine (shared with host RAM)"
    if cpu_mem is not None:
        host, src["host"] = cpu_mem, names.of("cpu_mem")
        if not hw.cuda:  # the device is this RAM: --cpu-mem bounds the whole process ([Note: process RSS], costs.py)
            heap = allocator_share(cpu_mem, cuda=False)  # [Note: reserved vs allocated]
            host = max(0, host - hw.runtime_rss - (device or 0) - heap)
            src["host"] = f"{names.of('cpu_mem')} less {format_size(heap)} for the heap"
    else:
        host = max(0, hw.host_available - hw.runtime_rss - host_headroom(hw))
        if not hw.cuda and device is not None:
            host = max(0, host - device)  # a CPU "device" budget comes out of the same RAM
        src["host"] = "machine"
    nvme_bytes = 0
    if nvme_dir is not None:
        nvme_bytes = nvme if nvme is not None else int(hw.nvme_free * 0.95)
        src["nvme"] = names.of("nvme") if nvme is not None else f"{names.of('nvme')} (free space)"
    return Budgets(device, host, nvme_bytes, nvme_dir, src, {"gpu_mem": gpu_mem, "cpu_mem": cpu_mem, "nvme": nvme},
                   cpu_only=not hw.cuda, heap_share=heap)


def with_given(b: Budgets, hw: HardwareProfile, names: Naming, key: str, value: int) -> Budgets:
    """`b` as it would be had the user given `value` for `key` ("gpu_mem", "cpu_mem" or "nvme")."""
    given = {**b.given, key: value}
    return derive_budgets(hw, names, given.get("gpu_mem"), given.get("cpu_mem"), given.get("nvme"),
                          b.nvme_dir or ("<nvme>" if key == "nvme" else None))


def violations(pred: Prediction, b: Budgets) -> list[tuple[str, int, int]]:
    """(tier, predicted, budget) for every budget `pred` exceeds."""
    out = []
    if b.shared:
        total = pred.peak["device"] + host_side(pred, b)
        if total > b.host:
            out.append(("host", total, b.host))
    else:
        for tier, used in (("device", pred.peak["device"]), ("host", host_side(pred, b))):
            if used > b.for_tier(tier):
                out.append((tier, used, b.for_tier(tier)))
    if pred.peak["nvme"] > b.for_tier("nvme"):
        out.append(("nvme", pred.peak["nvme"], b.for_tier("nvme")))
    return out


def host_side(pred: Prediction, b: Budgets) -> int:
    """What the host side of the budget holds: the host tier's peak, and on a CPU-only machine the heap's free bytes
    at the step's peak beyond what the budget left it (`Budgets.heap_share`)."""
    return pred.peak["host"] + (max(0, pred.heap_free(cuda=False) - b.heap_share) if b.cpu_only else 0)


def device_ok(pred: Prediction, b: Budgets) -> bool:
    if b.shared:
        return pred.peak["device"] + host_side(pred, b) <= b.host
    return pred.peak["device"] <= b.device


def host_ok(pred: Prediction, b: Budgets) -> bool:
    used = host_side(pred, b) + (pred.peak["device"] if b.shared else 0)
    return used <= b.host
