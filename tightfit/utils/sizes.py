"""Parse and print byte sizes ("8GiB", "512MB", "1.5G", "1000000").

Why: every memory budget (`--gpu-mem`, `--cpu-mem`, `--nvme PATH:SIZE`) is given by people, and every report is
read by people. Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal units (KB, MB, GB, TB) powers of
1000; a bare K/M/G/T means binary, as in most tools that take memory sizes.
"""

from __future__ import annotations

import re

from tightfit.errors import UsageError

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float, flag: str = "size") -> int:
    """Bytes in `text`; raises UsageError naming `flag` when it cannot be read."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text != text or text in (float("inf"), float("-inf")):
            raise UsageError(f"{flag}: size must be a finite number, got {text}")
        if text < 0:
            raise UsageError(f"{flag}: size must not be negative, got {text}")
        return int(text)
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise UsageError(
            f"{flag}: cannot read size {text!r}; write a number with an optional unit, e.g. 8GiB, 512MiB, 2GB"
        )
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(n: float) -> str:
    """Human-readable binary size, e.g. 1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
