"""What to tell a user whose run diverged: what became non-finite, where the last good checkpoint is, likely causes.

Why its own file: three places find a divergence - the loss after a step, the gradient norm before the optimizer
uses it, and a tensor of a checkpoint being written (checkpoint_writer.py: nothing non-finite is saved) - and all
three must say the same things. The causes are listed, not guessed: a NaN loss follows from too high a learning
rate as often as from an extreme weight decay, a bad batch or fp16 overflow, and blaming one flag sends users
after the wrong one.
"""

from __future__ import annotations

from pathlib import Path

from tightfit.errors import UsageError

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


def diverged(step: int, what: str, last_good: tuple[int, Path] | None) -> UsageError:
    """The one-line error: `what` became non-finite at `step` (e.g. "the loss became nan")."""
    if last_good is None:
        kept = "no checkpoint was saved before it"
    else:
        kept = (f"the last good checkpoint is step {last_good[0]} in {last_good[1]} (nothing non-finite is saved); "
                "fix the cause and continue from it with --resume")
    return UsageError(f"training diverged at step {step}: {what}; {kept}. Likely causes: {'; '.join(CAUSES)}")
