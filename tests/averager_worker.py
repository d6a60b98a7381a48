"""torchrun worker for tests/test_parallel_offload.py's gloo averager test: 2 ranks average a unit's gradients through
the flat buffer ([Note: gloo through a flat buffer of our own] in tightfit/parallel/replicas.py) and through gloo's
coalesced call, and rank 0 prints what it found as JSON."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from tightfit.parallel.replicas import GradientAverager

dist.init_process_group("gloo")
rank = dist.get_rank()
group = dist.new_group(backend="gloo")
g = torch.Generator().manual_seed(rank)
unit = [torch.randn(64, 48, generator=g), torch.randn(48, generator=g), torch.randn(3, 5, 7, generator=g)]
gathered = [[torch.empty_like(t) for t in unit] for _ in range(2)]
for i, t in enumerate(unit):
    dist.all_gather([gathered[0][i], gathered[1][i]], t)
expected = [(a + b) / 2 for a, b in zip(*gathered)]

flat = GradientAverager(group, 2)
through_flat = [t.clone() for t in unit]
flat(through_flat)()
first_buffer = flat._free[0]
again = [t.clone() for t in unit]
flat(again)()
coalesced = GradientAverager(group, 2)
coalesced.through_flat = False
through_coalesced = [t.clone() for t in unit]
coalesced(through_coalesced)()
if rank == 0:
    print(json.dumps({
        "flat": flat.through_flat,
        "mean": all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(through_flat, expected)),
        "bitwise_as_coalesced": all(torch.equal(a, b) for a, b in zip(through_flat, through_coalesced)),
        "shapes": [list(t.shape) for t in through_flat] == [list(t.shape) for t in unit],
        "kept": len(flat._free), "reused": flat._free[0] is first_buffer,
        "bytes": flat.bytes}))
dist.destroy_process_group()
