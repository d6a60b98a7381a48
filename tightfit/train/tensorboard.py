"""Training metrics to TensorBoard, when it is installed (`pip install tightfit[tensorboard]`).

Why a sink of `Progress`'s records and not calls in the loop: the loop reports once per log interval to
`Progress`, which already builds one record per report (the line a person reads, the metrics.jsonl entry); this
turns the same records into scalars, so the three never disagree and the loop has no TensorBoard code. Nothing is
written between reports, so it adds no per-step cost.

Tags: `train/loss`, `train/lr`, `train/grad_norm`, `train/tokens_per_s`, `memory/<tier>` (bytes, as
`Progress` reports them: `device`, `host`, `nvme`, `rss` when offloading), `eval/val_loss`; the x axis is the step.
Files: `<out-dir>/tensorboard/events.out.tfevents.*` (`tensorboard --logdir <out-dir>/tensorboard`).
"""

from __future__ import annotations

from pathlib import Path

from tightfit.errors import UsageError

FOLDER = "tensorboard"


def available() -> bool:
    try:
        import tensorboard  # noqa: F401 - torch's SummaryWriter needs the package
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardSink:
    """Writes `Progress` records as scalars; `close` flushes the event file."""

    def __init__(self, folder: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder)
        self.writer = SummaryWriter(log_dir=str(self.folder))

    def write(self, record: dict) -> None:
        step = record.get("step")
        if record.get("kind") == "train":
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                if record.get(key) is not None:
                    self.writer.add_scalar(f"train/{key}", record[key], step)
            for tier, nbytes in record.get("memory", {}).items():
                self.writer.add_scalar(f"memory/{tier}", nbytes, step)
        elif record.get("kind") == "eval":
            self.writer.add_scalar("eval/val_loss", record["val_loss"], step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def require() -> None:
    """`--tensorboard on` without TensorBoard installed: one line, before any work (config.validate calls it)."""
    if not available():
        raise UsageError("--tensorboard on: TensorBoard is not installed; pip install 'tightfit[tensorboard]' "
                         "(or tensorboard), or pass --tensorboard off")


def open_sink(mode: str, out_dir: str | Path) -> TensorBoardSink | None:
    """The sink `--tensorboard` asks for: auto (when installed), on (required), off."""
    if mode == "off" or (mode == "auto" and not available()):
        return None
    require()
    return TensorBoardSink(Path(out_dir) / FOLDER)
