"""How the NVMe tier drives its disk: I/O threads and the largest transfer, read from the probe's cache.

Why a file of its own: these are properties of a disk, found once by `tightfit probe` and read by the tier, the
planner (`tightfit.planner.disk_probe`, which imports `device_of`) and the benchmarks; none of them needs the
store's I/O machinery (nvme.py) to ask which tuning applies to a folder.

[Note: disk tuning] How many I/O threads (= transfers in flight) and how large a transfer are properties of the
disk, not choices a user should make: `tightfit probe` measures them for the swap folder's disk
(tightfit/planner/disk_probe.py) and caches them in the hardware profile; `disk_tuning(folder)` reads that cache
when it describes the folder's filesystem, else takes the defaults (8 threads, 4 MiB). Reading is cheap (a stat
and a JSON file): nothing is measured when a model is wrapped. Benchmarks and tests that need other values pass
`threads` / `chunk_bytes` to the store (`tightfit.wrap(..., disk=DiskTuning(...))` reaches it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tightfit.offload.runtime.aligned import DIRECT_ALIGN


@dataclass(frozen=True)
class DiskTuning:
    """How the NVMe tier drives its disk ([Note: disk tuning]). None: what `disk_tuning` derives for the folder."""

    threads: int | None = None
    """I/O threads = transfers in flight at once."""
    chunk_bytes: int | None = None
    """Largest single transfer, a multiple of 4096 ([Note: transfer size] in nvme/transfer.py)."""


DEFAULT_TUNING = DiskTuning(threads=8, chunk_bytes=4 << 20)
"""Where no probe measured the folder's disk: what the benchmark VM's disk was measured best with."""


def device_of(folder: str | Path) -> str | None:
    """The filesystem holding `folder` (or its nearest existing parent) as "major:minor", or None."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    return f"{os.major(dev)}:{os.minor(dev)}"


def disk_tuning(folder: str | Path) -> DiskTuning:
    """The probe's tuning for the disk of `folder` when the cached hardware profile measured that filesystem, else
    `DEFAULT_TUNING`. Cheap: no measurement ([Note: disk tuning])."""
    # The profile is the planner's (tightfit probe writes it); only its cache is read here, lazily, so the
    # engine does not load the planner unless a disk tier is built.
    from tightfit.planner.hardware import load_cached

    hw = load_cached()
    dev = device_of(folder)
    if hw is None or not dev or hw.nvme_device != dev:
        return DEFAULT_TUNING
    threads, chunk = hw.nvme_io_threads, hw.nvme_chunk_bytes
    if threads < 1 or chunk < DIRECT_ALIGN or chunk % DIRECT_ALIGN:  # a hand-edited cache: not worth an error
        return DEFAULT_TUNING
    return DiskTuning(threads=threads, chunk_bytes=chunk)
