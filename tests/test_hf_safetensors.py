"""tightfit's streaming safetensors reader/writer agree byte for byte with the safetensors library."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tightfit.errors import UsageError
from tightfit.models.hf_safetensors import ShardWriter, TensorReader, TensorSpec, read_header

TENSORS = {
    "a.weight": torch.randn(3, 5),
    "b.bf16": torch.randn(7).to(torch.bfloat16),
    "c.ids": torch.arange(6, dtype=torch.int64).view(2, 3),
    "d.mask": torch.tensor([True, False, True]),
    "e.scalar": torch.tensor(2.5),
    "f.empty": torch.zeros(0, 4),
}


def test_reads_what_safetensors_writes(tmp_path):
    save_file(TENSORS, tmp_path / "x.safetensors", metadata={"format": "pt"})
    entries, meta = read_header(tmp_path / "x.safetensors")
    assert meta == {"format": "pt"} and set(entries) == set(TENSORS)
    with TensorReader() as r:
        for name, t in TENSORS.items():
            got = r.read(entries[name])
            assert got.dtype == t.dtype and torch.equal(got, t)
        assert r.read(entries["b.bf16"], torch.float32).dtype == torch.float32


def test_safetensors_reads_what_we_write_in_any_order(tmp_path):
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in TENSORS.items()]
    w = ShardWriter(tmp_path / "y.safetensors", specs)
    for name in reversed(list(TENSORS)):  # out of order: each write seeks to its offset
        w.write(name, TENSORS[name])
    w.close()
    with safe_open(tmp_path / "y.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(TENSORS)
        for name, t in TENSORS.items():
            assert torch.equal(f.get_tensor(name), t)


def test_writer_converts_dtype_and_checks_completeness(tmp_path):
    w = ShardWriter(tmp_path / "z.safetensors", [TensorSpec("w", torch.bfloat16, (4,)), TensorSpec("v", torch.float32, (2,))])
    w.write("w", torch.ones(4))
    with pytest.raises(ValueError, match="shape"):
        w.write("v", torch.ones(3))
    with pytest.raises(ValueError, match="never written"):
        w.close()
    entries, _ = read_header(tmp_path / "z.safetensors")
    assert entries["w"].dtype == torch.bfloat16


def test_garbage_is_a_usage_error(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 4)
    with pytest.raises(UsageError, match="bad.safetensors: not a readable safetensors file"):
        read_header(tmp_path / "bad.safetensors")
