"""Tokenized examples on disk, memory-mapped: a corpus larger than RAM trains without being held in memory.

Why a cache: tokenizing a large instruction set takes minutes; a resumed or repeated run should not pay it again,
and the run should not hold the corpus in memory. The records are read and tokenized a batch at a time and appended
to three flat files in a folder of `--out-dir/tokens/`:
- `ids.bin`: every example's token ids, one after another (int32, little-endian);
- `mask.bin`: one byte per token, 1 where the token carries loss;
- `offsets.bin`: where each example starts in them, and the end (int64, examples + 1 entries);
with `meta.json` (counts, the format, what was skipped and why). The folder is named by a hash of what the tokens
depend on: each data file's path, size and modification time, the tokenizer's files, the chat template, the
format and `--train-on-prompt`; a change to any of them tokenizes again, into a new folder. It is written under a
temporary name and renamed when complete, so a crash never leaves a cache that looks whole. Nothing in it is
executable: flat integers and JSON.
"""

from __future__ import annotations

import hashlib
from array import array
import json
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tightfit.errors import UsageError
from tightfit.finetune.records import BadRecord, detect_format, read_records
from tightfit.finetune.render import Renderer

CACHE_VERSION = 1
PROGRESS_S = 10.0
"""Seconds between two progress lines while records are tokenized."""
BATCH_RECORDS = 1000
"""Records tokenized in one call of a fast tokenizer."""


@dataclass
class TokenizedExamples:
    """Examples as memory-mapped arrays: example i is ids[offsets[i]:offsets[i + 1]] with its loss mask."""

    ids: np.ndarray  # int32
    mask: np.ndarray  # uint8
    offsets: np.ndarray  # int64, examples + 1
    meta: dict
    folder: Path

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def cache_key(files: list[Path], tokenizer, fmt: str, train_on_prompt: bool, chat_template: str | None) -> str:
    h = hashlib.sha256(f"v{CACHE_VERSION} {fmt} {train_on_prompt}".encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()} {st.st_size} {st.st_mtime_ns}\n".encode())
    folder = getattr(tokenizer, "path", None)
    if folder is not None:
        for f in sorted(Path(folder).iterdir()):
            if f.is_file() and (f.suffix in (".json", ".model", ".txt", ".jinja") or f.name.endswith(".tiktoken")):
                h.update(f.name.encode() + f.read_bytes())
    else:
        h.update(b"bytes")
    if chat_template is not None:
        h.update(Path(chat_template).read_bytes())
    return h.hexdigest()[:20]


def tokenize_records(files: list[Path], root: Path, tokenizer, *, forced_format: str = "auto",
                     train_on_prompt: bool = False, chat_template: str | None = None, skip_bad: bool = False,
                     flag: str = "--data", say: Callable[[str], None] | None = None) -> TokenizedExamples:
    """The records of `files` tokenized, from the cache under `root` or made now and cached there."""
    fmt = forced_format
    if fmt == "auto":
        fmt = _first_format(files, flag)
    key = cache_key(files, tokenizer, fmt, train_on_prompt, chat_template)
    folder = root / key
    if (folder / "meta.json").is_file():
        cached = _open(folder)
        if cached is not None:
            if say is not None:
                say(f"{flag}: {len(cached):,} examples from the token cache {folder}")
            return cached
    renderer = Renderer(tokenizer, fmt, train_on_prompt, chat_template)
    partial = root / f".{key}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    skipped: Counter = Counter()
    first_skipped: dict[str, str] = {}
    n_records = n_examples = n_tokens = 0
    start = last = time.monotonic()
    offsets = array("q", [0])  # 8 bytes an example (a list of ints took ~5x that)
    try:
        with open(partial / "ids.bin", "wb") as ids_f, open(partial / "mask.bin", "wb") as mask_f:
            for chunk in _chunks(read_records(files, flag), BATCH_RECORDS):
                n_records += len(chunk)
                for where, out in zip((w for w, _ in chunk), renderer.many(chunk)):
                    if isinstance(out, BadRecord):
                        if not skip_bad:
                            raise out
                        skipped[out.what.split(" (")[0]] += 1
                        first_skipped.setdefault(out.what.split(" (")[0], where)
                        continue
                    ids, mask = out
                    ids_f.write(np.asarray(ids, dtype="<i4").tobytes())
                    mask_f.write(np.asarray(mask, dtype=np.uint8).tobytes())
                    n_tokens += len(ids)
                    n_examples += 1
                    offsets.append(n_tokens)
                now = time.monotonic()
                if say is not None and now - last >= PROGRESS_S:
                    last = now
                    say(f"tokenizing {flag}: {n_records:,} records, {n_tokens:,} tokens, "
                        f"{n_records / max(now - start, 1e-9):,.0f} records/s")
        if not n_examples:
            where = files[0] if len(files) == 1 else f"{len(files)} files"
            raise UsageError(f"{flag}: no example to train on in {where}"
                             + (f" ({sum(skipped.values())} bad records skipped)" if skipped else ""))
        np.frombuffer(offsets, dtype=np.int64).astype("<i8").tofile(partial / "offsets.bin")
        meta = {"version": CACHE_VERSION, "format": fmt, "records": n_records, "examples": n_examples,
                "tokens": n_tokens, "skipped": dict(skipped), "first_skipped": first_skipped,
                "rendering": renderer.describe(), "files": [str(f) for f in files],
                "seconds": round(time.monotonic() - start, 3)}
        (partial / "meta.json").write_text(json.dumps(meta, indent=1))
        if folder.exists() and _open(folder) is None:
            shutil.rmtree(folder, ignore_errors=True)  # an unreadable one of the same key
        try:
            os.replace(partial, folder)
        except OSError:  # another rank of the run (or another run) committed the same tokens first
            if _open(folder) is None:
                raise
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if say is not None:
        say(f"{flag}: tokenized {n_records:,} records into {n_examples:,} examples ({n_tokens:,} tokens) in "
            f"{meta['seconds']:.1f} s; cached in {folder}")
    return _open(folder)


def _first_format(files: list[Path], flag: str) -> str:
    for where, record in read_records(files, flag):
        if isinstance(record, BadRecord):
            raise record
        return detect_format(record, where, flag=flag)
    raise UsageError(f"{flag}: {files[0]} holds no records")


def _chunks(items, size: int):
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _open(folder: Path) -> TokenizedExamples | None:
    """The cache in `folder`, checked for consistency; None when it is not whole (tokenized again then)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        n, tokens = int(meta["examples"]), int(meta["tokens"])
        offsets = np.fromfile(folder / "offsets.bin", dtype="<i8")
        if meta.get("version") != CACHE_VERSION or len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != tokens \
                or np.any(np.diff(offsets) <= 0):
            return None
        if (folder / "ids.bin").stat().st_size != 4 * tokens or (folder / "mask.bin").stat().st_size != tokens:
            return None
        ids = np.memmap(folder / "ids.bin", dtype="<i4", mode="r", shape=(tokens,))
        mask = np.memmap(folder / "mask.bin", dtype=np.uint8, mode="r", shape=(tokens,))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return TokenizedExamples(ids, mask, offsets, meta, folder)
