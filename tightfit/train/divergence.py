"""What to tell a user whose run diverged: what became non-finite, which checkpoint to continue from and with
which flags, other likely causes.

Why its own file: three places find a divergence - the loss after a step, the gradient norm before the optimizer
uses it, and a tensor of a checkpoint being written (checkpoint_writer.py: nothing non-finite is saved) - and all
three must say the same things. The advice is the one change that lets a diverged run train on whatever the cause:
continue from a checkpoint taken before the loss spiked (health.py), at a tenth of the learning rate in force. The
other causes are listed, not guessed: a NaN also follows from an extreme weight decay, a bad batch or fp16
overflow, and blaming one flag would send some users after the wrong one.
"""

from __future__ import annotations

from pathlib import Path

from tightfit.errors import UsageError
from tightfit.train.checkpoint_writer import committed
from tightfit.train.health import HEALTHY, Spike, read_record, suggested_lr

CAUSES = ("a learning rate too high for this model and batch (--lr, --min-lr, --warmup-steps)",
          "gradient spikes (--grad-clip)", "an extreme --weight-decay, --beta1 or --beta2",
          "fp16 overflow (--precision bf16)", "bad data (--data)")


def describe_key(key: str) -> str:
    """A checkpoint tensor key in words: "parameter blocks.0.attn.weight", "the Adam first moment of ..."."""
    if key.startswith("model."):
        return f"parameter {key[6:]}"
    for suffix, what in ((".exp_avg_sq", "the Adam second moment of"), (".exp_avg", "the Adam first moment of"),
                         (".step", "the Adam step count of")):
        if key.startswith("optim.") and key.endswith(suffix):
            return f"{what} {key[6:-len(suffix)]}"
    return f"checkpoint tensor {key}"


def resume_candidate(root: Path) -> tuple[int, Path] | None:
    """The checkpoint a diverged run should continue from: the newest healthy one in `root` (health.py), or the
    newest with no health record at all (written by an older tightfit: nothing says it is bad)."""
    for step, folder in reversed(committed(root)):
        record = read_record(folder)
        if record is None or record["verdict"] == HEALTHY:
            return step, folder
    return None


def advice_flags(optim, lr: float) -> str:
    """The flags a diverged run continues with: a tenth of the learning rate in force (`suggested_lr`), and the
    defaults back for a setting far outside what trains (clipping off, a weight decay of 10x the default or more:
    at a lower learning rate it would still flip the weights' sign each step)."""
    default = type(optim)()
    new_lr = suggested_lr(lr, default.lr)
    flags = [f"--lr {new_lr:g}"]
    if optim.min_lr > new_lr:
        flags.append(f"--min-lr {new_lr / 10:g}")
    if optim.weight_decay >= 10 * default.weight_decay:
        flags.append(f"--weight-decay {default.weight_decay:g}")
    if optim.grad_clip == 0 and default.grad_clip > 0:
        flags.append(f"--grad-clip {default.grad_clip:g}")
    return " ".join(flags)


def diverged(step: int, what: str, *, root: Path, lr: float, spike: Spike | None, optim) -> UsageError:
    """The one-line error: `what` became non-finite at `step` (e.g. "the loss became nan"), with the checkpoint
    to continue from (`resume_candidate` in `root`) and the flags that do it (`advice_flags`; `optim`: the run's
    OptimConfig, `lr`: the learning rate in force)."""
    flags = advice_flags(optim, lr)
    context = f"learning rate in force {lr:.3g}"
    if spike is not None and spike.step < step:
        context += (f"; the loss first spiked at step {spike.step}: {spike.loss:.4g} against a healthy "
                    f"{spike.reference:.4g}")
    good = resume_candidate(root)
    if good is None:
        advice = (f"no checkpoint from before the trouble was kept (nothing non-finite is ever saved, and checkpoints "
                  f"taken inside a loss spike are not healthy): start over in a new --out-dir with {flags}")
    else:
        advice = (f"the newest healthy checkpoint is step {good[0]} in {good[1]}: continue from it with "
                  f"--resume --resume-step {good[0]} {flags}")
    return UsageError(f"training diverged at step {step}: {what} ({context}); {advice}. Other likely causes: "
                      f"{'; '.join(CAUSES[1:])}")
