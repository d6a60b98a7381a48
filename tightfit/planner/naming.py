"""How the planner's messages name a setting: the CLI's flags, or the keyword arguments of `tightfit.plan`/`wrap`.

Why: one planner serves `tightfit plan --gpu-mem 8GiB` and `tightfit.plan(model, gpu_mem="8GiB")`. Its messages
("needs 18.4 MiB device memory ...: use --micro-batch 5 --grad-accum 2, or --gpu-mem 18.4 MiB") must speak the
caller's language, so each message is written once, with the setting's key (the config field name: "gpu_mem"), and
the caller passes the `Naming` that turns keys into what the user typed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Naming:
    """Turns a setting's key ("micro_batch") into the words the user typed."""

    python: bool = False
    """True: keyword arguments (`micro_batch=5`); False: CLI flags (`--micro-batch 5`)."""

    def of(self, key: str) -> str:
        """The setting itself: "--micro-batch" or "micro_batch"."""
        return key if self.python else "--" + key.replace("_", "-")

    def set(self, key: str, value) -> str:
        """The setting given a value: "--micro-batch 5" / "micro_batch=5", "--gpu-mem 8.0 GiB" / 'gpu_mem="8.0 GiB"'."""
        if self.python:
            return f"{key}={value!r}" if not isinstance(value, str) else f'{key}="{value}"'
        return f"{self.of(key)} {value}"

    def join(self, *settings: str) -> str:
        """Several settings given together: "--micro-batch 5 --grad-accum 2" / "micro_batch=5, grad_accum=2"."""
        return (", " if self.python else " ").join(settings)


CLI = Naming(python=False)
PYTHON = Naming(python=True)
