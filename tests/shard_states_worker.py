"""torchrun worker for tests/test_shard_states.py: FSDP2 ZeRO-3 stepped by ShardStatesAdamW against the same FSDP2
shards stepped by `torch.optim.AdamW(fused=True)`, bit for bit.

Each rank builds the reference GPT twice from one seed, shards both with `fully_shard` (parallel/data_parallel.py's
apply_zero), trains both on the same batches with the same clip (the global norm over both ranks), one stepped by
torch's optimizer after the backward and one by ShardStatesAdamW (moments in host memory or in a swap folder of the
rank's own), and compares every local shard and moment exactly at the end: between steps only the forward's pre-hook
waits for them. `:early`: no clip, each unit
stepped during the backward as its gradients arrive (`step_during_backward`). `:offload`: the shards in host memory
(FSDP2's `CPUOffloadPolicy`; on a GPU machine the forward and backward on the GPU, the steps on the host). With
`:resume` the ShardStatesAdamW side is rebuilt halfway from a gathered checkpoint (tightfit/parallel/state.py) and
must go on bit for bit.
Rank 0 prints `CASE <tier> OK exposed=<s> files=<n>` (the seconds forwards waited for a step; the swap files seen
while training, none left after `close`); a mismatch raises.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from tightfit.models.gpt import GPT, GPTConfig
from tightfit.offload.placement import Tier
from tightfit.offload.tiers.stores import DiskStore, MemoryStore
from tightfit.parallel.data_parallel import apply_zero
from tightfit.parallel.mesh import build_mesh, init_distributed, leave_process
from tightfit.parallel.plan import parse_strategy
from tightfit.parallel.shard_states import ShardStatesAdamW, fsdp_units
from tightfit.parallel.state import gather_full_state, load_moments
from tightfit.parallel.tensor_parallel import distribute_like, full_tensor

STEPS, B, T, VOCAB, LR, WD, CLIP = 6, 8, 16, 64, 3e-3, 0.1, 0.5


KEPT = ("root", "blocks.1")
"""`:split`: the units whose shards stay on the device while the others' go to host memory."""


def build(mesh, offload: bool = False, kept=()):
    """The test GPT sharded by FSDP2 over `mesh` (on its device); `offload`: the shards in host memory
    (`CPUOffloadPolicy`, page-locked on a GPU), as `--strategy auto` shards a model whose states do not fit, but for
    the units named in `kept` (parallel/unit_split.py)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=3, n_head=4, n_embd=32, bias=False))
    return apply_zero(model.to(mesh.device_type), mesh, 3, cpu_offload=offload, kept=kept)


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def stores_for(tier: str, folder: Path, root_bytes: int) -> dict:
    """host: every unit's moments in host memory; nvme: every unit's on the disk; mixed: the root's (the first
    unit) in host memory, the blocks' on the disk."""
    host = MemoryStore(Tier.HOST, torch.device("cpu"))
    if tier == "host":
        return {"host": host}
    return {"host": host, "disk": DiskStore(str(folder)), "host_room": root_bytes if tier == "mixed" else None}


def make_opt(model, tier: str, folder: Path, kept=()) -> ShardStatesAdamW:
    """`kept`: units whose moments are in device memory, stepped by `step()` on the device."""
    units = fsdp_units(model)
    root_bytes = 8 * sum(p.to_local().numel() for p in units[0][2])
    device = MemoryStore(Tier.DEVICE, next(model.parameters()).device) if kept else None
    if kept:  # the units on the device hold their shards there (no CPU offload for them)
        on_device = {n for n, _, ps in units if all(p.to_local().device == device.device for p in ps)}
        assert on_device == set(kept) or device.device.type == "cpu", (on_device, kept)
    return ShardStatesAdamW(groups(model), units, **stores_for(tier, folder, root_bytes), lr=LR, betas=(0.9, 0.95),
                            device=device, resident=kept)


def train_step(model, opt, x, y, early: bool = False) -> None:
    """One step, clipped by the global norm; `early`: no clip, and ShardStatesAdamW told that each unit may step as
    its gradients arrive (`step_during_backward`, what trainee.Sharded does when --grad-clip is 0)."""
    if early and hasattr(opt, "step_during_backward"):
        opt.step_during_backward()
    loss = model(x, y)
    loss.backward()
    if not early:  # the global norm over the devices the gradients are on (a split's: the GPU's and the host's)
        by_device: dict = {}
        for p in model.parameters():
            if p.grad is not None:
                by_device.setdefault(p.grad.to_local().device, []).append(p)
        norms = [full_tensor(torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)).float().cpu()
                 for ps in by_device.values()]
        norm = torch.linalg.vector_norm(torch.stack(norms))
        for device, ps in by_device.items():
            torch.nn.utils.clip_grads_with_norm_(ps, CLIP, norm.to(device))
    opt.step()
    opt.zero_grad(set_to_none=True)


def compare(step: int, ref, ref_opt, mine, opt) -> None:
    opt.wait()
    for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), f"step {step}: {name} differs"
        st = opt.state.get(b)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_opt.state[a][k].to_local(), st[k].to_local()), f"step {step}: {name}.{k} differs"
        assert float(ref_opt.state[a]["step"]) == float(st["step"]), f"step {step}: {name}.step differs"


def run(tier: str, resume: bool, root: Path, offload: bool = False, early: bool = False, split: bool = False) -> str:
    rank = dist.get_rank()
    device = init_distributed().device  # CUDA where the process group is NCCL's (a GPU machine)
    mesh = build_mesh(parse_strategy("zero3", dist.get_world_size()).dims, device)["dp"]
    kept = KEPT if split else ()
    offload = offload or split
    ref, mine = build(mesh, offload, kept), build(mesh, offload, kept)
    ref_opt = torch.optim.AdamW(groups(ref), lr=LR, betas=(0.9, 0.95), eps=1e-8, fused=True)
    folder = root / f"{tier}-rank{rank}"
    opt = make_opt(mine, tier, folder, kept)
    files = 0
    g = torch.Generator().manual_seed(7)
    for s in range(STEPS):
        if resume and s == STEPS // 2:
            full = [gather_full_state(_Pm(mine, opt), opt)]
            dist.broadcast_object_list(full, src=0)
            opt.close()
            mine = build(mesh, offload, kept)
            with torch.no_grad():  # the checkpoint's weights, sliced like each shard
                for n, p in mine.named_parameters():
                    p.to_local().copy_(distribute_like(full[0][f"model.{n}"], p).to_local())
            opt = make_opt(mine, tier, root / f"{tier}-again-rank{rank}", kept)
            assert load_moments(_Pm(mine, opt), opt, full[0].__getitem__) > 0
        x = torch.randint(0, VOCAB, (B, T + 1), generator=g).to(device)
        xs, ys = x[:, :-1].chunk(dist.get_world_size())[rank], x[:, 1:].chunk(dist.get_world_size())[rank]
        train_step(ref, ref_opt, xs, ys, early)
        train_step(mine, opt, xs, ys, early)
        if tier != "host":
            files = max(files, len(list(folder.rglob("*.safetensors"))) if folder.exists() else 0)
    # Compared once at the end: between steps nothing waits but the forward's own pre-hook.
    compare(STEPS, ref, ref_opt, mine, opt)
    exposed, in_backward = opt.counters()["optimizer_exposed_s"], opt.counters()["units_stepped_in_backward"]
    opt.close()
    left = len(list(root.rglob("*.safetensors")))
    assert left == 0, f"{left} swap files left after close"
    return f"OK exposed={exposed:.4f} files={files} in_backward={in_backward}"


def run_trainee(root: Path, roomy: bool = False, early: bool = False) -> str:
    """`tightfit train`'s parallel transform (trainee.shard) for a plan with FSDP2's CPU offload, `--nvme` and a
    `--cpu-mem` that FSDP2's own shards fill: every unit's moments in the rank's own swap folder, the loop's calls
    (accumulate, clip_and_step, the checkpoint's gather), the folder gone after `close`."""
    from tightfit.config import Config
    from tightfit.parallel.plan import ParallelDims, ParallelPlan
    from tightfit.parallel.replicas import RANK_FOLDER
    from tightfit.parallel.trainee import shard
    from tightfit.parallel.world import GroupWorld

    cfg = Config()
    # 16 KiB: no host room past FSDP2's shards, every unit's moments on the disk; 1 GiB (roomy): every unit's in memory
    cfg.memory.nvme, cfg.memory.cpu_mem = str(root / "swap"), "1GiB" if roomy else "16KiB"
    cfg.optim.grad_clip = 0.0 if early else 1.0  # early: no clip, each unit steps in the last backward
    cfg.model.n_layer, cfg.model.n_embd, cfg.model.n_head, cfg.train.seq_len = 2, 32, 4, T
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=2, n_head=4, n_embd=32, bias=False))
    plan = ParallelPlan(ParallelDims(dp=dist.get_world_size()), "zero3", cpu_offload=True)
    world = GroupWorld(init_distributed())
    sharded = shard(model, cfg, world, plan, torch.float32, None, lambda line: None)
    assert isinstance(sharded.optimizer, ShardStatesAdamW), type(sharded.optimizer)
    folder = root / "swap" / RANK_FOLDER.format(dist.get_rank())
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randint(0, VOCAB, (2, T + 1), generator=g)
        sharded.accumulate([(x[:, :-1], x[:, 1:])])
        sharded.clip_and_step(cfg.optim.grad_clip)
    files = len(list(folder.rglob("*.safetensors")))
    assert files == (0 if roomy else 3), f"{files} swap files in {folder}: one a unit on the disk (root, 2 blocks)"
    groups_ = sharded.checkpoint_groups()
    assert dist.get_rank() != 0 or groups_, "rank 0 gathered nothing"
    counters = sharded.engine_counters()
    assert counters["units_stepped_in_backward"] == (9 if early else 0), counters  # 3 units x 3 steps
    sharded.close()
    assert not folder.exists(), f"{folder} left after close"
    return f"OK files={files} written={counters['nvme_write_bytes']:.0f}"


class _Pm:
    """What state.py asks of a ParallelModel: its module, the plan's pp degree, the optimizer's settle."""

    def __init__(self, module, opt) -> None:
        self.module, self.settle = module, opt.wait
        self.plan = parse_strategy("zero3", dist.get_world_size())


def main() -> None:
    env = init_distributed()
    root = Path(tempfile.mkdtemp(prefix="shard-states-"))
    try:
        for case in sys.argv[1:]:
            tier, *opts = case.split(":")
            line = run_trainee(root, "roomy" in opts, "early" in opts) if tier == "trainee" else run(
                tier, "resume" in opts, root, "offload" in opts, "early" in opts, "split" in opts)
            if env.rank == 0:
                print(f"[rank 0] CASE {case} {line}", flush=True)
    except BaseException as e:  # noqa: BLE001 - the test reads the line
        print(f"[rank {env.rank}] FAIL {type(e).__name__}: {e}", flush=True)
        leave_process(1)
    leave_process(0)


if __name__ == "__main__":
    main()
