"""The torch version tightfit states, and the guards on the private torch APIs it uses (pyproject.toml's comment).

A private import must not break `import tightfit.parallel` on a torch that lacks it, and the feature that needs it
must end with one UsageError naming the torch to upgrade to, not a traceback from inside torch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tightfit.errors import UsageError
from tightfit.parallel import data_parallel, tensor_parallel

ROOT = Path(__file__).resolve().parents[1]


def _floor(text: str) -> tuple[int, int]:
    found = re.search(r'"torch>=(\d+)\.(\d+)"', text)
    assert found, "pyproject.toml must state torch>=X.Y"
    return int(found.group(1)), int(found.group(2))


def test_stated_floor_is_met_and_used_by_the_setup_script():
    floor = _floor((ROOT / "pyproject.toml").read_text())
    assert floor >= (2, 6), "fully_shard is imported from torch.distributed.fsdp, public from torch 2.6"
    assert tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= floor
    # setup_env.sh installs the torch pyproject.toml names, read from it rather than copied.
    assert re.search(r"torch>=\d", (ROOT / "scripts" / "setup_env.sh").read_text()) is None


def test_replicate_guard_names_the_torch_to_upgrade_to(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    with pytest.raises(UsageError, match=r"torch >= 2\.10.*2\.9\.1"):
        data_parallel._fsdp_replicate()


def test_strided_shard_guard_only_when_a_packed_projection_is_split(monkeypatch):
    monkeypatch.setattr(tensor_parallel, "_StridedShard", None)
    assert tensor_parallel.Conv1DColwise()._placement(1) == tensor_parallel.Shard(1)
    with pytest.raises(UsageError, match="_StridedShard"):
        tensor_parallel.Conv1DColwise(fused=3)._placement(1)


def test_pipeline_schedule_gets_contiguous_micro_batches():
    """torch 2.11's PipelineStage checks each micro-batch's strides against the contiguous shapes it inferred, and
    a loop's inputs and targets are slices of one token tensor ([:, :-1], [:, 1:]): the schedule must get copies
    that are contiguous (on 2.11 the pp cases of tests/test_parallel_equivalence.py failed with a stride mismatch,
    (17, 1) against (16, 1))."""
    from types import SimpleNamespace

    from tightfit.parallel.parallelize import ParallelModel

    seen = []

    class Schedule:
        def step(self, *args, target=None, losses=None):
            seen.extend(t.is_contiguous() for t in (*args, target) if t is not None)
            if losses is not None:
                losses.append(torch.tensor(1.0))

    tokens = torch.arange(4 * 17).view(4, 17)
    x, y = tokens[:, :-1], tokens[:, 1:]
    assert not x.is_contiguous() and not y.is_contiguous()
    for rank, last in ((0, False), (1, True)):
        model = type("Stage", (ParallelModel,), {"pp_rank": rank, "has_loss": last})(
            module=torch.nn.Identity(), plan=SimpleNamespace(pp_microbatches=2), mesh=None, schedule=Schedule())
        model.forward_backward(x, y)
    assert seen == [True, True]
