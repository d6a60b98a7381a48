"""Atomic streaming safetensors writes and checked reads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tightfit.errors import UsageError
from tightfit.utils.safetensors_io import StreamingWriter, open_checked


def test_round_trip_all_dtypes(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(4),
               "d": torch.tensor(3.0), "e": torch.randint(0, 255, (9,), dtype=torch.uint8)}
    with StreamingWriter(tmp_path / "x.safetensors") as w:
        for k, v in tensors.items():
            w.add(k, v)
        w.close({"step": 3})
    loaded = load_file(tmp_path / "x.safetensors")
    for k, v in tensors.items():
        assert torch.equal(loaded[k], v), k
    assert open_checked(tmp_path / "x.safetensors", "--flag").metadata() == {"step": "3"}


def test_failure_mid_write_keeps_previous_file(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    with StreamingWriter(path) as w:
        w.add("w", torch.ones(4))
        w.close()
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        with StreamingWriter(path) as w:
            w.add("w", torch.zeros(4))
            raise RuntimeError("crash before close")
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]  # no temporary files left behind


def test_truncated_and_corrupt_files_are_refused(tmp_path):
    path = tmp_path / "ok.safetensors"
    with StreamingWriter(path) as w:
        w.add("w", torch.randn(1000))
        w.close()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UsageError, match="truncated.safetensors"):
        open_checked(truncated, "--resume")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + bytes(64))
    with pytest.raises(UsageError, match="corrupt.safetensors"):
        open_checked(corrupt, "--resume")
    with pytest.raises(UsageError, match="does not exist"):
        open_checked(tmp_path / "missing.safetensors", "--resume")
