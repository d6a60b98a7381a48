"""One rank of tests/test_params_exchange.py: ZeRO-3 over the offload engine (tightfit/parallel/params_exchange.py)
against plain PyTorch on the global batch, with the blocks called in an order that changes from step to step and a
no-grad evaluation between steps. Usage: params_exchange_worker.py TIER SWAP_FOLDER STEPS."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import tightfit
from tightfit import Placement, Tier
from tightfit.offload.step.engine import engine_of
from tightfit.optim import AdamW
from tightfit.parallel.params_exchange import exchange_params
from tightfit.parallel.replicas import average_over_ranks
from tightfit.parallel.sharded_optimizer import UnitOwners, shard_setup

WIDTH, VOCAB = 24, 32
ORDERS = ([0, 1, 2, 3], [3, 1, 0, 2], [0, 1, 2, 3], [2, 3, 1, 0])
"""Each step's order of the blocks (every rank's alike): every other step is not the order the last phase recorded,
so the uses asked for ahead are dropped and asked for again."""


class Stack(nn.Module):
    """Embedding, four residual blocks called in a given order, a head: a plain module with a block stack."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU())
                                    for _ in range(4))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, order: list[int]) -> torch.Tensor:
        h = self.embed(x)
        for i in order:
            h = h + self.blocks[i](h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), x.roll(-1, 1).flatten())


def main() -> None:
    tier, swap, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Stack()
    plain = copy.deepcopy(model)
    owner, elsewhere = shard_setup(model, rank, world, "zero3")
    placement = Placement.everywhere(Tier(tier), nvme_dir=os.path.join(swap, f"rank-{rank}"),
                                     stepped_elsewhere=sorted(elsewhere), grads_elsewhere=True,
                                     exchanged=sorted(owner))
    tightfit.wrap(model, placement)
    engine = engine_of(model)
    for unit in engine.units.values():  # another rank's units: no params, master, moments or gradients here
        held = {e for entries in unit.entries().values() for e in entries}
        assert (not held) == (unit.name in elsewhere), (unit.name, held)
        assert unit.exchanged == (unit.name in owner)
    averager = average_over_ranks(engine)
    UnitOwners(engine, owner, averager, dist.new_group(backend="gloo"), "zero3")  # the clip's norms over the ranks
    exchange = exchange_params(engine, owner, dist.new_group(backend="gloo"))
    opt = AdamW(model.parameters(), lr=1e-2)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    worst = 0.0
    for step in range(steps):
        order = ORDERS[step % len(ORDERS)]
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (2 * world, 8), generator=g)
        loss = model(x[2 * rank:2 * rank + 2], order)
        loss.backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        plain_loss = plain(x, order)
        plain_loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        plain_opt.step()
        plain_opt.zero_grad()
        worst = max(worst, abs(float(mean) - float(plain_loss)) / float(plain_loss))
        with torch.no_grad():  # an evaluation between steps: a forward phase of its own, in yet another order
            evaluated = model(x[:2], order[::-1])
            assert torch.allclose(evaluated, plain(x[:2], order[::-1]), rtol=1e-5), step
    uses, broadcasts = exchange.uses, exchange.broadcasts
    # a device apart from host memory (the GPU's code path) crosses through a wire of its own, as NCCL's device
    # tensors do, charged to the device meter ([Note: the wire's device buffer] in tightfit/parallel/wire.py)
    wire = exchange.wire.buffer
    assert (wire is not None) == engine.separate, (wire, engine.separate)
    if wire is not None:
        assert wire.numel() == max(engine.units[n].spec.numel for n in owner)
        assert engine.device_peak >= wire.numel() * wire.element_size()
    engine.close()
    assert worst <= 1e-5, worst
    # every use of an exchanged unit crossed: root once a forward, each block in forward and backward, and in the
    # evaluations' forwards
    blocks = sum(1 for name in owner if name != "root")
    assert uses == steps * (1 + 2 * blocks) + steps * (1 + blocks), uses
    assert broadcasts >= uses, (broadcasts, uses)  # and what was asked for ahead of a use that did not come
    print(f"[rank {rank}] OK worst relative loss difference {worst:.2e}, {uses} uses, {broadcasts} broadcasts",
          flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
