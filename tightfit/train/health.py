"""Whether a checkpoint is worth resuming from: the loss around it, judged against the run's own healthy level.

Why: "the last checkpoint with no NaN in it" is not "the last good one". A learning rate too high makes the loss
climb to hundreds for several steps before anything becomes non-finite; a checkpoint taken inside that spike
diverges again as soon as it is resumed, and with `--keep-checkpoints 1` it would have replaced the last one
worth having. So every checkpoint carries a verdict, and retention and the divergence message go by it.

[Note: spike] The run's *reference* is the lowest its smoothed loss has been (an exponential average with weight
`EMA_WEIGHT` on the newest finite, non-spiking step; restored on resume from the checkpoint's record). A step
spikes when its loss is non-finite or above `max(SPIKE_RATIO * reference, reference + SPIKE_NATS)`: 1.5x and at
least one nat, loose enough for the batch-to-batch noise of a small fine-tuning batch, tight enough that a jump
from 5.6 to 9 nats per token counts. A non-finite gradient norm spikes too.

[Note: verdict] A checkpoint at step S holds the weights after update S; the first loss measured on them is step
S+1's. So its verdict is known one step after it is taken: *suspect* when step S or S+1 spiked, *healthy*
otherwise. The verdict is written into the checkpoint's `health.json` (atomically: a temporary name, then a
rename) once step S+1 is seen; until then (or for the run's final checkpoint) the record written with the
checkpoint says whether step S spiked. A checkpoint without `health.json` (an older tightfit) has no verdict:
it is kept and named like any other, but never protected.

Retention (checkpoint_writer.prune) keeps the newest `--keep-checkpoints` and, beyond them, the newest healthy
one; the divergence message names the newest healthy checkpoint, the step the loss first spiked at, the learning
rate in force, and the flags that resume from it at a lower learning rate (`suggested_lr`).
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from tightfit.utils import untrusted_json

HEALTH = "health.json"
EMA_WEIGHT = 0.1
SPIKE_RATIO = 1.5
SPIKE_NATS = 1.0
HEALTHY, SUSPECT, UNKNOWN = "healthy", "suspect", "unknown"
QUIET_STEPS = 20
"""Healthy steps after a spike before another spike is announced again (an unstable run would warn every step)."""


def spike_threshold(reference: float) -> float:
    """The loss above which a step spikes ([Note: spike])."""
    return max(SPIKE_RATIO * reference, reference + SPIKE_NATS)


def suggested_lr(lr: float, default: float) -> float:
    """The learning rate a diverged run's message proposes: a tenth of the one in force, and never above the
    trainer's default (a run that diverged at ten times the default should not be told to try the same again)."""
    value = min(lr / 10.0, default)
    return float(f"{value:.1g}")


@dataclass
class Spike:
    step: int
    loss: float
    reference: float
    lr: float


class RunHealth:
    """The loss and gradient-norm history a run's checkpoints are judged by; see the module docstring."""

    def __init__(self, reference: float | None = None, ema: float | None = None) -> None:
        self.reference = reference
        self.ema = ema if ema is not None else reference
        self.spike: Spike | None = None  # the current spike's first step, while it lasts
        self.first_spike: Spike | None = None  # the run's first spike (what the divergence message names)
        self._seen: dict[int, tuple[bool, float, float]] = {}  # step -> (spiked, loss, lr), the last few steps
        self._interval: list[tuple[float, float | None]] = []  # (loss, grad norm) since the last checkpoint
        self._calm = 0  # steps since the last spike ended: a new warning needs QUIET_STEPS of them

    @classmethod
    def resumed(cls, record: dict | None) -> "RunHealth":
        """The history a checkpoint's record carries forward (none for a checkpoint without one)."""
        if not record:
            return cls()
        return cls(record.get("reference_loss"), record.get("smoothed_loss"))

    def observe(self, step: int, loss: float, grad_norm: float | None, lr: float) -> str | None:
        """Record step `step`; returns a one-line notice when a spike starts ([Note: spike])."""
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        spiked = not finite or (self.reference is not None and loss > spike_threshold(self.reference))
        self._seen[step] = (spiked, loss, lr)
        for old in [s for s in self._seen if s < step - 4]:
            del self._seen[old]
        self._interval.append((loss, grad_norm))
        notice = None
        if spiked:
            if self.spike is None:
                self.spike = Spike(step, loss, self.reference if self.reference is not None else loss, lr)
                warn = self.first_spike is None or self._calm >= QUIET_STEPS
                if self.first_spike is None:
                    self.first_spike = self.spike
                if finite and warn:
                    notice = (f"warning: the loss spiked at step {step}: {loss:.4g} against a healthy "
                              f"{self.spike.reference:.4g} (learning rate {lr:.3g}); checkpoints taken while it "
                              "lasts are marked suspect and the last healthy one is kept")
            self._calm = 0
        else:
            self.spike = None
            self._calm += 1
            self.ema = loss if self.ema is None else self.ema + EMA_WEIGHT * (loss - self.ema)
            self.reference = self.ema if self.reference is None else min(self.reference, self.ema)
        return notice

    def record(self, step: int) -> dict:
        """The health written with the checkpoint of `step`: the interval since the previous one, the run's
        reference, and whether `step` itself spiked. Starts a new interval."""
        losses = [loss for loss, _ in self._interval if math.isfinite(loss)]
        norms = [g for _, g in self._interval if g is not None and math.isfinite(g)]
        spiked, _, lr = self._seen.get(step, (False, None, None))
        rec = {"step": step, "verdict": SUSPECT if spiked else UNKNOWN,
               "loss": self._interval[-1][0] if self._interval else None,
               "loss_mean": sum(losses) / len(losses) if losses else None, "loss_max": max(losses, default=None),
               "grad_norm_max": max(norms, default=None), "steps": len(self._interval),
               "lr": lr, "reference_loss": self.reference, "smoothed_loss": self.ema,
               "next_loss": None}
        self._interval = []
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}

    def verdict(self, step: int, final: bool = False) -> tuple[str, float] | None:
        """(HEALTHY or SUSPECT, the loss of step+1) for the checkpoint of `step` once step+1 is seen; None before
        ([Note: verdict]). `final`: the run ends at `step`, nothing more will be seen: judged by step `step`."""
        if step + 1 not in self._seen:
            if final and step in self._seen:
                return (SUSPECT if self._seen[step][0] else HEALTHY), float("nan")
            return None
        after, loss, _ = self._seen[step + 1]
        before = self._seen.get(step, (False,))[0]
        return (SUSPECT if after or before else HEALTHY), loss


# ---- on disk --------------------------------------------------------------------------------------------------

def write_record(folder: Path, record: dict) -> None:
    """Write `folder/health.json` atomically (a temporary name, fsync, rename): old or new, never half; a write that
    fails (a full disk) leaves the old record and no temporary file."""
    tmp = folder / f".{HEALTH}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, separators=(",", ":"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / HEALTH)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_record(folder: Path) -> dict | None:
    """The checkpoint's health record, or None when it has none or it is not a well-formed one (a crafted or
    damaged record only loses the protection and the advice; it changes nothing in training)."""
    try:  # a regular file only: not through a symlink, never blocking on a FIFO
        fd = os.open(folder / HEALTH, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return None
            rec = untrusted_json.loads(f.read(1 << 16).decode())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or rec.get("verdict") not in (HEALTHY, SUSPECT, UNKNOWN):
        return None
    for key in ("loss", "loss_mean", "loss_max", "grad_norm_max", "lr", "reference_loss", "smoothed_loss",
                "next_loss"):
        v = rec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            return None
    return rec


def set_verdict(folder: Path, verdict: str, next_loss: float) -> None:
    """Add the verdict to a committed checkpoint's record ([Note: verdict]); a folder without one gets none."""
    rec = read_record(folder)
    if rec is None:
        return
    rec["verdict"] = verdict
    rec["next_loss"] = next_loss if math.isfinite(next_loss) else None
    try:
        write_record(folder, rec)
    except OSError as e:  # the checkpoint's own write says the same (checkpoint_writer.py, `_disk_error`)
        from tightfit.errors import UsageError

        raise UsageError(f"--out-dir: cannot write the health verdict of the checkpoint in {folder} "
                         f"({e.strerror or e}); the checkpoint is untouched; free space and resume with "
                         "--resume") from None


def verdict_of(folder: Path) -> str:
    rec = read_record(folder)
    return rec["verdict"] if rec else UNKNOWN
