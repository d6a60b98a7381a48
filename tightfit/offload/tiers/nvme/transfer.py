"""How the NVMe tier moves bytes: a tensor cut into transfers, and one transfer on an I/O thread.

Why a file of its own: this is the hot path of the tier, and its rules are the disk's, not the store's: which
bytes may go through O_DIRECT, how large a transfer is, what a short or failed `pwrite`/`preadv` means. The store
(nvme.py) decides what to move and when; this decides how.

- *positional I/O*: `os.pwrite` / `os.preadv` release the GIL, so the store's threads keep several transfers in
  flight while Python keeps scheduling compute. The bytes go straight between the caller's tensor memory and the
  file: no intermediate copy in Python.
- *O_DIRECT where alignment allows*: when a buffer's address and its file offset agree modulo 4096 (the engine
  allocates its staging buffers with `aligned_empty`), the aligned body goes through an O_DIRECT descriptor, which
  skips the page cache (no second memcpy, no write-back bursts, no cache evicting the host tier). Unaligned heads
  and tails, unaligned buffers and filesystems that refuse O_DIRECT (EINVAL) use an ordinary buffered descriptor
  on the same file. The two descriptors never share a page within one request.

[Note: transfer size] A tensor of n bytes is cut into ceil(n / chunk_bytes) equal transfers in whole 4096-byte
blocks: as few and as large as `chunk_bytes` (the largest request the disk takes, at most 4 MiB: [Note: disk
tuning] in nvme/tuning.py; 4 MiB on the benchmark VM) allows. The disk serves large requests better (4 MiB reads
moved about 1.5x the bytes per queue slot of 512 KiB reads), and the several entries a training step has in flight
keep its queue busy. Measured side by side on the benchmark VM with 7 MB entries (benchmarks/RESULTS.md, batch
E): cutting each entry one piece per I/O thread (>= 512 KiB, so that a lone fetch fills the queue) gave reads at
0.70-0.72 of raw and the mixed step 0.69-0.70; 4 MiB pieces gave 0.82-0.85 and 0.78-0.79. With 50 MB entries,
4 MiB transfers took the tier from 0.79 (512 KiB) to 0.89 of raw.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tightfit.errors import UsageError
from tightfit.offload.runtime.aligned import DIRECT_ALIGN
from tightfit.offload.tiers.nvme.stats import IoStats
from tightfit.utils import ranges

if TYPE_CHECKING:
    from tightfit.offload.tiers.nvme.file import NvmeFile

O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS): every transfer is buffered
FULL = (errno.ENOSPC, errno.EDQUOT)
"""The errors of a disk (or quota) that is full."""

_RANGES = {"read": "tightfit::nvme read", "write": "tightfit::nvme write"}
"""Profiler range names, built once: a transfer formats no string when nobody profiles."""


def transfer_size(nbytes: int, chunk_bytes: int) -> int:
    """Bytes per transfer for a span of `nbytes` ([Note: transfer size])."""
    pieces = max(-(-nbytes // chunk_bytes), 1)
    size = -(-nbytes // pieces)
    return min(chunk_bytes, max(DIRECT_ALIGN, -(-size // DIRECT_ALIGN) * DIRECT_ALIGN))


def plan(nbytes: int, file_offset: int, addr: int, direct: bool, chunk_bytes: int) -> list[tuple[int, int, bool]]:
    """Cut `nbytes` going between file offset `file_offset` and buffer address `addr` into (start, length,
    direct) transfers of at most chunk_bytes, `start` counted from the first byte.

    O_DIRECT (when `direct`) is possible only where file offset and buffer address are both 4096-aligned, i.e.
    when they agree modulo 4096: then a buffered head reaches the first aligned offset, the body goes direct in
    whole blocks, and a buffered tail carries the last partial block.
    """
    n, A = nbytes, DIRECT_ALIGN
    head = body = 0
    if direct and (file_offset - addr) % A == 0:
        head = min(n, (-file_offset) % A)
        body = (n - head) // A * A
    parts: list[tuple[int, int, bool]] = []
    for lo, hi, go_direct in ((0, head, False), (head, head + body, True), (head + body, n, False)):
        size = transfer_size(hi - lo, chunk_bytes)
        parts += [(s, min(size, hi - s), go_direct) for s in range(lo, hi, size)]
    return parts


def transfer(kind: str, f: NvmeFile, name: str, off: int, buf: memoryview, direct: bool, stats: IoStats,
             folder: Path) -> None:
    """Run one transfer of tensor `name` on an I/O thread (the GIL is released inside pwrite/preadv); a profiler
    range "tightfit::nvme read|write <tensor>" while `--profile` records (tightfit/utils/ranges.py)."""
    with ranges.span(_RANGES[kind], name):
        stats.start(kind)
        done, moved_direct = 0, 0
        try:
            if direct and f.direct and f.dfd is not None:
                try:
                    done = moved_direct = transfer_once(kind, f.dfd, buf, off)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    # The filesystem refused O_DIRECT after all (e.g. tmpfs, some network filesystems): stop
                    # planning direct transfers for this file and finish this one buffered.
                    f.direct = False
                    stats.fallback()
            while done < len(buf):  # buffered path; also finishes a short direct transfer
                done += transfer_once(kind, f.fd, buf[done:], off + done)
        except OSError as e:
            if e.errno in FULL:
                raise UsageError(
                    out_of_space(folder, f.path.name, f"could not take tensor {name!r} ({os.strerror(e.errno)})")
                ) from None
            raise UsageError(
                f"--nvme: {'writing' if kind == 'write' else 'reading'} tensor {name!r} of {f.path} failed at byte "
                f"{off + done} ({e.strerror or e}); check the disk under {folder} (dmesg), or point --nvme "
                f"at another disk") from e
        finally:
            stats.end(kind, done, moved_direct)


def transfer_once(kind: str, fd: int, buf: memoryview, off: int) -> int:
    """One pwrite or preadv call; bytes moved (> 0). Reading past the end of the file is an error."""
    if kind == "write":
        n = os.pwrite(fd, buf, off)
        if n <= 0:
            raise OSError(errno.ENOSPC, "pwrite wrote nothing")
    else:
        n = os.preadv(fd, [buf], off)
        if n <= 0:
            raise OSError(errno.EIO, "unexpected end of file (was the tier file truncated?)")
    return n


def pwrite_all(fd: int, buf: memoryview, off: int) -> None:
    """Write all of `buf` at `off` (a header: a few short writes at most)."""
    done = 0
    while done < len(buf):
        done += transfer_once("write", fd, buf[done:], off + done)


def out_of_space(folder: Path, name: str, what: str) -> str:
    """The one-line message of a swap disk that cannot take file `name`."""
    return (
        f"--nvme: swap folder {folder} is out of space: {name} {what}; free space on that disk, "
        f"or point --nvme at a bigger one"
    )
