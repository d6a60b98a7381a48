"""One rank's plan among several: its share of the node's memory and swap disk, and `tightfit plan`'s report of it.

Why apart from the replicas: the same plan is made for a run's rank (replicas.py, `replicate`, before its engine is
set up) and for hardware that is not here (`tightfit plan --nproc-per-node N --strategy ddp|zero1|zero2 --offload
host|nvme`); this is what a rank's share is ([Note: a node's ranks share it] in planner/averaging.py) and how its
plan is printed.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import psutil
import torch

from tightfit.parallel.replicas import RANK_FOLDER


def local_ranks() -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def rank_config(cfg, rank: int, local: int | None = None, available: int | None = None, folder: bool = True):
    """`cfg` as rank `rank`'s engine plans with: its share of the node's host memory (`available`: the node's, else
    this machine's now) unless `--cpu-mem` gives a rank's own, and of the swap disk (`--nvme`'s size, else its free
    space), in a swap folder of its own (`folder`; False: the folder as given, for a plan of hardware that is not
    here). `local`: the ranks on the node (else LOCAL_WORLD_SIZE). Returns (cfg, the rank's swap folder or None)."""
    from tightfit.config import parse_nvme
    from tightfit.planner.hardware import free_bytes

    local = local or local_ranks()
    mine = copy.deepcopy(cfg)
    swap = None
    if cfg.memory.nvme:
        path, size = parse_nvme(cfg.memory.nvme)
        share = (size if size is not None else free_bytes(path)) // local
        swap = Path(path) / RANK_FOLDER.format(rank)
        mine.memory.nvme = f"{swap if folder else path}:{share}B"
    if cfg.memory.cpu_mem is None:  # the node's ranks share its memory: each plans with its part
        node = available if available is not None else psutil.virtual_memory().available
        mine.memory.cpu_mem = f"{node // local}B"
    return mine, swap


def rank_plan(cfg, hw=None) -> tuple[object, dict]:
    """`tightfit plan --nproc-per-node N --strategy ddp --offload host|nvme`: the plan of one rank (every rank's is
    alike), made for its share of the node (`rank_config`) on `hw` (None: this machine), its step priced with the
    gradients' average at the bus bandwidth `--interconnect` names (links.py: assumed; CPU ranks: gloo on one
    machine), and what that average sends per step (a ring all-reduce sends 2(n-1)/n of its bytes)."""
    from tightfit.parallel.links import assumed
    from tightfit.planner import make_plan
    from tightfit.planner.averaging import allreduce_bytes, exchange_bytes
    from tightfit.train.loop import build_meta_model

    p = cfg.parallel
    ranks = p.nproc_per_node * p.nnodes
    mine, _ = rank_config(cfg, 0, local=p.nproc_per_node, available=hw.host_available if hw is not None else None,
                          folder=False)
    model = build_meta_model(mine)
    cuda = hw.cuda if hw is not None else torch.cuda.is_available()
    averaging = assumed(ranks, p.interconnect, cuda and cfg.train.device != "cpu", p.nproc_per_node)
    strategy = p.strategy if p.strategy in ("zero1", "zero2", "zero3") else "ddp"
    shares = None  # the parameters each rank steps
    if strategy != "ddp":  # rank 0's units; every rank steps a share as alike as the units allow
        from tightfit.offload.step.units import find_units
        from tightfit.parallel.sharded_optimizer import shard_averaging

        owner, averaging = shard_averaging(model, 0, ranks, strategy, averaging)
        trainable = {s.name: s.train_numel for s in find_units(model)}
        shares = [sum(trainable[name] for name, r in owner.items() if r == k) for k in range(ranks)]
    plan = make_plan(model, mine, hw, what_if=hw is not None, averaging=averaging)
    averaged = allreduce_bytes(plan.profile, plan.shape)
    path = None  # zero3: FSDP2's all-gathers or the exchange ([Note: two ZeRO-3s with the offload])
    if strategy == "zero3":
        from tightfit.parallel.plan import plan_from_config
        from tightfit.parallel.zero3_path import choose, price

        fsdp2 = price(cfg, model, plan_from_config(p, ranks, cfg.memory.offload), plan, averaging.bus_bw, cuda) \
            if cfg.memory.offload == "host" else None
        chosen, why = choose(p.zero3_params, cfg.memory.offload, fsdp2, plan.prediction.step_s)
        path = {"runs": chosen, "why": why, "exchange_step_s": plan.prediction.step_s,
                "fsdp2": fsdp2.to_dict() if fsdp2 is not None else None}
    return plan, {"ranks": ranks, "strategy": strategy, "engine": True, "cpu_mem_per_rank": mine.memory.cpu_mem,
                  "nvme_per_rank": mine.memory.nvme, "allreduce_bytes_per_step": averaged,
                  # a ring all-reduce sends 2(n-1)/n of its bytes, zero2/3's reduce to each unit's rank (n-1)/n
                  "sent_bytes_per_step_per_rank": int((1 if strategy in ("zero2", "zero3") else 2) * (ranks - 1) / ranks
                                                      * averaged),
                  "allreduce_times_per_step": plan.shape.passes, "allreduce_bus_bw": averaging.bus_bw,
                  "allreduce_bw_source": averaging.source, "allreduce_s": plan.prediction.allreduce_s,
                  "order": "unit" if plan.shape.unit_major else "micro",
                  "exchange_bytes_per_step": exchange_bytes(plan.profile, plan.shape),
                  "stepped_parameters_per_rank": shares,
                  "exchange_s": plan.prediction.exchange_s, "zero3_path": path}


def rank_plan_text(plan, ranks: dict) -> str:
    from tightfit.utils.sizes import format_size, parse_size

    host = format_size(parse_size(ranks["cpu_mem_per_rank"]))
    disk = ""
    if ranks["nvme_per_rank"]:
        path, _, size = ranks["nvme_per_rank"].rpartition(":")
        disk = f", {format_size(parse_size(size))} of the swap disk in {path}/{RANK_FOLDER.format(0)}..."
    once = "once a step (unit-major order)" if ranks["order"] == "unit" else \
        f"once per micro-batch ({ranks['allreduce_times_per_step']} a step, micro-batch-major order)"
    from tightfit.planner.plan import sharded_states

    held = sharded_states(plan.profile)
    whose = "every rank's plan is this one" if ranks["strategy"] == "ddp" else \
        f"rank 0's plan (each rank steps its own units and holds their {held} alone)"
    sent = ("each use's parameters broadcast by their rank beside the compute" if ranks["strategy"] == "zero3" else
            "the stepped units' new values broadcast by their ranks beside the next forward")
    exchange = "" if not ranks["exchange_bytes_per_step"] else (
        f"\n{sent}: {format_size(ranks['exchange_bytes_per_step'])} a step, {ranks['exchange_s'] * 1e3:.1f} ms added "
        "to the step")
    how = "reduced to each unit's rank" if ranks["strategy"] in ("zero2", "zero3") else "ring all-reduce"
    if ranks["stepped_parameters_per_rank"]:  # rank 0's plan above; another rank may step more
        shares = ranks["stepped_parameters_per_rank"]
        exchange += (f"\nparameters each rank steps and holds the {held} of: " + " / ".join(f"{n:,}" for n in shares)
                     + f" (rank 0's is {shares[0] / max(shares):.0%} of the largest)")
    path = ranks.get("zero3_path")
    if path is not None:
        from tightfit.parallel.zero3_path import describe

        f = path["fsdp2"]
        if f is not None:
            exchange += (f"\nFSDP2's ZeRO-3 instead (every rank's shards in its host memory): a "
                         f"{f['step_s'] * 1e3:,.0f} ms step (compute {f['compute_s'] * 1e3:,.0f} ms; all-gathers and "
                         f"reduce-scatters {f['collectives_s'] * 1e3:,.0f} ms, host link {f['link_s'] * 1e3:,.0f} ms, "
                         f"the CPU's AdamW {f['optimizer_s'] * 1e3:,.0f} ms), {format_size(f['host_bytes'])} of host "
                         f"memory a rank" + (f", {format_size(f['device_bytes'])} a GPU" if f["device_bytes"] else "")
                         + ("" if f["fits"] else " (does not fit)"))
        exchange += "\n" + describe(path["runs"], path["why"]).removeprefix("tightfit: ")
    return (f"{ranks['ranks']} ranks, strategy {ranks['strategy']}, the offload engine on each: {whose}, for "
            f"{host} of host memory{disk}\n{plan.table()}\n"
            f"gradients averaged over the ranks {once}: {format_size(ranks['allreduce_bytes_per_step'])} a step, "
            f"{format_size(ranks['sent_bytes_per_step_per_rank'])} sent by each rank ({how}) at "
            f"{ranks['allreduce_bus_bw'] / 1e9:.2f} GB/s bus bandwidth ({ranks['allreduce_bw_source']}): "
            f"{ranks['allreduce_s'] * 1e3:.1f} ms added to the predicted step{exchange}")
