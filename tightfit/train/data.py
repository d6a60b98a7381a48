"""Text corpora as token streams, with a deterministic train/validation split and resumable batch sampling.

Why this shape:
- The embedded default needs no download: the Python standard library's own source files are on every machine
  that runs tightfit (located with `sysconfig`), read in sorted order so every run sees the same corpus.
- Tokens are bytes (vocab 256) unless a local Hugging Face tokenizer is given.
- The split is by interleaved blocks: the stream is cut into equal blocks and every k-th block (k = 1/val_fraction)
  is held out. A split at the end of the stream would hold out only the last few files (for the stdlib: the
  xml, xmlrpc and zoneinfo packages) and measure how well those are predicted; interleaved blocks sample the whole
  corpus and are just as fixed. Validation uses a fixed list of batches (drawn once from a generator seeded
  independently of training), so every evaluation sees the same tokens and runs are comparable.
- Training batches are drawn at random offsets from a `torch.Generator`; its state *is* the data position, saved
  in checkpoints, so a resumed run draws exactly the batches the uninterrupted run would have drawn.
- In a distributed run each data-parallel rank draws from its own generator stream (seed + rank): the same thing
  DistributedSampler achieves — disjoint, reproducible shards of the sample stream.
"""

from __future__ import annotations

import codecs
import io
import os
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from tightfit.errors import UsageError
from tightfit.train.corpus_encoding import encode_corpus
from tightfit.train.progress import format_duration
from tightfit.utils.sizes import format_size

_TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".json", ".csv", ".tsv", ".html", ".xml", ".c", ".h", ".js", ".tex"}
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib", "lib2to3"}


def stdlib_files() -> list[Path]:
    """The standard library's .py sources (tests and site-packages excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        files.extend(Path(d) / n for n in sorted(names) if n.endswith(".py"))
    return files


def corpus_files(data: str | None) -> list[Path]:
    """Files of the corpus named by --data (a file or a folder), or the stdlib default."""
    if data is None:
        return stdlib_files()
    path = Path(data)
    if not path.exists():
        raise UsageError(f"--data: {path} does not exist; give a text file or a folder of text files")
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES)
        if not files:
            raise UsageError(f"--data: no text files ({', '.join(sorted(_TEXT_SUFFIXES))}) under {path}")
    return files


def load_tokens(data: str | None, tokenizer=None, say: Callable[[str], None] | None = None) -> np.ndarray:
    """The whole corpus as one token array (uint8 for bytes, int32 for a tokenizer's ids). Bytes are read straight
    into one buffer, the array's own: the corpus is held once, also while it loads. A tokenizer's text is read and
    encoded a piece at a time (train/corpus_encoding.py); `say` gets a progress line every PROGRESS_S while it is."""
    files = corpus_files(data)
    if tokenizer is None:
        sizes = [_read(f, lambda p: p.stat().st_size) for f in files]
        buf = bytearray(sum(sizes) + len(files) - 1)
        at = 0
        for i, (f, size) in enumerate(zip(files, sizes)):
            if i:
                buf[at] = ord("\n")
                at += 1
            got = _read(f, partial(_read_into, view=memoryview(buf)[at:at + size]))
            if got != size:
                raise UsageError(f"--data: {f} changed while it was read ({size} bytes, then {got}); run again "
                                 "once nothing writes to the corpus")
            at += size
        tokens = np.frombuffer(buf, dtype=np.uint8)
    else:
        tokens = encode_corpus(_text_chunks(files, say), tokenizer)
    return tokens


TEXT_CHUNK_BYTES = 1 << 20
"""Bytes read from a file at a time for a tokenizer."""
PROGRESS_S = 10.0
"""Seconds between two progress lines while a tokenizer encodes the corpus."""


def _text_chunks(files: list[Path], say: Callable[[str], None] | None = None, clock=time.monotonic):
    """The files' text, joined by a newline, in chunks: UTF-8 with undecodable bytes replaced and line ends made
    "\\n" (as `Path.read_text` reads it), decoded as it is read so that the bytes read are known for `say`'s line
    (what the encoder has taken is what it has encoded, less the few pieces it holds)."""
    total = sum(_read(f, lambda p: p.stat().st_size) for f in files)
    start = last = clock()
    done = 0
    for i, f in enumerate(files):
        if i:
            yield "\n"
        decode = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(errors="replace"),
                                              translate=True)
        with _read(f, lambda p: open(p, "rb")) as fh:
            while raw := _read(f, lambda _: fh.read(TEXT_CHUNK_BYTES)):
                done += len(raw)
                yield decode.decode(raw)
                now = clock()
                if say is not None and now - last >= PROGRESS_S:
                    last, rate = now, done / max(now - start, 1e-9)
                    say(f"encoding --data with the tokenizer: {format_size(done)} of {format_size(total)}, "
                        f"{format_size(rate)}/s, ETA {format_duration((total - done) / max(rate, 1e-9))}")
        if tail := decode.decode(b"", final=True):
            yield tail


def _read_into(path: Path, view: memoryview) -> int:
    """Bytes of `path` read into `view`; fewer where the file shrank, one more where it grew."""
    with open(path, "rb") as f:
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                return got
            got += n
        return got + len(f.read(1))


def _read(path: Path, read):
    """`read(path)`; an unreadable file is a one-line --data error."""
    try:
        return read(path)
    except OSError as e:
        raise UsageError(f"--data: cannot read {path} ({e.strerror or e}); fix its permissions or leave it out of "
                         "--data") from None


@dataclass
class Split:
    """One part of the corpus, the training or the held-out blocks, read in place from the whole corpus: index `j`
    is token `j % block` of this part's `j // block`-th block, as if its blocks were one stream (no copy of them)."""

    tokens: torch.Tensor  # [n_blocks, block], the corpus in its own dtype (uint8 bytes, int32 ids)
    blocks: torch.Tensor  # int64: this part's blocks, in order

    def __len__(self) -> int:
        return len(self.blocks) * self.tokens.shape[1]

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        """The tokens at `idx` (int64 positions in this part), widened to int64."""
        block = self.tokens.shape[1]
        return self.tokens[self.blocks[idx // block], idx % block].long()


@dataclass
class TokenDataset:
    """A token stream split into train and validation parts, and the batch sampler over it.

    The corpus is in RAM for the whole run, held once as loaded (1 byte a token for text, 4 for a tokenizer's ids):
    the parts index it in place, and only a batch is widened to int64 (8 bytes a token, and two copies of the
    corpus, made a 1 GB text take 17 GB while it loaded)."""

    train: Split
    val: Split
    seq_len: int
    vocab_size: int
    answers_only = False
    """Every target carries loss (a fine-tune's examples count only their answer tokens: finetune/examples.py)."""

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, seq_len: int, val_fraction: float, vocab_size: int,
                    source: str = "--data") -> "TokenDataset":
        n = len(tokens)
        every = max(2, round(1 / val_fraction))  # every `every`-th block is held out
        # Blocks of at most 64 Ki tokens, at least 4 sequences long, and at least ~10 held-out blocks when the
        # corpus allows it.
        block = min(1 << 16, max(4 * (seq_len + 1), n // (10 * every)))
        n_blocks = n // block
        if n_blocks < every:
            raise UsageError(
                f"{source}: corpus has {n} tokens, too few for --seq-len {seq_len} with --val-fraction "
                f"{val_fraction}; give more text or a shorter --seq-len"
            )
        t = torch.from_numpy(tokens[: n_blocks * block]).view(n_blocks, block)
        held_out = torch.arange(n_blocks) % every == every - 1
        return cls(train=Split(t, torch.nonzero(~held_out).flatten()), val=Split(t, torch.nonzero(held_out).flatten()),
                   seq_len=seq_len, vocab_size=vocab_size)

    def _batch(self, split: Split, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]  # [B, T+1]
        chunk = split[idx]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # inputs, next-token targets: [B, T] each

    def _starts(self, split: Split, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """`batch_size` random window offsets in `split`; advances `generator`."""
        return torch.randint(0, len(split) - self.seq_len - 1, (batch_size,), generator=generator)

    def sample(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A training batch at random offsets; advances `generator` (the resumable data position)."""
        return self._batch(self.train, self._starts(self.train, batch_size, generator))

    def step_batches(self, size: int, count: int, generator: torch.Generator, share: int = 0,
                     shares: int = 1, step: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One optimizer step's batches for data share `share` of `shares` (a data-parallel rank of a group): the
        step's global batch is `shares x count` batches of `size` sequences, drawn in order from the one generator
        (the run's data position, the same whatever the world size), and this share is `count` consecutive ones.
        So a step sees the same sequences on one process with `--grad-accum shares x count` as on `shares` ranks with
        `count` each, and a checkpoint resumes at the same sequences on any number of ranks. Only this share's
        tokens are gathered. `step` is not needed: the generator is the position (a fine-tune's examples are taken
        by step, tightfit/finetune/examples.py)."""
        out = []
        for i in range(shares * count):
            starts = self._starts(self.train, size, generator)
            if i // count == share:
                out.append(self._batch(self.train, starts))
        return out

    def val_batches(self, n_batches: int, batch_size: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A fixed held-out set: the same `n_batches` batches on every call."""
        g = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(n_batches):
            out.append(self._batch(self.val, self._starts(self.val, batch_size, g)))
        return out


def data_generator(seed: int) -> torch.Generator:
    """The training batches' generator: the run's data position, one for every rank (`TokenDataset.step_batches`)."""
    return torch.Generator().manual_seed(seed * 1000003)
