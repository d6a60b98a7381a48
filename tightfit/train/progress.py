"""Progress of a long job: step, loss, tokens/s, memory per tier, ETA — printed, and logged as JSON lines.

Why separate from the loop: the loop decides *when* to report; this file decides *what* a person sees and what
goes to metrics.jsonl, so both stay short. Memory per tier comes from a callable the trainer supplies (the
offload engine knows its tiers; a plain run reports the device and the process RSS).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Callable

from tightfit.utils.sizes import format_size


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class Progress:
    """Prints one line per report and appends every record to `metrics.jsonl`."""

    def __init__(self, total_steps: int, start_step: int, tokens_per_step: int, metrics_path: Path | None,
                 memory: Callable[[], dict[str, int]], enabled: bool = True, stream=None) -> None:
        self.total = total_steps
        self.start_step = start_step
        self.tokens_per_step = tokens_per_step
        self.memory = memory
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.metrics_path = metrics_path
        self.t0 = time.perf_counter()
        self._last_t = self.t0
        self._last_step = start_step

    def log(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        if self.enabled and self.metrics_path is not None:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def say(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None) -> None:
        """Report after optimizer step `step` (1-based count of steps done)."""
        now = time.perf_counter()
        dt = max(now - self._last_t, 1e-9)
        tok_s = (step - self._last_step) * self.tokens_per_step / dt
        elapsed = now - self.t0
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done else 0.0
        mem = self.memory()
        self._last_t, self._last_step = now, step
        mem_text = " ".join(f"{tier} {format_size(b)}" for tier, b in mem.items())
        width = len(str(self.total))
        self.say(f"step {step:>{width}}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} tok/s | "
                 f"mem {mem_text} | ETA {format_duration(eta)}")
        self.log({"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tok_s, "memory": mem, "elapsed_s": elapsed})

    def eval(self, step: int, val_loss: float) -> None:
        self.say(f"eval step {step}: val loss {val_loss:.4f} nats/token")
        self.log({"kind": "eval", "step": step, "val_loss": val_loss})
