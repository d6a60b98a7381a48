"""Whole examples packed into rows of at most --seq-len tokens: best-fit decreasing.

Why best-fit decreasing: it is what TRL's SFTTrainer packs with by default (`packing_strategy="bfd"`), and it
wastes little: examples are taken longest first, each into the open row whose free room is the smallest that holds
it (the oldest such row where several have that room), else into a new row. No example is cut to fill a row; one
longer than a row is cut to the row's length first (`truncate`) or refused. Examples are packed a window of
`WINDOW` at a time, in their order, as TRL packs them (a `datasets.map` batch each): the same examples give the
same rows as TRL's, in the same order (tests/test_sft_vs_trl.py compares them), and packing a corpus of millions
of examples holds one window's bookkeeping at a time.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque

import numpy as np


WINDOW = 1000
"""Examples packed together (`datasets.map`'s default batch, in which TRL packs)."""


def pack_best_fit(lengths: np.ndarray, capacity: int, window: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """Rows of examples: (members, starts), row r holding examples members[starts[r]:starts[r + 1]], in the order
    they were put in. `lengths`: each example's tokens, each in 1..capacity. Each `window` examples are packed on
    their own."""
    members, counts = [], []
    for at in range(0, len(lengths), window):
        m, s = _pack_window(lengths[at:at + window], capacity)
        members.append(m + at)
        counts.append(np.diff(s))
    counts_all = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
    starts = np.zeros(len(counts_all) + 1, dtype=np.int64)
    np.cumsum(counts_all, out=starts[1:])
    return (np.concatenate(members) if members else np.zeros(0, dtype=np.int64)), starts


def _pack_window(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-lengths, kind="stable")  # longest first; equal lengths in their given order
    free: list[int] = []  # the free rooms of open rows, sorted, each once
    by_room: dict[int, deque] = defaultdict(deque)  # room -> the open rows with it, oldest first
    rows: list[list[int]] = []
    used: list[int] = []
    for idx in order.tolist():
        n = int(lengths[idx])
        at = bisect.bisect_left(free, n)
        if at < len(free):
            room = free[at]
            row = by_room[room].popleft()
            if not by_room[room]:
                free.pop(at)
        else:
            room, row = capacity, len(rows)
            rows.append([])
            used.append(0)
        rows[row].append(idx)
        used[row] += n
        left = room - n
        if left > 0:
            if not by_room[left]:
                bisect.insort(free, left)
            by_room[left].append(row)
    members = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=sum(len(r) for r in rows))
    starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=starts[1:])
    return members, starts


def one_per_row(count: int) -> tuple[np.ndarray, np.ndarray]:
    """No packing: each example its own row."""
    return np.arange(count, dtype=np.int64), np.arange(count + 1, dtype=np.int64)
