"""A corpus encoded by a tokenizer piece by piece, to the ids one call over the whole text gives.

Why: one `tokenizer.encode(text)` over the whole corpus holds the text, the tokenizer's own encoding of it (ids,
offsets, masks) and a Python list of the ids, about 40 bytes a token beside the 4 the corpus keeps: a few GB of text
took tens of GB before the plan was even made. Encoded in pieces of about PIECE_CHARS characters, a load holds a
batch of pieces' text and encodings at a time, and the ids as int32 arrays. The pieces of a batch go to the
tokenizer in one call, which a fast tokenizer spreads over the machine's cores.

Why the ids are the same ([Note: clean cuts]): a piece is cut at a line start whose first character is not
whitespace, and it is encoded with CONTEXT_CHARS of the text on each side (whole lines). A cut is kept only where
both encodings that see it, the piece's before it and the piece's after it, have a token starting at the cut and
none running across it; there the tokenizer decided the cut is a token boundary with the same text around it as in
the whole corpus, and each side keeps its own ids. A cut that is not clean (merges across line ends, as in
Llama 2's no-split Metaspace tokenizer) joins its two pieces. A tokenizer that gives no offsets (a slow, pure-Python
one) encodes the whole text in one call, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import pairwise

import numpy as np

PIECE_CHARS = 1 << 18
"""Characters a piece holds at least (it ends at the next clean cut)."""
CONTEXT_CHARS = 256
"""Characters of text, whole lines, a piece is encoded with on each side."""
BATCH_PIECES = 8
"""Pieces handed to the tokenizer in one call (a fast tokenizer encodes a batch on all cores)."""

EncodeWithOffsets = Callable[[Sequence[str]], list[tuple[list[int], list[tuple[int, int]]]]]
"""Texts -> for each, its ids and each id's (start, end) character span in that text."""


def encode_corpus(chunks: Iterable[str], tokenizer) -> np.ndarray:
    """The ids of the text `chunks` make when joined, as int32: in pieces where `tokenizer.gives_offsets` (through
    its `encode_with_offsets`), else by `tokenizer.encode` over the whole text."""
    if not getattr(tokenizer, "gives_offsets", False):
        return np.asarray(tokenizer.encode("".join(chunks)), dtype=np.int32)
    encode = tokenizer.encode_with_offsets
    out: list[np.ndarray] = []
    buf, left = "", 0  # buf[:left]: context already encoded; buf[left:]: text to encode
    rejected: set[int] = set()
    for chunk in chunks:
        buf += chunk
        while len(buf) - left >= (BATCH_PIECES + 1) * PIECE_CHARS:
            size = len(buf) - left
            buf, left, rejected = _encode_batch(buf, left, encode, out, rejected, final=False)
            if len(buf) - left == size:
                break  # no clean cut yet: wait for more text
    _encode_batch(buf, left, encode, out, rejected, final=True)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


def _line_start_before(buf: str, pos: int) -> int:
    """The start of the line holding `pos - CONTEXT_CHARS` (0 at the buffer's start)."""
    return buf.rfind("\n", 0, max(0, pos - CONTEXT_CHARS)) + 1


def _line_end_after(buf: str, pos: int) -> int | None:
    """The end of the line holding `pos + CONTEXT_CHARS`; None where the buffer holds no end for it yet."""
    at = buf.find("\n", min(len(buf), pos + CONTEXT_CHARS))
    return None if at < 0 else at + 1


def _cuts(buf: str, left: int, rejected: set[int], final: bool) -> list[int]:
    """Candidate cuts after `left`, PIECE_CHARS apart at least: line starts whose first character is not whitespace,
    with (unless `final`) the context after them already in `buf`."""
    cuts, at = [], left + PIECE_CHARS
    while len(cuts) < BATCH_PIECES:
        nl = buf.find("\n", at - 1)
        if nl < 0 or nl + 1 >= len(buf):
            break
        c = nl + 1
        if buf[c].isspace() or c in rejected:
            at = c + 1
            continue
        if not final and _line_end_after(buf, c) is None:
            break
        cuts.append(c)
        at = c + PIECE_CHARS
    return cuts


def _split_index(starts: np.ndarray, ends: np.ndarray, pos: int) -> int | None:
    """The index of the first token starting at or after `pos`; None where a token before it runs past `pos` (the
    cut is inside a token)."""
    k = int(np.searchsorted(starts, pos, side="left"))
    if k and int(ends[:k].max()) > pos:
        return None
    return k


def _encode_batch(buf: str, left: int, encode: EncodeWithOffsets, out: list[np.ndarray], rejected: set[int],
                  final: bool) -> tuple[str, int, set[int]]:
    """Encode the pieces of `buf[left:]` between clean cuts ([Note: clean cuts] in the module docstring): all of it
    when `final`, else up to the last clean cut. Returns the buffer that is left, its context's length and the
    rejected cuts still in it.

    `left` was found clean by the piece before it; the last cut of a batch that is not final is checked by the
    piece before it only (the piece after it is encoded in the next batch). Both encodings see the same whole
    lines around a cut, so they agree; where they do not (the tokenizer's choice at a cut depends on text more than
    CONTEXT_CHARS away), the piece after it starts at its first token at or after the cut."""
    end = len(buf) if final else None
    bounds = [left, *_cuts(buf, left, rejected, final)]
    if final:
        bounds.append(len(buf))
    splits: dict[tuple[int, int], tuple[int | None, int | None, np.ndarray]] = {}
    while len(bounds) >= 2:
        pieces = [(a, b) for a, b in pairwise(bounds) if (a, b) not in splits]
        spans = [(_line_start_before(buf, a), len(buf) if b == end else _line_end_after(buf, b)) for a, b in pieces]
        encoded = encode([buf[lo:hi] for lo, hi in spans]) if pieces else []
        for (a, b), (lo, _), (ids, offsets) in zip(pieces, spans, encoded):
            off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
            ids_a = np.asarray(ids, dtype=np.int32)
            i = _split_index(off[:, 0], off[:, 1], a - lo)
            if i is None and a == left:  # already cut by the batch before ([Note] above)
                i = int(np.searchsorted(off[:, 0], a - lo, side="left"))
            j = len(ids_a) if b == end else _split_index(off[:, 0], off[:, 1], b - lo)
            splits[(a, b)] = (i, j, ids_a)
        inner = bounds[1:-1] if final else bounds[1:]
        bad = {c for k, c in enumerate(inner, 1) if splits[(bounds[k - 1], c)][1] is None
               or (k + 1 < len(bounds) and splits[(c, bounds[k + 1])][0] is None)}
        if not bad:
            break
        rejected |= bad
        bounds = [b for b in bounds if b not in bad]
    if len(bounds) < 2:
        return buf, left, rejected
    for a, b in pairwise(bounds):
        i, j, ids_a = splits[(a, b)]
        out.append(ids_a[i:j])
    if final:
        return "", 0, set()
    last = bounds[-1]
    keep = _line_start_before(buf, last)
    return buf[keep:], last - keep, {c - keep for c in rejected if c > last}
