"""A checkpoint of units whose states live on NVMe: a consistent copy of their swap files, not a pass through memory.

Why: a unit whose fp32 master and Adam moments are on the NVMe tier already has them in a safetensors file on
disk (offload/nvme.py, 4096-aligned). Reading them through the engine into memory to write them out again moves
every byte through the engine twice; here the byte ranges are copied as files: by `os.copy_file_range` where the
filesystem shares blocks (a reflink: XFS, btrfs, ...; no bytes move), else by a loop of large pread/pwrite blocks,
as fast as a raw copy of the same bytes (`SHARES_BLOCKS`). The trainer waits only for that copy. Everything
else a checkpoint does - the finiteness check, the CRC-32 per tensor, the index - runs on the writer thread over
the *copy*, while training goes on (checkpoint_writer.py).

The shard of such a unit holds the unit's flat entries ("master", "exp_avg", "exp_avg_sq", each 1-D, laid out
4096-aligned like a swap file: safetensors_file.py) and its Adam step counts as small tensors; the index names
each parameter's tensor as a *view*: {"entry": "master", "offset": <first element>} with its shape, so a loader
reads exactly the same keys as from any other shard ([Note: views] in docs/CHECKPOINTS.md).

Consistency: the copy is taken after `quiesce` (no request in flight, every write-back on disk) and before the
trainer's next step can change a swap file, so it is the state of one step for every unit.

The run's last save hands the swap over ([Note: the last save takes the swap's place] in
offload/memory_model.py): each unit's swap file is removed once its states are in the checkpoint, and the engine
is closed right after.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tightfit.offload.runtime.aligned import DIRECT_ALIGN
from tightfit.offload.step.unit import EXP_AVG, EXP_AVG_SQ
from tightfit.offload.placement import State
from tightfit.offload.tiers.nvme.safetensors_file import plan_layout
from tightfit.offload.tiers.stores import DiskStore
from tightfit.train.checkpoint_writer import SwapFileGone
from tightfit.utils.safetensors_io import tensor_bytes

MASTER_ENTRY = "master"
_CHUNK = 64 << 20


@dataclass
class View:
    """One checkpoint tensor stored as a slice of a flat entry of its shard."""

    key: str
    entry: str
    offset: int
    """First element in the entry."""
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32


@dataclass
class SwapCopy:
    """One unit's shard made by copying byte ranges of its swap file(s); `write` runs on the trainer's thread."""

    group: str
    ranges: list[tuple[str, Path, int, int]]
    """(shard entry, swap file, absolute offset, bytes) per flat entry copied."""
    views: list[View]
    small: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    """Tensors written from memory (the Adam step counts: host scalars, not in any swap file)."""
    copied_bytes: int = 0

    def write(self, dest: Path) -> None:
        """Header, then each range copied (in the kernel where that shares blocks), then the small tensors. Not
        yet durable (the writer thread fsyncs it before the commit). OSError on failure."""
        layout = {name: ((nbytes // 4,), torch.float32) for name, _, _, nbytes in self.ranges}
        layout.update({k: (tuple(t.shape), t.dtype) for k, t in self.small})
        header, entries, size = plan_layout(layout, DIRECT_ALIGN)
        kernel = hasattr(os, "copy_file_range") and filesystem_type(dest.parent) in SHARES_BLOCKS
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, header, 0)
            for name, src, offset, nbytes in self.ranges:
                _copy_range(src, offset, fd, entries[name].offset, nbytes, kernel)
                self.copied_bytes += nbytes
            for k, t in self.small:
                os.pwrite(fd, tensor_bytes(t.contiguous()), entries[k].offset)
            # No fsync here: the writer thread syncs the shard before the commit. Syncing each shard on the trainer's
            # thread stalled reading the next one until this one reached the disk (1.8x a raw copy's time).
        finally:
            os.close(fd)


SHARES_BLOCKS = {"xfs", "btrfs", "bcachefs", "zfs", "ocfs2", "nfs", "nfs4", "cifs", "smb3"}
"""Filesystems where copy_file_range shares blocks (a reflink) or copies on the server: a copy costs no disk
bandwidth. Elsewhere (ext4, tmpfs) the kernel splices through the page cache with small readahead, which measured
~2x slower than reading and writing 16 MiB blocks (benchmarks/RESULTS.md, "Checkpoints"): there the copy is the
block loop."""


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` ("ext4", "xfs", ...) from /proc/mounts; "" when unknown."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return ""
    best = ""
    for mount, fstype in mounts:
        mount = mount.replace("\\040", " ")
        try:
            if os.stat(mount).st_dev == dev and len(mount) >= len(best):
                best, found = mount, fstype
        except OSError:
            continue
    return found if best else ""


def _copy_range(src: Path, src_off: int, dst_fd: int, dst_off: int, nbytes: int, kernel: bool) -> None:
    """`nbytes` from `src` at `src_off` to `dst_fd` at `dst_off`. kernel: copy_file_range (a reflink, or a server
    side copy: SHARES_BLOCKS), falling back where the kernel refuses it (EXDEV: another filesystem); else a loop of
    16 MiB pread/pwrite blocks. SwapFileGone when `src` is no longer there."""
    try:
        fd = os.open(src, os.O_RDONLY)
    except FileNotFoundError:
        raise SwapFileGone(src) from None
    try:
        done = 0
        buf = None
        while done < nbytes:
            if kernel:
                try:
                    got = os.copy_file_range(fd, dst_fd, nbytes - done, src_off + done, dst_off + done)
                except OSError as e:
                    if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    kernel = False
                    continue
            else:
                if buf is None:
                    buf = memoryview(bytearray(_CHUNK // 4))
                n = os.preadv(fd, [buf[:min(len(buf), nbytes - done)]], src_off + done)
                got = os.pwrite(dst_fd, buf[:n], dst_off + done) if n else 0
            if got <= 0:
                raise OSError(errno.EIO, f"short copy from {src}")
            done += got
    finally:
        os.close(fd)


def copyable(engine, unit) -> bool:
    """Can `unit`'s checkpoint be a copy of its swap file? Its fp32 master (all of it: no frozen tail kept only
    in the compute dtype) and its moments must be entries of NVMe-tier files."""
    from tightfit.offload.step.unit import PARAMS

    master, optim = unit.store[State.MASTER], unit.store[State.OPTIM]
    fp32_master = unit.master_entry != PARAMS or unit.compute_dtype == torch.float32
    return (isinstance(master, DiskStore) and isinstance(optim, DiskStore) and fp32_master
            and unit.master_numel == unit.spec.numel and unit.steps_here)


def swap_copy(unit, with_optim: bool) -> SwapCopy:
    """The SwapCopy of one copyable unit (after `state_io.quiesce`)."""
    master = unit.store[State.MASTER]
    src = master.nvme.path(master._files[unit.name])
    e = master.nvme.entry(master._files[unit.name], unit.master_entry)
    ranges = [(MASTER_ENTRY, src, e.offset, e.nbytes)]
    views = [View(f"model.{s.name}", MASTER_ENTRY, s.offset, tuple(s.shape)) for s in unit.spec.slots]
    small = []
    if with_optim and not unit.moments_empty:
        optim = unit.store[State.OPTIM]
        osrc = optim.nvme.path(optim._files[unit.name])
        for entry in (EXP_AVG, EXP_AVG_SQ):
            oe = optim.nvme.entry(optim._files[unit.name], entry)
            ranges.append((entry, osrc, oe.offset, oe.nbytes))
        for i, s in enumerate(unit.trainable):
            if unit.steps[i] is None:
                continue
            views += [View(f"optim.{s.name}.{entry}", entry, s.offset, tuple(s.shape)) for entry in (EXP_AVG,
                                                                                                   EXP_AVG_SQ)]
            small.append((f"optim.{s.name}.step", unit.steps[i].detach().cpu().clone()))
    return SwapCopy(unit.name, ranges, views, small)


def state_groups(model, opt, hand_over: bool = False):
    """What a checkpoint of `model` holds, a unit at a time: (group, [(key, tensor)]) read through memory, or a
    SwapCopy for a unit whose states are on NVMe. Plain models: `state_io.export_groups`. `hand_over`: the run's
    last save; each unit's swap file is removed once the unit has been taken, and the caller closes the engine
    when this is done (the checkpoint has its NVMe states, the swap no longer)."""
    from tightfit.offload.step.engine import find_engine
    from tightfit.offload.model_state.state_io import export_groups, quiesce

    engine = find_engine(model)
    if engine is None:
        yield from export_groups(model, opt)
        return
    quiesce(engine)
    for unit in engine.units.values():
        yield from unit_groups(engine, unit, opt is not None, hand_over)


def unit_groups(engine, unit, with_optim: bool, hand_over: bool = False):
    """`state_groups` of one unit (after `state_io.quiesce`)."""
    from tightfit.offload.model_state.state_io import export_pieces

    if copyable(engine, unit):
        for store in {unit.store[State.MASTER], unit.store[State.OPTIM]}:
            store.wait()  # no request in flight on the files being copied
        yield swap_copy(unit, with_optim)
    else:
        for piece in export_pieces(engine, unit, with_optim):  # a large unit: several shards
            yield unit.name, piece
    if hand_over:
        drop_swap(unit)


def drop_swap(unit) -> None:
    """Remove the unit's swap files (the run's last save has taken its states: its shard is written, or its
    pieces are the writer's own copies)."""
    for store in {unit.store[s] for s in State}:
        if isinstance(store, DiskStore):
            store.drop(unit.name)
