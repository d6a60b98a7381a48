"""Hugging Face weight files: offsets checked as the safetensors library checks them; weights under another name
are an error, never a silent random init."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tightfit.errors import UsageError
from tightfit.models.hf_safetensors import read_header


def _file(tmp_path, change=None, tail=b""):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.arange(4.0), "b": torch.arange(4.0) + 10, "c": torch.zeros(2)}, path)
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    if change:
        change(header)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:] + tail)
    return path


def _library_refuses(path) -> bool:
    try:
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:
        return True
    return False


def test_overlapping_tensors(tmp_path):
    def overlap(h):
        h["b"]["data_offsets"] = list(h["a"]["data_offsets"])  # b claims a's bytes
    path = _file(tmp_path, overlap)
    assert _library_refuses(path)
    with pytest.raises(UsageError, match="'b'.*overlaps"):
        read_header(path)


def test_gap_between_tensors(tmp_path):
    def gap(h):
        h["c"]["data_offsets"] = [h["c"]["data_offsets"][0] + 4, h["c"]["data_offsets"][1] + 4]
    path = _file(tmp_path, gap, tail=b"\0" * 4)
    assert _library_refuses(path)
    with pytest.raises(UsageError, match="gap of 4 bytes"):
        read_header(path)


def test_bytes_past_the_last_tensor(tmp_path):
    path = _file(tmp_path, tail=b"\0" * 8)
    assert _library_refuses(path)
    with pytest.raises(UsageError, match="truncated, padded or corrupt"):
        read_header(path)


def test_out_of_range_offsets(tmp_path):
    def far(h):
        h["c"]["data_offsets"] = [1 << 20, (1 << 20) + 8]
    with pytest.raises(UsageError, match="past the end of the file"):
        read_header(_file(tmp_path, far))


def test_valid_file_still_reads(tmp_path):
    entries, _ = read_header(_file(tmp_path))
    assert sorted(entries) == ["a", "b", "c"]


def test_weights_file_under_another_name_is_an_error(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tightfit.models.hf_load import HFCheckpoint

    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    (folder / "model.safetensors").rename(folder / "pytorch_weights.safetensors")
    with pytest.raises(UsageError, match="pytorch_weights.safetensors but no model.safetensors"):
        HFCheckpoint.open(folder)
    (folder / "pytorch_weights.safetensors").unlink()  # a config-only folder is still a random init, by design
    assert not HFCheckpoint.open(folder).has_weights
