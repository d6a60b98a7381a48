"""The byte layout of a safetensors file the NVMe tier can update in place with O_DIRECT.

Why: the swap folder must stay readable by any safetensors reader (a crashed run's states can be inspected, a kept
folder is a checkpoint), yet the tier rewrites tensors in place at fixed offsets with direct I/O, which needs every
tensor to start at a multiple of 4096 bytes. The format allows both, with two tricks that stay inside the spec:

- the JSON header may end in spaces, so it is padded until the data section starts at a multiple of 4096;
- the data section may have no holes (readers reject a gap between one tensor's end and the next one's start), so
  the gap after a tensor whose size is not a multiple of 4096 is filled by a small uint8 *padding tensor* named
  `PAD_PREFIX + str(i)`. Readers see these as extra entries; `is_padding` tells them apart, and the header's
  `__metadata__` names the prefix. A layout planned with `align=1` has no padding and no guarantees.

File layout: [u64 little-endian N][N bytes of JSON + spaces][data section: tensors in the order given].
Offsets in the JSON are relative to the data section; `Entry.offset` here is absolute (from byte 0 of the file).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from tightfit.errors import UsageError
from tightfit.utils.safetensors_format import CODE_TO_DTYPE, DTYPE_TO_CODE, MAX_HEADER
from tightfit.utils import untrusted_json

PAD_PREFIX = "__tightfit_pad__."
"""Name prefix of the padding tensors that keep every real tensor 4096-aligned."""



@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes live in its file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Absolute byte offset of the first element in the file."""
    nbytes: int


def is_padding(name: str) -> bool:
    """True for the padding entries `plan_layout` inserts (not user tensors)."""
    return name.startswith(PAD_PREFIX)


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return prod(shape) * dtype.itemsize


def plan_layout(
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], align: int = 4096
) -> tuple[bytes, dict[str, Entry], int]:
    """Header bytes (length prefix included), entries by name (padding included) and total file size.

    Every tensor starts at a multiple of `align` (1: packed, no padding tensors); the data section too.
    """
    header: dict[str, dict] = {"__metadata__": {"format": "pt", "tightfit_padding_prefix": PAD_PREFIX}}
    rel: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []  # name, dtype, shape, start, nbytes
    pos = 0
    items = list(tensors.items())
    for i, (name, (shape, dtype)) in enumerate(items):
        if is_padding(name) or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is reserved by the safetensors layout")
        if dtype not in DTYPE_TO_CODE:
            raise ValueError(f"tensor {name!r}: dtype {dtype} has no safetensors name")
        shape = tuple(int(s) for s in shape)
        n = nbytes_of(shape, dtype)
        rel.append((name, dtype, shape, pos, n))
        pos += n
        gap = (-pos) % align
        if gap and i < len(items) - 1:  # the last tensor needs nothing after it
            rel.append((f"{PAD_PREFIX}{i}", torch.uint8, (gap,), pos, gap))
            pos += gap
    for name, dtype, shape, start, n in rel:
        header[name] = {"dtype": DTYPE_TO_CODE[dtype], "shape": list(shape), "data_offsets": [start, start + n]}
    body = json.dumps(header, separators=(",", ":")).encode()
    data_start = 8 + len(body)
    data_start += (-data_start) % align
    body += b" " * (data_start - 8 - len(body))
    entries = {
        name: Entry(name, dtype, shape, data_start + start, n) for name, dtype, shape, start, n in rel
    }
    return struct.pack("<Q", len(body)) + body, entries, data_start + pos


def read_layout(path: str | Path) -> tuple[dict[str, Entry], int]:
    """Entries and file size of an existing safetensors file; UsageError naming the file if it is not one."""
    path = Path(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < n <= min(MAX_HEADER, size - 8):
                raise ValueError("bad header length")
            header = untrusted_json.loads(f.read(n))
        data_start = 8 + n
        entries: dict[str, Entry] = {}
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = CODE_TO_DTYPE[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            start, stop = (int(x) for x in info["data_offsets"])
            if stop - start != nbytes_of(shape, dtype):
                raise ValueError(f"tensor {name!r} has the wrong byte length")
            entries[name] = Entry(name, dtype, shape, data_start + start, stop - start)
            end = max(end, stop)
        if data_start + end != size:
            raise ValueError("file size does not match the header")
    except OSError as e:
        raise UsageError(f"{path}: cannot open safetensors file ({e.strerror}); check the path") from None
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise UsageError(f"{path}: not a valid safetensors file ({e}); delete it or point to another file") from None
    return entries, size
