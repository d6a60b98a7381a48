"""The safetensors format's constants, in one place for the three writers that need them.

tightfit writes safetensors three ways, each for its own access pattern: checkpoints stream tensors whose set is
not known in advance (utils/safetensors_io.py), Hugging Face shards declare their header first and fill tensors at
their offsets (models/hf_safetensors.py), and NVMe swap files keep every tensor 4096-aligned for O_DIRECT and are
rewritten in place (offload/safetensors_file.py). All three share the format's dtype codes and header limit.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N; N bytes of JSON
mapping each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (relative to the end of the header),
plus an optional "__metadata__" dict of strings; then the data, with no gaps.
"""

from __future__ import annotations

import torch

DTYPE_TO_CODE: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
"""torch dtype -> the format's dtype code."""

CODE_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_CODE.items()}
"""The format's dtype code -> torch dtype."""

MAX_HEADER = 100 * 1024 * 1024
"""The reference implementation's header limit: a larger "header" means a corrupt file."""
