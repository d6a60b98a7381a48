"""torchrun worker for tests/test_parallel_offload.py's gloo averager test: 2 ranks average a unit's gradients through
the flat buffer ([Note: gloo through a flat buffer of our own] in tightfit/parallel/replicas.py) and through gloo's
coalesced call, reduce them to one rank (ZeRO-2), and sum the ranks' gradient norms as a zero2 clip does; rank 0
prints what it found as JSON."""

from __future__ import annotations

import json
from types import SimpleNamespace

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
# ZeRO-2: the unit's mean reduced to its owner (rank 1) alone, the flat's bits; rank 0's left as they were
flat.owner_of = lambda name: 1 if name == "blocks.0" else None
reduced = [t.clone() for t in unit]
flat(reduced, "blocks.0")()
mine = all(torch.equal(a, b) for a, b in zip(reduced, through_flat if rank == 1 else unit))
ok = torch.tensor([1.0 if mine else 0.0])
dist.all_reduce(ok, op=dist.ReduceOp.MIN)
# the norms a zero2 clip sums: each rank its own units' and zeros for the others'; a unit every rank holds (a tile of
# a module no block contains) counted once
from tightfit.parallel.sharded_optimizer import UnitOwners  # noqa: E402

owners = UnitOwners(SimpleNamespace(units={}, separate=False), {"root": 0, "blocks.0": 1},
                    SimpleNamespace(owner_of=None), group, "zero2")
held = [SimpleNamespace(name=n) for n in ("root", "blocks.0", "lm_head.tiles.0")]
local = [torch.tensor(3.0), torch.tensor(0.0), torch.tensor(5.0)] if rank == 0 else \
    [torch.tensor(0.0), torch.tensor(4.0), torch.tensor(5.0)]
norms = [float(n) for n in owners.norms_over_ranks(local, held)]
if rank == 0:
    print(json.dumps({
        "reduced_to_owner": bool(ok.item()), "norms": norms,
        "flat": flat.through_flat,
        "mean": all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(through_flat, expected)),
        "bitwise_as_coalesced": all(torch.equal(a, b) for a, b in zip(through_flat, through_coalesced)),
        "shapes": [list(t.shape) for t in through_flat] == [list(t.shape) for t in unit],
        "kept": len(flat._free), "reused": flat._free[0] is first_buffer,
        "bytes": flat.bytes}))
dist.destroy_process_group()
