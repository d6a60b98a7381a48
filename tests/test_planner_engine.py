"""The planner's placement, run by the real engine on CPU: budgets hold in measurement, bytes match the prediction.

Memory is checked with arithmetic against the engine's own counters (not RSS, which other tests' processes and the
allocator blur); step time is not checked here (benchmarks/bench_planner.py does, on a quiet machine).
"""

from __future__ import annotations

import pytest
import torch

import tightfit
from tightfit.config import Config
from tightfit.models.gpt import GPT, GPTConfig
from tightfit.offload.engine import engine_of
from tightfit.offload.placement import Tier
from tightfit.optim import AdamW
from tightfit.planner import HardwareProfile, make_plan
from tightfit.planner.costs import engine_device_bytes
from tightfit.planner.hardware import GiB

CPU = HardwareProfile.synthetic(cuda=False, device_name="cpu", gpu_total=0, gpu_free=0, host_total=8 * GiB,
                                host_available=6 * GiB, h2d_bw=5e9, d2h_bw=5e9, mem_bw=10e9,
                                runtime_rss=300 * 2**20, device_adam_rate=1e9, matmul_flops={128: 20e9, 1024: 60e9})


@pytest.mark.parametrize("setting", ["memory", "host-limited", "nvme-heavy"])
def test_plan_runs_within_budgets(setting, tmp_path):
    gcfg = GPTConfig(n_layer=8, n_embd=64, n_head=4, block_size=32)
    cfg = Config()
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.device = 4, 32, "cpu"
    with torch.device("meta"):
        meta = GPT(gcfg)
    if setting != "memory":
        # blocks are ~50k params: 0.8 MiB of 16-byte state each (7 MiB in all); the host must hold one optimizer
        # working set (1 MiB)
        cfg.memory.gpu_mem, cfg.memory.cpu_mem, cfg.memory.nvme = "4MiB", "5MiB", f"{tmp_path}:1GiB"
    if setting == "nvme-heavy":
        # Every state on NVMe with a roomy host pool (tests/test_offload_tight_host.py covers a tight one).
        cfg.memory.offload, cfg.memory.cpu_mem = "nvme", None
    plan = make_plan(meta, cfg, CPU)
    if setting == "nvme-heavy":
        assert plan.placement.uses(Tier.NVME)
    torch.manual_seed(0)
    model = GPT(gcfg)
    tightfit.wrap(model, plan.placement, device="cpu")
    opt = AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (4, 32))
    for _ in range(2):
        model(x, x).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    eng = engine_of(model)
    assert list(eng.units) == [u.name for u in plan.profile.units], "the engine forms the planner's units"
    if setting == "nvme-heavy":  # 8 blocks of 0.2 MB on NVMe: joined in pairs (planner/unit_size.py)
        assert len(eng.units) == 5 and plan.placement.min_unit_bytes
    rep = eng.memory_report()
    device = rep["device"]["peak"]  # device-tier states + materialised units + pending grads
    host = rep["host"]["tier"] + rep["host"]["staging_peak"]
    pr = plan.prediction
    if cfg.memory.offload == "auto" and plan.budgets["device"] is not None:
        assert device <= plan.budgets["device"]
        assert host <= plan.budgets["host"]
    assert rep["nvme"]["bytes"] <= (plan.budgets["nvme"] or 0) or not plan.placement.uses(Tier.NVME)
    assert device == pytest.approx(engine_device_bytes(pr.breakdown), rel=0.10)
    # The host figure is the staging pool's peak, which depends on timing: whether the previous unit's write-back
    # has finished when the optimizer's read-ahead takes buffers for the next unit. The prediction assumes it has;
    # one more unit's working set in flight is the engine's worst case.
    working_set = max(u.step_bytes for u in eng.units.values())
    assert pr.peak["host"] * 0.9 - 64 * 1024 <= host <= pr.peak["host"] + working_set
    assert rep["nvme"]["bytes"] == pytest.approx(pr.peak["nvme"], rel=0.10, abs=64 * 1024)
    eng.close()
