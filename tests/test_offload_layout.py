"""The offload engine's layout: one import direction between its layers, and no private name of the engine used
outside its file (issue 25: helpers that reached into the engine's fields were engine methods in other files).

Layers, lowest first (docs/ENGINE.md, "Layout"):
  placement.py, memory_model.py, device_kind.py   the contract and the arithmetic: no torch state, no engine
  runtime/      movers, the host pool and cache, the device meter, workers: move and hold bytes
  tiers/        where states rest (memory stores; nvme/: the swap files)
  step/         units, lifecycle, scheduler, gradients, optimizer step, the engine and its hooks
  model_state/  the model seen through the engine: parameter reads, state dicts, checkpoint import/export
  wrap.py, __init__.py   the public entry points
A module imports from its own layer or lower ones only (imports needed for type annotations alone, under
`if TYPE_CHECKING:`, are not imports at run time and are left out).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OFFLOAD = ROOT / "tightfit" / "offload"
LAYERS = ["base", "runtime", "tiers", "step", "model_state", "top"]


def _layer(module: str) -> str:
    """Layer of `tightfit.offload.<...>`."""
    parts = module.split(".")[2:]
    if not parts or parts[0] in ("wrap", "__init__"):
        return "top"
    if parts[0] in ("runtime", "tiers", "step", "model_state"):
        return parts[0]
    return "base"


def _runtime_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tightfit.offload"):
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "tightfit.offload" else [
                node.module]
            out += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("tightfit.offload")]
    return out


def test_offload_layers_import_downwards_only():
    wrong = []
    for path in sorted(OFFLOAD.rglob("*.py")):
        module = "tightfit." + ".".join(path.relative_to(ROOT / "tightfit").with_suffix("").parts)
        mine = LAYERS.index(_layer(module))
        for line, target in _runtime_imports(path):
            if target == "tightfit.offload":
                continue
            if LAYERS.index(_layer(target)) > mine:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({_layer(module)}) imports {target} "
                             f"({_layer(target)})")
    assert not wrong, "\n".join(wrong)


def test_no_private_name_of_the_engine_outside_its_file():
    engine_file = OFFLOAD / "step" / "engine.py"
    private = re.compile(r"\bengine\._[a-zA-Z]|\b_ENGINES\b|\b_PARAM_ENGINE\b")
    wrong = []
    for path in sorted((ROOT / "tightfit").rglob("*.py")):
        if path == engine_file:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if private.search(line):
                wrong.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not wrong, "\n".join(wrong)
