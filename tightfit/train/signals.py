"""The signals a long run gets from a job scheduler or a terminal: finish the step, save, and end.

Why: SIGTERM (what SLURM, Kubernetes and systemd send before they kill) and SIGHUP (a closed terminal) had no handler,
so the process died as under `kill -9`: no message, no final save, a scheduler's grace period wasted; SIGINT ended
the run at once and discarded a checkpoint being written. Now the first of them asks the loop to stop at the end of
the step in flight: it evaluates, saves a checkpoint (a save already in progress completes first), says which signal
stopped it and how to continue, and the process exits with 128 + the signal's number (a scheduler sees that the run
did not finish, the checkpoint holds its state). A second SIGINT (Ctrl-C twice) stops at once, as before.

Handlers are installed only on the main thread (Python delivers signals there) and put back when the run ends.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = tuple(s for s in (getattr(signal, n, None) for n in ("SIGTERM", "SIGHUP", "SIGINT")) if s is not None)


class GracefulStop:
    """Context manager: while inside, a stop signal sets `received` (its name) instead of ending the process."""

    def __init__(self, save: bool = True, announce: bool = True) -> None:
        self.save, self.announce = save, announce  # announce: say so on stderr (one rank of several does)
        self.received: str | None = None
        self.signum: int | None = None
        self._old: dict[int, object] = {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt  # Ctrl-C a second time: now
            return
        self.received, self.signum = name, signum
        if not self.announce:
            return
        then = "saving a checkpoint" if self.save else "stopping without a checkpoint (--no-save-on-signal)"
        print(f"tightfit: {name} received: finishing this step, then {then}"
              + (" (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""), file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    @property
    def exit_code(self) -> int:
        """128 + the signal's number once one was received (the shell's code for a run a signal ended), else 0."""
        return 128 + self.signum if self.signum is not None else 0
