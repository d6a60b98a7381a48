"""Fine-tuning examples as the loop draws them: rows of --seq-len tokens, a step's rows in a fixed order.

Why this shape:
- Rows. With packing (the default for records) each row holds whole examples, best fit decreasing (packing.py),
  with positions restarting at each example so that attention stays inside it (tightfit/train/batch.py); without,
  each row is one example and a micro-batch is padded to its longest row only. A row's targets are each token's
  next token within its example where that token carries loss, else IGNORE: the first token of an example is
  never a target of the one before it.
- Order. Rows are taken epoch by epoch, each epoch a permutation of the training rows drawn from the run's seed and
  the epoch's number; a step takes the next `--micro-batch x --grad-accum x data ranks` rows. So the rows a step
  trains on are a function of the step alone: `--resume` continues at the same example, on any number of ranks.
- The loss of a step is normalised by its answer tokens, all micro-batches and ranks together (`Batch.per_token`),
  and the step's count is what the progress line's tokens/s counts.
- Held out: `--val-data`, else every k-th example by record (k = 1 / --val-fraction), packed the same way; an
  evaluation runs the first `--eval-batches` batches of it, the same every time, and reports the mean over their
  answer tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from tightfit.errors import UsageError
from tightfit.finetune.packing import one_per_row, pack_best_fit
from tightfit.finetune.token_cache import TokenizedExamples
from tightfit.train.batch import IGNORE, Batch


class Rows:
    """Some examples of a TokenizedExamples, cut to `seq_len` tokens and put into rows."""

    def __init__(self, data: TokenizedExamples, chosen: np.ndarray, seq_len: int, packing: bool) -> None:
        self.data, self.seq_len, self.packing = data, seq_len, packing
        lengths = np.minimum(data.lengths()[chosen], seq_len)
        if not packing:  # an example whose answer was cut off carries no loss: left out (as TRL does)
            keep = np.array([self._carries_loss(int(e), int(n)) for e, n in zip(chosen, lengths)], dtype=bool)
            self.dropped = int((~keep).sum())
            chosen, lengths = chosen[keep], lengths[keep]
        else:
            self.dropped = 0
        self.examples, self.lengths = chosen, lengths
        members, self.starts = pack_best_fit(lengths, seq_len) if packing else one_per_row(len(chosen))
        self.members = members
        self.tokens = int(lengths.sum())

    def _carries_loss(self, e: int, n: int) -> bool:
        start = int(self.data.offsets[e])
        return bool(self.data.mask[start + 1:start + n].any())

    def __len__(self) -> int:
        return len(self.starts) - 1

    def row(self, r: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Row `r`: (inputs, targets, positions) of `seq_len` tokens each, and the tokens it uses."""
        T = self.seq_len
        inputs = np.full(T, pad_id, dtype=np.int64)
        targets = np.full(T, IGNORE, dtype=np.int64)
        positions = np.empty(T, dtype=np.int64)
        at = 0
        for k in range(self.starts[r], self.starts[r + 1]):
            e, n = int(self.examples[self.members[k]]), int(self.lengths[self.members[k]])
            start = int(self.data.offsets[e])
            ids = np.asarray(self.data.ids[start:start + n], dtype=np.int64)
            mask = np.asarray(self.data.mask[start:start + n], dtype=bool)
            inputs[at:at + n] = ids
            targets[at:at + n - 1] = np.where(mask[1:], ids[1:], IGNORE)
            positions[at:at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(T - at)  # padding: an example of its own, carrying no loss
        return inputs, targets, positions, at

    def batch(self, rows: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        got = [self.row(r, pad_id) for r in rows]
        inputs = torch.from_numpy(np.stack([g[0] for g in got]))
        targets = torch.from_numpy(np.stack([g[1] for g in got]))
        if self.packing:
            return inputs, targets, torch.from_numpy(np.stack([g[2] for g in got]))
        used = max(g[3] for g in got)  # one example a row: padded to the longest, positions from 0
        return inputs[:, :used].contiguous(), targets[:, :used].contiguous(), None


class ExampleDataset:
    """Training and held-out rows, and the batches of each step (`step_batches`, as TokenDataset answers it)."""

    answers_only = True
    """Only answer tokens carry loss: the loss and tokens/s count them (`last_step_tokens`)."""

    def __init__(self, train: Rows, val: Rows, seed: int, pad_id: int, vocab_size: int, describe: str,
                 isolation: str | None = None) -> None:
        if not len(train):
            raise UsageError("--data: no training example left after the held-out ones were taken; give more records")
        self.train, self.val, self.seed, self.pad_id, self.vocab_size = train, val, seed, pad_id, vocab_size
        self.seq_len = train.seq_len
        self._describe = describe
        self.isolation = isolation or "restarting positions"
        self._perm: tuple[int, torch.Tensor] | None = None
        self.last_step_tokens = 0
        """The answer tokens of the step `step_batches` drew last, every rank's together."""

    def describe(self) -> str:
        t, v = self.train, self.val
        packed = (f"packed into {len(t):,} rows of {t.seq_len} tokens ({t.tokens / max(1, len(t) * t.seq_len):.0%} "
                  f"full; attention within each example: {self.isolation})") if t.packing else \
            f"{len(t):,} rows, one example each, padded to the longest in a micro-batch"
        dropped = f"; {t.dropped + v.dropped:,} examples left out, their answers cut off by --seq-len" \
            if t.dropped + v.dropped else ""
        return (f"data: {self._describe}; {len(t.examples):,} train / {len(v.examples):,} held-out examples, "
                f"{packed}{dropped}")

    def _row_of(self, r: int) -> int:
        epoch, i = divmod(r, len(self.train))
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.train), generator=g))
        return int(self._perm[1][i])

    def step_batches(self, size: int, count: int, generator: torch.Generator, share: int = 0, shares: int = 1,
                     step: int = 0) -> list[Batch]:
        """Step `step`'s batches for data share `share` of `shares`: the step's rows are `shares x count` batches of
        `size` rows, the next in the epochs' order (a function of `step`: `generator` is the text corpus's
        position, not used here), and this share is `count` consecutive ones. `per_token` normalises each by the
        answer tokens of all of them."""
        per_step = size * count * shares
        rows = [self._row_of(step * per_step + i) for i in range(per_step)]
        total, mine = 0, []
        for i in range(shares * count):
            batch = Batch(*self.train.batch(rows[i * size:(i + 1) * size], self.pad_id))
            total += batch.loss_tokens
            if i // count == share:
                mine.append(batch)
        self.last_step_tokens = total
        for b in mine:
            b.per_token = shares / total if total else 0.0
        return mine

    def val_batches(self, n_batches: int, batch_size: int, seed: int = 0) -> list[Batch]:
        """The first `n_batches` batches of held-out rows (fewer where there are fewer rows): the mean of their
        losses is the mean over all their answer tokens."""
        rows = list(range(min(len(self.val), n_batches * batch_size)))
        out = [Batch(*self.val.batch(rows[i:i + batch_size], self.pad_id)) for i in range(0, len(rows), batch_size)]
        total = sum(b.loss_tokens for b in out)
        for b in out:
            b.per_token = len(out) / total if total else 0.0
        return out


def load_examples(cfg, tokenizer, say, isolation: str | None = None) -> ExampleDataset:
    """The records `--data` (and `--val-data`) name, tokenized (or read from the token cache in --out-dir/tokens),
    split and put into rows. `isolation`: how the model keeps packed examples apart (packed_attention.py)."""
    from pathlib import Path

    from tightfit.finetune.records import held_out_split, record_files
    from tightfit.finetune.token_cache import tokenize_records

    d, t = cfg.data, cfg.train
    root = Path(t.out_dir) / "tokens"
    common = dict(forced_format=d.data_format, train_on_prompt=d.train_on_prompt, chat_template=d.chat_template,
                  skip_bad=d.skip_bad_records, say=say)
    train = tokenize_records(record_files(d.data), root, tokenizer, **common)
    val_path, flag = (d.val_data, "--val-data") if d.val_data else (held_out_split(d.data), "--data")
    if val_path is not None:
        val = tokenize_records(record_files(val_path, flag), root, tokenizer, flag=flag, **common)
        train_idx, val_idx = np.arange(len(train)), np.arange(len(val))
    else:
        val = train
        every = max(2, round(1 / d.val_fraction))  # every `every`-th example is held out
        idx = np.arange(len(train))
        train_idx, val_idx = idx[idx % every != every - 1], idx[idx % every == every - 1]
        if not len(val_idx):
            raise UsageError(f"--val-fraction: {len(train)} examples hold none out at {d.val_fraction}; give "
                             "--val-data, or more records")
    for data, idx, name in ((train, train_idx, flag if val is train else "--data"), (val, val_idx, flag)):
        longer = idx[data.lengths()[idx] > t.seq_len]
        if len(longer) and not d.truncate:
            e = int(longer[0])
            raise UsageError(f"--no-truncate: example {e + 1} of {name} has {int(data.lengths()[e]):,} tokens, more "
                             f"than --seq-len {t.seq_len}; raise --seq-len, or drop --no-truncate to cut such "
                             "examples to it")
        if len(longer):
            say(f"{name}: {len(longer):,} of {len(idx):,} examples are longer than --seq-len {t.seq_len} and are cut "
                "to it (--no-truncate refuses them)")
    skipped = sum(train.meta["skipped"].values()) + (sum(val.meta["skipped"].values()) if val is not train else 0)
    if skipped:
        first = next(iter(train.meta["first_skipped"].items()), None)
        say(f"--skip-bad-records: {skipped:,} bad records skipped "
            f"({', '.join(f'{n} {why}' for why, n in train.meta['skipped'].items())}"
            + (f"; the first: {first[1]}" if first else "") + ")")
    hf = getattr(tokenizer, "_tok", None)
    pad = None if hf is None else (hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id)
    return ExampleDataset(Rows(train, train_idx, t.seq_len, d.packing), Rows(val, val_idx, t.seq_len, d.packing),
                          seed=t.seed, pad_id=pad or 0, vocab_size=tokenizer.vocab_size,
                          describe=train.meta["rendering"], isolation=isolation)
