"""Regression: training steps of a wrapped model must not accumulate autograd graph objects.

A backward hook whose closure held the autograd nodes it was stored on formed a cycle through C++ that Python's
garbage collector cannot break; each step leaked part of its graph (~1.3 MB RSS per step on the default GPT).
"""

from __future__ import annotations

import gc

import torch

import tightfit
from tightfit import Placement
from tightfit.models.gpt import GPT, GPTConfig


def _graph_objects() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__.endswith("Backward0"))


def test_steps_leave_no_graph_behind(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
    placement = Placement.everywhere("nvme", nvme_dir=str(tmp_path)).with_units(
        root=tightfit.UnitPlacement())  # a mixed placement: root on the device, blocks on NVMe
    tightfit.wrap(model, placement)
    opt = tightfit.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
        model(x, torch.roll(x, -1, 1)).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    for i in range(3):
        step(i)
    before = _graph_objects()
    for i in range(20):
        step(i)
    assert _graph_objects() == before
