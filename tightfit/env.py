"""`tightfit env`: what this machine offers a training run.

Why: the first question when a run does not fit is "what do I have?" — torch version, devices and their memory,
host RAM, free disk where the swap folder would go. Reading it is instant; measuring bandwidths is the planner's
probe (`tightfit probe`), which takes longer and is cached.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import psutil
import torch

from tightfit import __version__
from tightfit.utils.sizes import format_size


def environment(swap_folder: str | None = None) -> dict:
    """What `tightfit env` reports. A swap folder that does not exist yet is measured at its nearest existing
    parent (where it would be created), and the report says so; one under a file is a UsageError."""
    from tightfit.utils.run_lock import check_folder_path

    vm = psutil.virtual_memory()
    folder = Path(swap_folder or ".").resolve()
    if swap_folder:
        check_folder_path(folder, "--nvme")
    probe = folder if folder.exists() else next((p for p in folder.parents if p.exists()), Path("/"))
    disk = shutil.disk_usage(probe)
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            devices.append({"index": i, "name": torch.cuda.get_device_name(i), "total": total, "free": free})
    return {
        "tightfit": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host_ram_total": vm.total,
        "host_ram_available": vm.available,
        "gpus": devices,
        "swap_folder": str(folder),
        "swap_folder_exists": folder.exists(),
        "swap_folder_measured_at": str(probe),
        "swap_folder_free": disk.free,
    }


def format_environment(env: dict) -> str:
    lines = [
        f"tightfit {env['tightfit']}  python {env['python']}  torch {env['torch']}"
        + (f"  cuda {env['cuda']}" if env["cuda"] else "  (CPU build)"),
        f"cpu:   {env['cpu_cores']} cores ({env['torch_threads']} torch threads)",
        f"host:  {format_size(env['host_ram_available'])} available of {format_size(env['host_ram_total'])} RAM",
    ]
    if env["gpus"]:
        for g in env["gpus"]:
            lines.append(f"gpu {g['index']}: {g['name']}, {format_size(g['free'])} free of {format_size(g['total'])}")
    else:
        lines.append("gpu:   none (the device tier is the CPU with a byte budget)")
    if env.get("swap_folder_exists", True):
        lines.append(f"disk:  {format_size(env['swap_folder_free'])} free at {env['swap_folder']} (swap folder)")
    else:
        lines.append(f"disk:  {format_size(env['swap_folder_free'])} free at {env['swap_folder_measured_at']} "
                     f"(swap folder {env['swap_folder']} does not exist yet; a run would create it there)")
    return "\n".join(lines)
