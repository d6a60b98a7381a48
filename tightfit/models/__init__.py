"""Models tightfit ships: the reference GPT (plain torch.nn)."""

from tightfit.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
