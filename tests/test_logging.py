"""Logging and pictures (issue 16): the progress display, TensorBoard scalars, `--profile`'s measured trace beside
the plan's simulated one, and the PNGs. Each test reads the files back and checks what is in them."""

from __future__ import annotations

import io
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tightfit.cli import main
from tightfit.train import tensorboard as tb
from tightfit.train.progress import Progress
from tightfit.utils import ranges

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress(stream) -> Progress:
    return Progress(total_steps=10, start_step=0, tokens_per_step=128, metrics_path=None,
                    memory=lambda: {"device": 3 << 20, "host": 5 << 20}, stream=stream)


def test_a_terminal_gets_a_status_line_and_a_log_gets_plain_lines():
    term, log = _Terminal(), io.StringIO()
    for stream in (term, log):
        p = _progress(stream)
        for step in range(1, 11):
            p.tick(step, 2.5)
            if step % 5 == 0:
                p.step(step, 2.5, 1e-3, 0.7)
        p.close()
    # Terminal: the bar is redrawn in place, and cleared before each permanent line.
    t = term.getvalue()
    status = [chunk for chunk in t.split("\r") if chunk.startswith("[")]
    assert status and all(x in status[-1] for x in ("100%", "10/10", "loss 2.5000", "tok/s", "mem device 3",
                                                     "host 5", "ETA"))
    assert "\r\x1b[Kstep 10/10 | loss 2.5000" in t
    # Not a terminal: only the report lines, no control characters.
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("step 10/10 | loss 2.5000 | lr 1.00e-03 |")
    assert "mem device 3.0 MiB host 5.0 MiB | ETA" in lines[1]
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()


def test_profiling_ranges_cost_nothing_when_off():
    assert not ranges.ACTIVE
    assert ranges.span("tightfit::fetch") is ranges.span("tightfit::nvme read", "x")  # one shared no-op context


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_gets_the_records_metrics_jsonl_gets(tiny_args, tmp_path, capsys):
    assert main(["train", *tiny_args, "--steps", "10", "--offload", "host", "--tensorboard", "on", "--plot"]) == 0
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    scalars = _scalars(run / tb.FOLDER)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "memory/device", "memory/host",
            "memory/rss", "eval/val_loss"} <= set(scalars)
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in train] == [5, 10]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [v for _, v in scalars["memory/host"]] == pytest.approx([r["memory"]["host"] for r in train], rel=1e-6)
    assert [v for _, v in scalars["eval/val_loss"]] == pytest.approx(
        [r["val_loss"] for r in records if r["kind"] == "eval"], rel=1e-6)
    # The run's picture, drawn from the same records.
    assert (run / "run.png").read_bytes()[:8] == PNG_MAGIC
    assert f"picture of the run: {run / 'run.png'}" in capsys.readouterr().out


def test_tensorboard_on_without_the_package_is_one_line(tiny_args, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tb, "available", lambda: False)
    assert main(["train", *tiny_args, "--steps", "2", "--tensorboard", "on"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tensorboard on" in err[0] and "pip install" in err[0]
    assert not (tmp_path / "run").exists(), "refused before any work"


def test_profile_records_real_steps_with_the_engines_copies_and_disk_io(tiny_args, tmp_path):
    prof = tmp_path / "prof"
    assert main(["train", *tiny_args, "--steps", "6", "--offload", "nvme", "--nvme", str(tmp_path / "swap"),
                 "--profile", str(prof), "--tensorboard", "off"]) == 0
    assert not ranges.ACTIVE, "recording is over: the engine's ranges are off again"
    events = json.loads((prof / "profile_trace.json").read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    steps = sorted(n for n in names if n.startswith("ProfilerStep#"))
    assert len(steps) == 3, steps  # PROFILE_STEPS real steps after one warm-up step
    for kind in ("tightfit::fetch", "tightfit::pack_grads", "tightfit::nvme read", "tightfit::nvme write",
                 "tightfit::adamw"):
        assert any(n.startswith(kind) for n in names), kind
    # The disk ranges ran on the engine's I/O threads, not the training thread.
    main_tid = next(e["tid"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert {e["tid"] for e in events if e.get("name", "").startswith("tightfit::nvme")} - {main_tid}
    # Beside it, the plan's simulated step: the same kinds of work, predicted.
    sim = json.loads((prof / "plan_trace.json").read_text())["traceEvents"]
    assert any(e.get("args", {}).get("name") == "tightfit plan (simulated)" for e in sim)
    sim_names = {e["name"] for e in sim if e.get("ph") == "X"}
    assert any(n.startswith("read ") for n in sim_names) and any(n.startswith("adamw ") for n in sim_names)
    timeline = json.loads((prof / "memory_timeline.json").read_text())
    assert timeline["samples"] and {"device", "host", "nvme"} <= set(timeline["samples"][-1])
    for png in ("memory_timeline.png", "plan.png"):
        assert (prof / png).read_bytes()[:8] == PNG_MAGIC, png


def test_without_the_flags_no_trace_no_picture_no_events(tiny_args, tmp_path):
    assert main(["train", *tiny_args, "--steps", "2", "--tensorboard", "off"]) == 0
    run = tmp_path / "run"
    assert not (run / tb.FOLDER).exists() and not (run / "run.png").exists()
    assert not list(tmp_path.rglob("profile_trace.json"))


def test_plot_without_matplotlib_is_one_line(tiny_args, tmp_path, monkeypatch, capsys):
    from tightfit.train import pictures

    monkeypatch.setattr(pictures, "matplotlib_pyplot", lambda: None)
    assert main(["train", *tiny_args, "--steps", "2", "--plot"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--plot" in err[0] and "pip install" in err[0]
    assert not (tmp_path / "run").exists(), "refused before any work"


def test_an_error_clears_the_status_line_before_it_is_printed(tiny_args, monkeypatch, capsys):
    import math

    from tightfit.train import memory, progress

    monkeypatch.setattr(progress, "_is_tty", lambda stream: True)  # stdout as a terminal
    real, calls = memory.PlainMemory.clip_grad_norm, []

    def clip(self, max_norm):  # the gradient norm becomes inf at step 3: the run stops with one line
        calls.append(1)
        return real(self, max_norm) if len(calls) < 3 else math.inf

    monkeypatch.setattr(memory.PlainMemory, "clip_grad_norm", clip)
    assert main(["train", *tiny_args, "--steps", "5", "--tensorboard", "off", "--offload", "none"]) == 2
    out, err = capsys.readouterr()
    assert "\r[" in out, "the status line was drawn"
    assert out.rindex("\r\x1b[K") > out.rindex("\r["), "and cleared before the error"
    assert "diverged at step 3" in err


def test_the_plan_is_compared_with_the_median_step_not_the_runs_rate(tiny_args, tmp_path, monkeypatch):
    """[Note: the step the plan predicts]: an evaluation is not a step. Each of 4 steps is followed by one that takes
    0.3 s more here: the measured step the plan is compared with stays a step's time, and metrics.jsonl keeps the
    run's seconds per step, evaluations included, beside it."""
    import time

    from tightfit.train import trainee

    real = trainee.evaluate

    def slow_evaluate(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainee, "evaluate", slow_evaluate)
    assert main(["train", *tiny_args, "--steps", "4", "--eval-interval", "1"]) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    record = next(r for r in records if r["kind"] == "plan_vs_measured")
    assert record["measured"]["step_s"] < 0.3 < record["run_seconds_per_step"]
