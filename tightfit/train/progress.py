"""Progress of a long job: step, loss, tokens/s, memory per tier, ETA — printed, and logged as JSON lines.

Why separate from the loop: the loop decides *when* to report; this file decides *what* a person sees and what
goes to metrics.jsonl (and to any sink, such as TensorBoard: tensorboard.py), so all stay short and agree. Memory
per tier comes from a callable the trainer supplies (the offload engine knows its tiers; a plain run reports the
device and the process RSS).

Two displays of the same figures:
- every report (`step`, once per --log-interval) prints a permanent line and writes one record;
- on a terminal (the stream is a TTY), `tick` after every step redraws one status line in place with a bar
  (`\\r`, at most `BAR_HZ` times a second, so a fast loop pays a clock read per step and nothing more). Not on a
  terminal (a log file, CI), `tick` returns at once and only the permanent lines are printed: no control
  characters in logs.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from tightfit.utils.sizes import format_size

BAR_HZ = 4.0
"""Status-line redraws per second at most (each reads the memory counters once)."""


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """Prints one line per report, appends every record to `metrics.jsonl` and hands it to each sink.

    sinks: objects with `write(record)` and `close()` (tensorboard.TensorBoardSink).
    bar: draw the in-place status line in `tick`; None: when `stream` is a terminal.
    """

    def __init__(self, total_steps: int, start_step: int, tokens_per_step: int, metrics_path: Path | None,
                 memory: Callable[[], dict[str, int]], enabled: bool = True, stream=None, sinks=(),
                 bar: bool | None = None, counted: bool = False) -> None:
        self.total = total_steps
        self.counted = counted
        """tok/s counts the tokens `count_tokens` is told of (a fine-tune's answer tokens), not tokens_per_step."""
        self.tokens = 0  # counted since the start
        self._last_tokens = 0
        self.start_step = start_step
        self.tokens_per_step = tokens_per_step
        self.memory = memory
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.metrics_path = metrics_path
        self.sinks = list(sinks) if enabled else []
        self.bar = enabled and (_is_tty(self.stream) if bar is None else bar)
        self.t0 = time.perf_counter()
        self._last_t = self.t0
        self._last_step = start_step
        self._drawn_at = 0.0  # when the status line was last drawn (perf_counter); 0: never
        self._bar_shown = False  # a status line is on screen (a permanent line must clear it first)

    def log(self, record: dict) -> None:
        record = {"time": round(time.time(), 3), **record}
        if self.enabled and self.metrics_path is not None:
            with self._open_metrics() as f:
                f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def _open_metrics(self):
        """metrics.jsonl for appending, checked as it is opened (preflight.py checked it before the run): the folder
        still there, the file not a symlink nor a hard link made since; each a one-line error naming --out-dir."""
        from tightfit.errors import UsageError
        from tightfit.train.preflight import hard_link_message

        path = self.metrics_path
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:
            raise UsageError(f"--out-dir: {path.parent} is gone (removed while the run was training?): its "
                             f"metrics.jsonl cannot be written; give the run a folder it keeps") from None
        except OSError as e:
            raise UsageError(f"--out-dir: {path} cannot be appended to ({e.strerror}; a symlink is refused): "
                             "remove it or choose another --out-dir") from None
        f = os.fdopen(fd, "a")
        if os.fstat(fd).st_nlink > 1:
            f.close()
            raise UsageError(hard_link_message(path, "--out-dir (metrics.jsonl)"))
        return f

    def count_tokens(self, n: int) -> None:
        """One step's tokens, where tok/s counts them (`counted`)."""
        self.tokens += n

    def _tokens_since(self, step: int, last_step: int, last_tokens: int) -> int:
        return self.tokens - last_tokens if self.counted else (step - last_step) * self.tokens_per_step

    def say(self, text: str) -> None:
        if self.enabled:
            self._clear_bar()
            print(text, file=self.stream, flush=True)

    def _eta(self, step: int, now: float) -> float:
        done = step - self.start_step
        return (now - self.t0) / done * (self.total - step) if done else 0.0

    def step(self, step: int, loss: float, lr: float, grad_norm: float | None,
             engine: dict[str, float] | None = None) -> None:
        """Report after optimizer step `step` (1-based count of steps done). `engine`: the offload engine's counters
        per step over the steps since the last report, with "step_s" their mean time (`EngineWindow`)."""
        now = time.perf_counter()
        dt = max(now - self._last_t, 1e-9)
        tok_s = self._tokens_since(step, self._last_step, self._last_tokens) / dt
        elapsed = now - self.t0
        eta = self._eta(step, now)
        mem = self.memory()
        self._last_t, self._last_step, self._last_tokens = now, step, self.tokens
        width = len(str(self.total))
        unit = "answer tok/s" if self.counted else "tok/s"
        self.say(f"step {step:>{width}}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | {tok_s:,.0f} {unit} | "
                 f"mem {_mem_text(mem)}{_rates_text(engine)} | ETA {format_duration(eta)}")
        record = {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tok_s, "memory": mem, "elapsed_s": elapsed}
        if engine is not None:
            record["engine"] = engine
        self.log(record)

    def tick(self, step: int, loss: float) -> None:
        """After every optimizer step: redraw the status line on a terminal (throttled); nothing otherwise."""
        if not self.bar:
            return
        now = time.perf_counter()
        if now - self._drawn_at < 1.0 / BAR_HZ and step != self.total:
            return
        self._drawn_at = now
        tok_s = self._tokens_since(step, self.start_step, 0) / max(now - self.t0, 1e-9)
        frac = step / self.total if self.total else 1.0
        cols = shutil.get_terminal_size((100, 20)).columns
        text = (f"{frac:4.0%} {step}/{self.total} | loss {loss:.4f} | {tok_s:,.0f} tok/s | "
                f"mem {_mem_text(self.memory())} | ETA {format_duration(self._eta(step, now))}")
        room = max(10, min(40, cols - len(text) - 4))
        filled = int(room * frac)
        line = f"[{'#' * filled}{'.' * (room - filled)}] {text}"[: max(cols - 1, 20)]
        self.stream.write("\r" + line + "\x1b[K")  # \x1b[K: erase what a longer previous line left
        self.stream.flush()
        self._bar_shown = True

    def _clear_bar(self) -> None:
        if self._bar_shown:
            self.stream.write("\r\x1b[K")
            self._bar_shown = False

    def eval(self, step: int, val_loss: float) -> None:
        self.say(f"eval step {step}: val loss {val_loss:.4f} nats/token")
        self.log({"kind": "eval", "step": step, "val_loss": val_loss})

    def close(self) -> None:
        """Leave the terminal on a fresh line and close the sinks (flushes TensorBoard's event file)."""
        self._clear_bar()
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def _mem_text(mem: dict[str, int]) -> str:
    return " ".join(f"{tier} {format_size(b)}" for tier, b in mem.items())


def _rates_text(engine: dict[str, float] | None) -> str:
    """" | link 1.2 GB/s disk 0.4 GB/s": the engine's bytes between host and device, and to and from its swap files,
    per second of the steps they were counted over; each where it is counted (FSDP2's own copies under ZeRO-3 are
    not: parallel/shard_states.py counts the moments' disk bytes alone)."""
    if not engine or not engine.get("step_s"):
        return ""
    rates = [(name, sum(engine[k] for k in keys) / engine["step_s"] / 1e9)
             for name, keys in (("link", ("h2d_bytes", "d2h_bytes")), ("disk", ("nvme_read_bytes", "nvme_write_bytes")))
             if all(k in engine for k in keys)]
    return " | " + " ".join(f"{name} {rate:.2f} GB/s" for name, rate in rates) if rates else ""


class EngineWindow:
    """The offload engine's counters over the training steps since the last report: each step's difference
    (`counters()` before and after it, so evaluation and checkpoints between steps are not in it), reported per step
    with the steps' mean time (`step_s`), for metrics.jsonl's "engine" object and the progress line's rates
    ([Note: engine counters] in docs/ENGINE.md)."""

    def __init__(self, read: Callable[[], dict[str, float] | None]) -> None:
        self._read = read
        self._sum: dict[str, float] = {}
        self._steps = 0
        self._seconds = 0.0
        self._before: dict[str, float] | None = None

    def begin(self) -> None:
        self._before = self._read()

    def end(self, seconds: float) -> None:
        after = self._read()
        if after is None or self._before is None:
            return
        for k, v in after.items():
            self._sum[k] = self._sum.get(k, 0.0) + v - self._before.get(k, 0.0)
        self._steps += 1
        self._seconds += seconds

    def report(self) -> dict[str, float] | None:
        """Per step since the last report, and start again; None without an engine or steps."""
        if not self._steps:
            return None
        out = {k: v / self._steps for k, v in self._sum.items()}
        out["step_s"] = self._seconds / self._steps
        self._sum, self._steps, self._seconds = {}, 0, 0.0
        return out
