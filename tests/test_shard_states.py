"""ShardStatesAdamW (tightfit/parallel/shard_states.py) on FSDP2's ZeRO-3 shards, 2 gloo ranks: every local shard,
moment and step count equal to `torch.optim.AdamW(fused=True)` on the same shards bit for bit, with each unit's
moments in host memory, in the rank's own swap files, or split between them (the first unit's in memory, the rest on
the disk), clipped by the global norm; with some units kept on the device (`:split`: FSDP2 offloads the others,
their moments in device memory, stepped by `step()` itself); the steps running on their own
thread under the next forward (the strict mode's delays make forwards arrive first: without the pre-hook that
orders FSDP2's all-gather after the unit's step, the weights differ); resumed from a gathered checkpoint halfway, the
same bits again; no swap file left after `close`. And `tightfit train`'s parallel transform (trainee.shard) with
FSDP2's CPU offload and `--nvme`: the moments in the rank's own swap folder past the rank's host budget (a file a
unit there; none with room for all), the folder removed after `close`."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from parallel_launch import ROOT, free_port, rank_env


def _run_worker(nproc: int, cases: list[str]) -> dict[str, re.Match]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           "--max-restarts=0", "--monitor-interval=1", str(ROOT / "tests" / "shard_states_worker.py"), *cases]
    proc = subprocess.run(cmd, env=rank_env(TIGHTFIT_STRICT_MOVER="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " FAIL " not in out, out[-3000:]
    lines = {m.group(1): m for m in re.finditer(r"CASE (\S+) OK exposed=([\d.]+) files=(\d+) in_backward=(\d+)",
                                                 out)}
    assert sorted(lines) == sorted(c for c in cases if not c.startswith("trainee")), out[-3000:]
    assert all(f"CASE {c} OK" in out for c in cases if c.startswith("trainee")), out[-3000:]
    return lines


def test_shard_states_equal_torch_fused_adamw_on_fsdp2_shards():
    lines = _run_worker(2, ["host", "nvme", "mixed", "host:resume", "nvme:resume", "mixed:resume", "host:offload",
                            "nvme:offload:resume", "mixed:early", "mixed:split", "nvme:split:resume",
                            "mixed:split:early", "trainee", "trainee:roomy", "trainee:early"])
    # without a clip each unit steps as FSDP2 hands it its reduce-scattered gradients: 4 units x 6 steps
    assert int(lines["mixed:early"].group(4)) == 24 and int(lines["host"].group(4)) == 0
    # the root and a block kept on the device (FSDP2 offloads the other two): stepped by `step()`, not in backward
    assert int(lines["mixed:split:early"].group(4)) == 12 and int(lines["nvme:split:resume"].group(3)) == 2
    # some forward waited for its unit's step (the strict mode's delays; a loaded machine may hide one case's)
    assert sum(float(m.group(2)) for m in lines.values()) > 0, "no forward waited: the pre-hook was not exercised"
    # a file per unit on the disk: root and 3 blocks; the root's moments in host memory when they fit its room
    assert [int(lines[t].group(3)) for t in ("host", "nvme", "mixed")] == [0, 4, 3]


@pytest.mark.cuda
def test_a_world_of_one_on_a_gpu_with_fsdp2_cpu_offload():
    """One GPU, a process group of one (NCCL): FSDP2 gathers the host shards to the GPU for each use and sends the
    gradients back, the steps run on the host's shards; with a split, the kept units' shards, moments and steps on
    the GPU; equal to torch's fused AdamW on the same shards."""
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    _run_worker(1, ["host:offload", "nvme:offload", "host:offload:resume", "mixed:split", "nvme:split:resume"])


# ---- one process: the optimizer alone over a plain module (one unit) -------------------------------------------

from concurrent.futures import Future  # noqa: E402

from tightfit.offload.placement import Tier  # noqa: E402
from tightfit.offload.runtime.futures import done_future  # noqa: E402
from tightfit.offload.tiers.stores import MemoryStore  # noqa: E402
from tightfit.parallel.shard_states import ShardStatesAdamW, fsdp_units  # noqa: E402


class _FlakyDisk(MemoryStore):
    """A disk tier kept in memory whose writes fail from the `fail_from`-th on, as a full or dying disk's do."""

    tier = Tier.NVME

    def __init__(self, fail_from: int) -> None:
        super().__init__(Tier.NVME, torch.device("cpu"))
        self.tier, self.saves, self.fail_from = Tier.NVME, 0, fail_from

    def save(self, unit, entry, src, *, start=None):
        self.saves += 1
        if self.saves >= self.fail_from:
            bad = Future()  # as the NVMe store's writes fail: on their future
            bad.set_exception(OSError(28, "No space left on device"))
            return bad
        super().save(unit, entry, src, start=start)
        return done_future()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train(model, opt, steps: int) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(6, 8, generator=g)
        model(x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("disk", [False, True])
def test_one_unit_equals_torch_fused_adamw_bitwise(disk):
    ref, mine = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    host = MemoryStore(Tier.HOST, torch.device("cpu"))
    opt = ShardStatesAdamW([{"params": list(mine.parameters())}], fsdp_units(mine), host,
                           _FlakyDisk(fail_from=10**9) if disk else None, lr=1e-2)
    _train(ref, ref_opt, 5)
    _train(mine, opt, 5)
    opt.wait()
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(a, b)
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ref_opt.state[a][k], opt.state.get(b)[k])
    opt.close()


def test_a_failed_write_of_the_moments_is_raised_not_read_back_stale():
    model = _model()
    opt = ShardStatesAdamW([{"params": list(model.parameters())}], fsdp_units(model),
                           MemoryStore(Tier.HOST, torch.device("cpu")), _FlakyDisk(fail_from=3), lr=1e-2)
    _train(model, opt, 1)  # saves 1 and 2: the first step's moments
    with pytest.raises(OSError, match="No space left"):
        _train(model, opt, 2)  # the second step's saves fail; the next forward or `wait` hears of it
        opt.wait()


def test_units_step_during_the_backward_as_their_gradients_arrive():
    """No clip: `step_during_backward` queues each unit once its parameters' gradients are final, before `step()`;
    the result is torch's fused AdamW's to the bit."""
    ref, mine = _model(), _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    units = [("first", mine[0], list(mine[0].parameters())), ("last", mine[2], list(mine[2].parameters()))]
    opt = ShardStatesAdamW([{"params": list(mine.parameters())}], units, MemoryStore(Tier.HOST, torch.device("cpu")),
                           _FlakyDisk(fail_from=10**9), host_room=0, lr=1e-2)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        x = torch.randn(6, 8, generator=g)
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.step_during_backward()
        mine(x).square().mean().backward()
        assert all(u.pending is not None and u.arrived == 2 for u in opt.units)  # queued before `step()`
        opt.step()
        opt.zero_grad(set_to_none=True)
        opt.wait()
        for u in opt.units:
            u.pending = None
    assert opt.counters()["units_stepped_in_backward"] == 8
    for a, b in zip(ref.parameters(), mine.parameters()):
        assert torch.equal(a, b)
    opt.close()
