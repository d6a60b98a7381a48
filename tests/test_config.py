"""Typed config: flags, TOML, precedence, and errors that name the flag."""

from __future__ import annotations

import argparse

import pytest

from tightfit.config import add_config_args, config_from_args, parse_nvme
from tightfit.errors import UsageError
from tightfit.utils.sizes import format_size, parse_size


def _cfg(argv):
    p = argparse.ArgumentParser()
    add_config_args(p)
    return config_from_args(p.parse_args(argv))


@pytest.mark.parametrize("text,expected", [("8GiB", 8 * 1024**3), ("512MiB", 512 * 1024**2), ("2GB", 2 * 10**9),
                                           ("1.5G", int(1.5 * 1024**3)), ("4096", 4096), ("10 kb", 10_000)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_format_size():
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * 1024**3) == "3.0 GiB"


def test_flags_override_defaults():
    cfg = _cfg(["--steps", "7", "--micro-batch", "3", "--lr", "1e-3", "--resume", "--nvme", "/tmp/swap:2GiB"])
    assert (cfg.train.steps, cfg.train.micro_batch, cfg.optim.lr, cfg.train.resume) == (7, 3, 1e-3, True)
    assert parse_nvme(cfg.memory.nvme) == ("/tmp/swap", 2 * 1024**3)


def test_toml_then_flags(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nsteps = 11\nmicro_batch = 5\n[optim]\nlr = 0.002\n")
    cfg = _cfg(["--config", str(f), "--steps", "13"])
    assert (cfg.train.steps, cfg.train.micro_batch, cfg.optim.lr) == (13, 5, 0.002)


@pytest.mark.parametrize("argv,flag", [
    (["--gpu-mem", "8XB"], "--gpu-mem"),
    (["--cpu-mem", "lots"], "--cpu-mem"),
    (["--steps", "-1"], "--steps"),
    (["--steps", "ten"], "--steps"),
    (["--precision", "fp8"], "--precision"),
    (["--n-head", "3"], "--n-head"),
    (["--min-lr", "1.0"], "--min-lr"),
    (["--nvme", ":4GiB"], "--nvme"),
])
def test_bad_values_name_the_flag(argv, flag):
    with pytest.raises(UsageError) as e:
        _cfg(argv)
    assert str(e.value).startswith(flag)
    assert "\n" not in str(e.value)


def test_toml_errors_name_file_and_setting(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train]\nstepz = 3\n")
    with pytest.raises(UsageError, match="train.stepz"):
        _cfg(["--config", str(f)])
    f.write_text("[train\n")
    with pytest.raises(UsageError, match="not valid TOML"):
        _cfg(["--config", str(f)])
    with pytest.raises(UsageError, match="--config"):
        _cfg(["--config", str(tmp_path / "missing.toml")])
