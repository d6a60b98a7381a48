"""The gradients' average over replicas in a rank's predicted step ([Note: the gradients' average in the step] in
planner/averaging.py; tightfit/parallel/links.py). Synthetic hardware, models on meta: no group, no measurement."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tightfit.parallel.links import Averaging, assumed
from tightfit.planner import make_plan
from tightfit.planner.averaging import GLOO_BESIDE_A_STEP, allreduce_bytes

from test_planner import CPU, GPU, cfg, meta_gpt


def _cfg(order: str, accum: int = 4, offload: str = "host"):
    c = cfg(offload=offload, accumulation=order)
    c.train.grad_accum = accum
    return c


@pytest.mark.parametrize("order", ["micro", "unit"])
def test_on_a_cpu_the_average_adds_its_bytes_at_the_rate_beside_a_step(order):
    """CPU ranks: gloo runs on the cores the step computes on, so the average adds to phase A at GLOO_BESIDE_A_STEP
    of the bus bandwidth; its bytes are every fp32 gradient once per pass (4 in micro-batch-major order, 1 in
    unit-major)."""
    model, c = meta_gpt(), _cfg(order)
    one = make_plan(model, c, CPU)
    two = make_plan(model, c, CPU, averaging=Averaging(2, 1e9, "assumed for a test"))
    trainable = sum(p.numel() for p in model.parameters())
    nbytes = allreduce_bytes(two.profile, two.shape)
    assert nbytes == trainable * 4 * (4 if order == "micro" else 1)
    expected = nbytes / 1e9 / GLOO_BESIDE_A_STEP  # 2(n-1)/n = 1 for 2 ranks
    assert two.prediction.allreduce_s == pytest.approx(expected)
    assert two.prediction.step_s == pytest.approx(one.prediction.step_s + expected)
    assert one.prediction.allreduce_s == 0
    four = make_plan(model, c, CPU, averaging=Averaging(4, 1e9, "assumed for a test"))
    assert four.prediction.allreduce_s == pytest.approx(1.5 * expected)  # a ring sends 2(n-1)/n of the bytes
    text = two.table()
    assert "gradients averaged over 2 ranks" in text and "1.00 GB/s bus bandwidth (assumed for a test)" in text
    # gloo's flat buffers (parallel/replicas.py): the largest unit's gradients, one per average in flight (two where
    # the device is apart from host memory, as this suite's strict mover makes it), in the rank's RSS
    from tightfit.offload.device_kind import separate_memory

    buffer = max(u.trainable for u in two.profile.units) * 4 * (2 if separate_memory("cpu") else 1)
    assert two.prediction.allreduce_buffer == buffer and one.prediction.allreduce_buffer == 0
    assert two.prediction.rss(False) == one.prediction.rss(False) + buffer
    assert "of all-reduce buffers" in text


def test_the_average_makes_the_planner_sum_micro_batches_on_the_device():
    """Micro-batch-major order averages every micro-batch's gradients, unit-major order once a step: on a 2-core
    machine (the unit-major forwards' threads at one core's speed) one process keeps micro-batch-major order, a rank
    of two takes unit-major order, and says why in numbers."""
    model, c = meta_gpt(), _cfg("auto", accum=8)
    c.train.micro_batch, c.train.seq_len = 2, 32
    two_cores = replace(CPU, threads=2)
    alone = make_plan(model, c, two_cores)
    assert alone.accumulation == "micro", alone.reasons[0]
    rank = make_plan(model, c, two_cores, averaging=Averaging(2, 1.5e9, "assumed for a test"))
    assert rank.accumulation == "unit", rank.reasons[0]
    assert rank.reasons[0].startswith("accumulation: unit-major") and "averaged over the 2 ranks once" in \
        rank.reasons[0]


def test_on_a_gpu_the_backward_hides_the_average_but_not_its_tail_and_pcie_shares_the_link():
    """NCCL runs beside the backward: what it adds is the root's average after the backward ends (and whatever the
    backward is too short to hide); over PCIe it queues with the offload's copies instead."""
    model, c = meta_gpt(), _cfg("micro", offload="host")
    one = make_plan(model, c, GPU)
    nvlink = make_plan(model, c, GPU, averaging=assumed(8, "nvlink", cuda=True))
    plan = nvlink.prediction
    root = sum(u.trainable for u in nvlink.profile.units if u.name == "root")
    tail = 2 * 7 / 8 * root * 4 / nvlink.shape.allreduce_bw
    assert plan.allreduce_s == pytest.approx(tail)  # the blocks' averages are hidden by the backward
    # a longer phase A leaves the CPU optimizer less to do after it: the step grows by no more than the tail
    assert one.prediction.step_s <= plan.step_s <= one.prediction.step_s + tail * (1 + 1e-9)
    pcie = make_plan(model, c, GPU, averaging=assumed(8, "pcie", cuda=True))
    assert pcie.shape.allreduce_on_link
    whole = 2 * 7 / 8 * allreduce_bytes(pcie.profile, pcie.shape) / pcie.shape.allreduce_bw
    # the average's bytes queue behind the copies': the link becomes the bottleneck, and phase A is longer than
    # with the same average on lanes of its own
    apart = make_plan(model, c, GPU, averaging=replace(assumed(8, "pcie", cuda=True), on_link=False))
    assert pcie.prediction.bottleneck == "host<->device"
    assert pcie.prediction.phase_a_s > apart.prediction.phase_a_s >= whole
    assert pcie.prediction.step_s > nvlink.prediction.step_s
    assert "assumed for pcie" in pcie.table()


def test_one_rank_plans_as_before():
    model, c = meta_gpt(), _cfg("micro")
    base = make_plan(model, c, CPU)
    same = make_plan(model, c, CPU, averaging=Averaging(1, 1e9, "one"))
    assert same.prediction.step_s == base.prediction.step_s and same.shape == base.shape
    assert replace(base.shape).ranks == 1


def test_the_ranks_of_a_node_share_its_disk_and_on_a_gpu_its_cpu(tmp_path):
    """8 ranks on one node each get an eighth of the swap disk's rates and, on a GPU machine, of the CPU optimizer's:
    a rank's plan of its step prices its share ([Note: a node's ranks share it] in planner/averaging.py); the same
    8 ranks over 8 nodes (one each) have the whole disk and CPU."""
    model, c = meta_gpt(), _cfg("micro", offload="nvme")
    c.memory.nvme = f"{tmp_path}:1GiB"
    spread = make_plan(model, c, GPU, averaging=assumed(8, "nvlink", cuda=True, node_ranks=1)).prediction
    packed = make_plan(model, c, GPU, averaging=assumed(8, "nvlink", cuda=True, node_ranks=8)).prediction
    assert packed.nvme_s == pytest.approx(8 * spread.nvme_s)
    assert packed.optim_s == pytest.approx(8 * spread.optim_s)
    assert packed.step_s > spread.step_s
    cpu_spread = make_plan(model, c, CPU, averaging=Averaging(2, 1e9, "t", node_ranks=1)).prediction
    cpu_packed = make_plan(model, c, CPU, averaging=Averaging(2, 1e9, "t", node_ranks=2)).prediction
    assert cpu_packed.nvme_s == pytest.approx(2 * cpu_spread.nvme_s)
    assert cpu_packed.optim_s == pytest.approx(cpu_spread.optim_s)  # the ranks' --threads divide a CPU's cores
