"""The safetensors file format, read and written one tensor at a time.

Why not `safetensors.torch.load_file` / `save_file`: both work on a whole dict of tensors, so a shard is held in
memory at once, and `safe_open` memory-maps the file, so every page read stays in the process's resident set
(file-backed RSS) until the file is closed. Loading a model larger than RAM needs neither: here a tensor's bytes
are read with `readinto` straight into the tensor that will hold them (no intermediate copy, no mapping), and a
shard is written by declaring its header first and then writing each tensor's bytes at its offset, in any order.

The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian header length N; N
bytes of JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
the byte after the header), plus an optional "__metadata__" dict of strings; then the data. The files written
here are read by `safetensors.safe_open` and by `transformers` unchanged (tests/test_hf_safetensors.py).
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tightfit.errors import UsageError
from tightfit.utils.safetensors_format import CODE_TO_DTYPE, DTYPE_TO_CODE, MAX_HEADER
from tightfit.utils import untrusted_json


if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("tightfit's safetensors streaming assumes a little-endian machine")


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in one safetensors file."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset of the first byte in `file`."""
    end: int
    """Absolute byte offset one past the last byte."""

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(file: Path) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors a safetensors file holds (name -> entry) and its metadata; reads only the header."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise ValueError(f"header length {n} is implausible")
            header = untrusted_json.loads(f.read(n))
        size = file.stat().st_size
    except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UsageError(f"{file}: not a readable safetensors file ({e}); re-export it with safetensors") from None
    base = 8 + n
    if not isinstance(header, dict):  # e.g. a JSON list: not a safetensors header, whatever the file is called
        raise UsageError(f"{file}: not a safetensors file (its header is a JSON {type(header).__name__}, not an "
                         "object); re-export it with safetensors")
    meta = header.pop("__metadata__", None) or {}
    entries = {}
    for name, info in header.items():
        try:
            dtype = CODE_TO_DTYPE[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (base + int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{file}: tensor {name!r} has an unreadable or unsupported header entry {info}") from None
        if end - begin != math.prod(shape) * dtype.itemsize or end > size:
            raise UsageError(f"{file}: tensor {name!r} has byte range [{begin}, {end}) that does not match its "
                             f"shape {list(shape)} and dtype, or lies past the end of the file; the file is corrupt")
        entries[name] = TensorEntry(name, file, dtype, shape, begin, end)
    _check_offsets(file, entries, base, size)
    return entries, meta


def _check_offsets(file: Path, entries: dict[str, TensorEntry], base: int, size: int) -> None:
    """The data section is the tensors back to back, as the safetensors library validates it: sorted by offset,
    each begins where the one before ends (no overlap: two names sharing bytes; no gap: bytes no tensor owns), the
    first at the data section's start, the last at the file's end. A crafted or damaged header fails here, before
    a byte of data is read."""
    pos = base
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            what = "overlaps the tensor before it" if e.begin < pos else f"leaves a gap of {e.begin - pos} bytes"
            raise UsageError(f"{file}: tensor {e.name!r} at byte {e.begin - base} of the data {what}; the header "
                             "is corrupt or crafted, re-export the file with safetensors")
        pos = e.end
    if pos != size:
        raise UsageError(f"{file}: the tensors end at byte {pos} but the file has {size}; the file is truncated, "
                         "padded or corrupt, re-export it with safetensors")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (any dtype, including bf16 and bool)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


class TensorReader:
    """Reads tensors out of safetensors files, keeping one plain file handle per file (no memory mapping).

    Use as a context manager; handles are closed on exit.
    """

    def __init__(self) -> None:
        self._handles: dict[Path, object] = {}  # file -> open binary handle; freed in close()

    def __enter__(self) -> "TensorReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for h in self._handles.values():
            h.close()
        self._handles.clear()

    def read(self, entry: TensorEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `entry` describes, as a new CPU tensor of `dtype` (default: the stored dtype).

        Stored dtype == requested dtype: the bytes land directly in the result. Otherwise they land in a temporary
        of the stored dtype that is converted and freed, so the peak is the tensor in both dtypes, never more.
        """
        out = torch.empty(entry.shape, dtype=entry.dtype)
        if entry.nbytes:
            f = self._handles.get(entry.file)
            if f is None:
                f = self._handles[entry.file] = open(entry.file, "rb")
            f.seek(entry.begin)
            got = f.readinto(_bytes_of(out))
            if got != entry.nbytes:
                raise UsageError(f"{entry.file}: tensor {entry.name!r} is truncated ({got} of {entry.nbytes} bytes); "
                                 "the file is incomplete, copy or export it again")
        return out if dtype is None or dtype == entry.dtype else out.to(dtype)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: its name, dtype and shape, known before its data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class ShardWriter:
    """Writes one safetensors file whose tensors are declared up front and whose data arrives in any order.

    The header (with every offset) is written on open, so each `write` is one seek and one write of that tensor's
    bytes: memory is one tensor, whatever the shard size. `close` checks that every declared tensor was written.
    """

    def __init__(self, file: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._offsets: dict[str, tuple[int, TensorSpec]] = {}
        pos = 0
        for s in specs:
            if s.dtype not in DTYPE_TO_CODE:
                raise UsageError(f"{file}: tensor {s.name!r} has dtype {s.dtype}, which safetensors cannot store")
            header[s.name] = {"dtype": DTYPE_TO_CODE[s.dtype], "shape": list(s.shape), "data_offsets": [pos, pos + s.nbytes]}
            self._offsets[s.name] = (pos, s)
            pos += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned, as the reference writer does
        self._base = 8 + len(raw)
        self._pending = set(self._offsets)
        self.file = Path(file)
        self._f = open(self.file, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self._base + pos)  # the final size now, so out-of-order writes never leave a short file

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor` (any device; converted to the declared dtype) as the declared tensor `name`."""
        if name not in self._offsets:
            raise KeyError(f"{self.file}: tensor {name!r} was not declared for this shard")
        pos, spec = self._offsets[name]
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{self.file}: tensor {name!r} has shape {list(tensor.shape)}, declared {list(spec.shape)}")
        t = tensor.detach().to(device="cpu", dtype=spec.dtype).contiguous()
        if spec.nbytes:
            self._f.seek(self._base + pos)
            self._f.write(_bytes_of(t))
        self._pending.discard(name)

    def close(self) -> None:
        """Flush to disk; raises if a declared tensor was never written (the file would hold garbage for it)."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if self._pending:
            raise ValueError(f"{self.file}: {len(self._pending)} declared tensors never written, e.g. "
                             f"{sorted(self._pending)[:3]}")
