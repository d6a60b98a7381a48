"""What-if hardware: a machine described in a file, or by name, for `tightfit plan --hardware`.

Why: "will a 7B model train on a 24 GiB GPU with 64 GiB of RAM and an NVMe disk?" must be answerable on a machine
that has none of those. The planner needs only a `HardwareProfile` (capacities and speeds); this module reads one
from a JSON or TOML file (one `tightfit probe --out FILE` wrote, or one written by hand) or from the named
profiles in `named_profiles.py`, and validates it so a typo is one line naming the file and the field.

The format (docs/PLANNER.md, "What-if hardware"): the fields of `HardwareProfile`, flat, at the top level.
Byte figures may be numbers or sizes ("24GiB"); bandwidths numbers (bytes/s) or sizes per second ("25GB/s");
`matmul_flops` maps the smallest side of a matmul (the other sides wide) to FLOP/s ({"4096" = 1.5e14} in TOML,
{"4096": 1.5e14} in JSON); `attention_flops`, which may be left out, maps fused attention's problem size to FLOP/s
in the same way, and `timed_op_bw`, which may be left out too, an elementwise aten op to bytes per second;
`assumptions` is a list of sentences the plan prints under its table. A profile read from a file is used as it
is: no capacity of this machine is read into it.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import fields
from pathlib import Path

from tightfit.errors import UsageError
from tightfit.planner.hardware import HardwareProfile, machine_key
from tightfit.planner.naming import CLI, Naming

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_BYTES = ("gpu_total", "gpu_free", "host_total", "host_available", "nvme_free", "nvme_chunk_bytes", "runtime_rss",
          "nvme_measured_bytes", "device_workspace")
_RATES_BPS = ("nvme_read_bw", "nvme_write_bw", "nvme_mixed_bw", "h2d_bw", "d2h_bw", "mem_bw", "duplex_bw",
              "host_pass_bw")
_NUMBERS = ("cpu_adam_rate", "device_adam_rate", "op_overhead_s", "unit_overhead_s", "stream_overhead_s",
            "step_overhead_s", "measured_at", "cpu_pressure")
_INTS = ("nvme_io_threads", "threads")
_REQUIRED = ("cuda", "device_name", "host_total", "nvme_read_bw", "nvme_write_bw", "h2d_bw", "d2h_bw", "mem_bw",
             "cpu_adam_rate", "matmul_flops")
"""A hand-written profile must state these; the rest have defaults (gpu_free = gpu_total, host_available =
host_total, device_adam_rate = cpu_adam_rate without CUDA, the dataclass's defaults otherwise)."""


def load_hardware(spec: str, names: Naming = CLI) -> HardwareProfile:
    """The profile `spec` names: a named profile (`named_profiles.PROFILES`) or a .json / .toml file."""
    from tightfit.planner.named_profiles import PROFILES

    flag = names.of("hardware")
    if spec in PROFILES:
        return profile_from_dict(PROFILES[spec], f"{flag} {spec}", default_key=f"named:{spec}")
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"{flag}: {spec!r} is neither a file nor a named profile; named: {', '.join(PROFILES)}")
    text = path.read_text(errors="replace")
    where = f"{flag} {path}"
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as e:
        kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
        raise UsageError(f"{where}: not valid {kind} ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected a table of profile fields at the top level")
    if "cuda" not in data and data and all(isinstance(v, dict) and "cuda" in v for v in data.values()):
        data = _from_cache(data, where)  # the probe's cache: profiles keyed by machine
    return profile_from_dict(data, where, default_key=f"file:{path.name}")


def _from_cache(entries: dict, where: str) -> dict:
    """The one profile of a probe cache file (or this machine's, when it holds several)."""
    if len(entries) == 1:
        return next(iter(entries.values()))
    if machine_key() in entries:
        return entries[machine_key()]
    raise UsageError(f"{where}: a probe cache with {len(entries)} machines ({', '.join(entries)}); save one with "
                     "`tightfit probe --out FILE` on the machine to plan for")


def _size(value, where: str, key: str, per_second: bool) -> float:
    from tightfit.utils.sizes import parse_size

    if isinstance(value, bool):
        value = "bad"
    if isinstance(value, str) and per_second:
        if not value.strip().lower().endswith("/s"):
            raise UsageError(f"{where}: field {key}: write bytes per second as a number or e.g. '25GB/s', "
                             f"got {value!r}")
        value = value.strip()[:-2]
    what = "bytes per second (a number or e.g. '25GB/s')" if per_second else "bytes (a number or e.g. '24GiB')"
    try:
        out = parse_size(value, key)
    except UsageError:
        raise UsageError(f"{where}: field {key}: expected {what}, got {value!r}") from None
    return float(out) if per_second else out


def _number(value, where: str, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{where}: field {key}: expected a number, got {value!r}")
    return float(value)


def profile_from_dict(data: dict, where: str, default_key: str = "file") -> HardwareProfile:
    """Validate a profile's fields (one line per mistake, naming `where` and the field) and build it."""
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UsageError(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(sorted(known))}")
    missing = [k for k in _REQUIRED if k not in data]
    if data.get("cuda") is True and "gpu_total" not in data:
        missing.append("gpu_total")
    if data.get("cuda") is True and "device_adam_rate" not in data:
        missing.append("device_adam_rate")
    if missing:
        raise UsageError(f"{where}: missing field {missing[0]} (a profile states at least: "
                         f"{', '.join(_REQUIRED)}, and gpu_total and device_adam_rate for a GPU)")
    out: dict = {}
    for key, value in data.items():
        if key == "cuda":
            if not isinstance(value, bool):
                raise UsageError(f"{where}: field cuda: expected true or false, got {value!r}")
            out[key] = value
        elif key in ("key", "device_name", "nvme_device"):
            if not isinstance(value, str):
                raise UsageError(f"{where}: field {key}: expected a string, got {value!r}")
            out[key] = value
        elif key == "assumptions":
            if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
                raise UsageError(f"{where}: field assumptions: expected a list of sentences")
            out[key] = list(value)
        elif key in ("matmul_flops", "attention_flops"):
            out[key] = _flops_by_size(value, where, key)
        elif key == "timed_op_bw":
            out[key] = _timed_ops(value, where)
        elif key == "nvme_volumes":
            out[key] = _volumes(value, where)
        elif key in _BYTES:
            out[key] = _size(value, where, key, per_second=False)
        elif key in _RATES_BPS:
            out[key] = _size(value, where, key, per_second=True)
        elif key in _INTS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{where}: field {key}: expected a positive integer, got {value!r}")
            out[key] = value
        elif key in _NUMBERS:
            out[key] = _number(value, where, key)
    unmeasured_zero = ("nvme_mixed_bw", "duplex_bw", "host_pass_bw")  # 0: unmeasured
    for key in (*_RATES_BPS, "cpu_adam_rate", "device_adam_rate"):
        if key in out and (out[key] < 0 if key in unmeasured_zero else out[key] <= 0):
            raise UsageError(f"{where}: field {key}: must be positive, got {data[key]!r}")
    for key in ("op_overhead_s", "unit_overhead_s", "stream_overhead_s", "step_overhead_s"):
        if out.get(key, 0.0) < 0:
            raise UsageError(f"{where}: field {key}: seconds cannot be negative, got {data[key]!r}")
    if not (out.get("cpu_pressure", -1.0) == -1.0 or 0.0 <= out["cpu_pressure"] <= 1.0):
        raise UsageError(f"{where}: field cpu_pressure: a share of time from 0 to 1 (-1: not known), got "
                         f"{data['cpu_pressure']!r}")
    if out["cuda"] and out.get("gpu_total", 0) <= 0:
        raise UsageError(f"{where}: field gpu_total: a GPU profile needs its memory, got {data.get('gpu_total')!r}")
    out.setdefault("key", default_key)
    out.setdefault("gpu_total", 0)
    out.setdefault("gpu_free", out["gpu_total"])
    out.setdefault("host_available", out["host_total"])
    out.setdefault("nvme_free", 0)
    out.setdefault("device_adam_rate", out["cpu_adam_rate"])
    if not out["cuda"] and out["gpu_total"]:
        raise UsageError(f"{where}: field gpu_total: set cuda = true for a GPU, or leave gpu_total out")
    return HardwareProfile(**out)


def _flops_by_size(value, where: str, key: str) -> dict[int, float]:
    """`matmul_flops` (required: not empty) or `attention_flops` (may be empty: not measured)."""
    side = "smallest matmul side" if key == "matmul_flops" else "attention problem size"
    if not isinstance(value, dict) or (not value and key == "matmul_flops"):
        raise UsageError(f"{where}: field {key}: expected a table of {side} -> FLOP/s, "
                         'e.g. {"1024": 1.0e14, "4096": 1.5e14}')
    out = {}
    for k, v in value.items():
        size = _positive_key(k)
        if not size or not _is_number(v) or v <= 0:
            raise UsageError(f"{where}: field {key}: entry {k!r} = {v!r}: expected a positive size "
                             "and a positive FLOP/s")
        out[size] = float(v)
    return out


def _timed_ops(value, where: str) -> dict[str, float]:
    """`timed_op_bw`: elementwise aten op (one of `work.TIMED_OPS`) -> bytes/s."""
    from tightfit.planner.work import TIMED_OPS

    if not isinstance(value, dict):
        raise UsageError(f"{where}: field timed_op_bw: expected a table of elementwise op -> bytes/s, "
                         'e.g. {"bernoulli_": "1GB/s"}')
    out = {}
    for k, v in value.items():
        if k not in TIMED_OPS:
            raise UsageError(f"{where}: field timed_op_bw: unknown op {k!r}; known: {', '.join(TIMED_OPS)}")
        out[k] = _size(v, where, f"timed_op_bw.{k}", per_second=True)
        if out[k] <= 0:
            raise UsageError(f"{where}: field timed_op_bw.{k}: must be positive, got {v!r}")
    return out


def _volumes(value, where: str) -> dict[int, list[float]]:
    """`nvme_volumes`: bytes measured over -> [read, write, both at once] bytes/s (both at once may be 0)."""
    if not isinstance(value, dict):
        raise UsageError(f"{where}: field nvme_volumes: expected a table of volume -> [read, write, both at once] "
                         'bytes/s, e.g. {"51539607552": [1.1e9, 1.08e9, 1.4e9]}')
    out = {}
    for k, v in value.items():
        volume = _positive_key(k)
        rates = v if isinstance(v, list) and len(v) == 3 and all(_is_number(x) for x in v) else None
        if not volume or rates is None or rates[0] <= 0 or rates[1] <= 0 or rates[2] < 0:
            raise UsageError(f"{where}: field nvme_volumes: entry {k!r} = {v!r}: expected a positive byte count "
                             "and [read, write, both at once] bytes/s")
        out[volume] = [float(x) for x in rates]
    return out


def _positive_key(key) -> int:
    """A table's key read as a positive integer (0 when it is not one)."""
    try:
        return max(0, int(key))
    except (TypeError, ValueError):
        return 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def save_hardware(hw: HardwareProfile, path: str) -> Path:
    """Write `hw` as a profile file (JSON) that `load_hardware` reads back equal; atomic (a temporary file renamed
    over the target), so a reader never sees half a profile."""
    import os

    out = Path(path)
    if out.parent and not out.parent.is_dir():
        raise UsageError(f"--out: folder {out.parent} does not exist")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(hw.to_dict(), indent=2))
    os.replace(tmp, out)
    return out
