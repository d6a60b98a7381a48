"""Atomic, streaming safetensors files.

Why not `safetensors.torch.save_file`: it needs every tensor in memory at once, and it writes in place, so a crash
or a full disk mid-write destroys the previous file. Checkpoints of offloaded models arrive one tensor at a time
from the tiers, and an existing checkpoint must survive any failure of the next one. `StreamingWriter` appends
each tensor's bytes to a temporary body file as it arrives, then writes header + body to a temporary file in the
destination folder, fsyncs it, and renames it over the destination (then fsyncs the folder): the destination
is either the old file or the complete new one, never a mix.

`write_shard` writes a file whose tensors are all at hand (one unit of a checkpoint) in one pass: header first,
then each tensor's bytes, with a CRC-32 of each tensor's bytes computed on the way (zlib's, ~1 GB/s, far below
the disk's cost), then fsync. It is not atomic by itself: a checkpoint's shards are committed together by the
checkpoint's index (train/checkpoint_writer.py).

`open_checked` opens a file for reading and turns every way it can be unreadable (missing, truncated, corrupt
header) into a one-line UsageError naming the file and the flag that pointed at it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors import safe_open

from tightfit.errors import UsageError
from tightfit.utils.safetensors_format import DTYPE_TO_CODE
from tightfit.utils import untrusted_json


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StreamingWriter:
    """Write a safetensors file one tensor at a time; the file appears atomically on `close()`."""

    def __init__(self, path: str | Path, flag: str = "--out-dir") -> None:
        self.path = Path(path)
        self.flag = flag
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The body file holds tensor bytes in arrival order until close(); it lives beside the destination so the
        # final copy stays on one filesystem, and is deleted on close() or abort().
        self._body = tempfile.NamedTemporaryFile(dir=self.path.parent, prefix=".body-", delete=False)
        self._header: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._header:
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().cpu().contiguous()
        nbytes = t.numel() * t.element_size()
        try:
            self._body.write(t.reshape(-1).view(torch.uint8).numpy())  # raw bytes, no extra copy
        except OSError as e:
            self.abort()
            raise UsageError(f"{self.flag}: cannot write {self.path} ({e.strerror}); free space and retry") from None
        self._header[name] = {"dtype": DTYPE_TO_CODE[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}
        self._offset += nbytes

    def close(self, metadata: dict[str, str] | None = None) -> Path:
        header = dict(self._header)
        if metadata:
            header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors recommends
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self._body.flush()
            self._body.seek(0)
            with open(tmp, "wb") as out:
                out.write(len(raw).to_bytes(8, "little"))
                out.write(raw)
                shutil.copyfileobj(self._body, out, 16 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise UsageError(f"{self.flag}: cannot write {self.path} ({e.strerror}); "
                             "the previous file is untouched; free space and retry") from None
        finally:
            self._close_body()
        return self.path

    def abort(self) -> None:
        """Drop everything written so far; the destination is untouched."""
        self._close_body()

    def _close_body(self) -> None:
        if not self._body.closed:
            self._body.close()
        Path(self._body.name).unlink(missing_ok=True)

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype (bf16 and bool included), without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def crc32_of(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (contiguous CPU): what a checkpoint's index records to catch bit rot."""
    return zlib.crc32(tensor_bytes(t.contiguous()))


def write_shard(path: Path, items: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None
                ) -> dict[str, int]:
    """Write `items` (contiguous CPU tensors) as one safetensors file, fsynced; returns name -> CRC-32 of its bytes.

    Raises OSError (e.g. ENOSPC) with the file possibly partial: the caller owns the folder and commits or drops
    it as a whole."""
    header: dict[str, dict] = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    pos = 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_TO_CODE[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section 8-byte aligned, as the reference writer keeps it
    crcs = {}
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, t in items:
            data = tensor_bytes(t.contiguous())
            crcs[name] = zlib.crc32(data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return crcs


def open_checked(path: str | Path, flag: str, what: str = "safetensors file"):
    """`safe_open(path)` with every failure turned into a UsageError naming `flag` and the file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag}: {what} {path} does not exist")
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        # A truncated body passes safe_open (only the header is read); check the size the header promises.
        keys = list(handle.keys())
        end = 0
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = untrusted_json.loads(f.read(n))
        for k in keys:
            end = max(end, header[k]["data_offsets"][1])
        if path.stat().st_size < 8 + n + end:
            raise ValueError("file is shorter than its header says (truncated)")
    except UsageError:
        raise
    except Exception as e:  # safetensors raises its own error types; all mean the same to the user
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"{flag}: {path} is not a readable {what} ({msg}); "
                         "it may be truncated or corrupt — use another file") from None
    return handle
