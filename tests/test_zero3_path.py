"""Which ZeRO-3 runs `--strategy zero3 --offload host`: FSDP2's or the engine's exchange
(tightfit/parallel/zero3_path.py, [Note: two ZeRO-3s with the offload]). The choice by the predicted step, FSDP2's terms, the what-ifs either way, the
flag's one-line refusal; the runs of both paths against plain PyTorch are tests/test_parallel_offload.py's."""

from __future__ import annotations

import json

import pytest

from tightfit.parallel.zero3_path import FSDP2_BY, Fsdp2Step, choose


def _step(seconds: float, fits: bool = True) -> Fsdp2Step:
    return Fsdp2Step(seconds, 0.0, 0.0, 0.0, 0.0, 0, 0, fits)


def test_the_choice_is_the_faster_path_the_flag_or_the_exchange_where_fsdp2_cannot():
    assert choose("auto", "host", _step(0.5), 1.0)[0] == "fsdp2"
    assert choose("auto", "host", _step(FSDP2_BY * 1.0), 1.0)[0] == "fsdp2"
    assert choose("auto", "host", _step(0.97), 1.0)[0] == "exchange"  # within the margin: the exchange
    assert choose("auto", "host", _step(2.0), 1.0)[0] == "exchange"
    assert choose("auto", "host", _step(0.1, fits=False), 1.0)[0] == "exchange"
    assert choose("auto", "nvme", _step(0.1), 1.0) == ("exchange", "--offload nvme: only the exchange puts the "
                                                                   "parameters on the disk")
    assert choose("fsdp2", "host", _step(2.0), 1.0)[0] == "fsdp2"
    assert choose("exchange", "host", _step(0.1), 1.0)[0] == "exchange"


def _plan(capsys, *flags: str) -> dict:
    from tightfit.cli import main

    assert main(["plan", "--n-layer", "8", "--n-embd", "2048", "--n-head", "16", "--nproc-per-node", "4",
                 "--strategy", "zero3", "--offload", "host", "--hardware", "h200", "--gpu-mem", "80GiB", "--cpu-mem",
                 "64GiB", "--micro-batch", "2", "--seq-len", "1024", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["ranks"]["zero3_path"]


def test_what_if_nvlink_runs_fsdp2_and_pcie_the_exchange(capsys):
    """4 GPUs, 0.4 B parameters: over NVLink FSDP2's all-gathers are hidden and each GPU's host link carries its
    quarter of the shards, where every use of the exchange crosses every GPU's link twice; over PCIe at an assumed
    10 GB/s FSDP2's collectives, again for each of 4 micro-batches, are longer than the exchange's whole step."""
    nvlink = _plan(capsys, "--interconnect", "nvlink", "--grad-accum", "4")
    assert nvlink["runs"] == "fsdp2", nvlink
    f = nvlink["fsdp2"]
    assert f["step_s"] == pytest.approx(max(f["compute_s"], f["collectives_s"], f["link_s"])
                                        + max(0.0, f["optimizer_s"] - f["compute_s"] / (3 * 4)))
    assert f["step_s"] <= FSDP2_BY * nvlink["exchange_step_s"]
    pcie = _plan(capsys, "--interconnect", "pcie", "--grad-accum", "4")
    assert pcie["runs"] == "exchange" and pcie["fsdp2"]["collectives_s"] > pcie["exchange_step_s"], pcie
    # FSDP2 gathers for each micro-batch: its collectives scale with them, the host memory it needs does not
    one = _plan(capsys, "--interconnect", "pcie", "--grad-accum", "1")["fsdp2"]
    assert pcie["fsdp2"]["collectives_s"] == pytest.approx(4 * one["collectives_s"])
    assert pcie["fsdp2"]["host_bytes"] == one["host_bytes"]
    # a rank's host memory too small for FSDP2's 16 bytes a parameter of its shards: the exchange, said so
    short = _plan(capsys, "--interconnect", "nvlink", "--grad-accum", "4", "--cpu-mem", "1GiB")
    assert short["runs"] == "exchange" and not short["fsdp2"]["fits"], short
    assert short["why"] == "FSDP2's shards do not fit a rank's host memory or its GPU"


def test_on_cpu_ranks_fsdp2s_collectives_and_optimizer_add_to_its_compute(tmp_path, capsys):
    """On a CPU-only machine gloo and the optimizer run on the compute's cores: FSDP2's step is their sum, its
    collectives at the share of the idle bus bandwidth gloo keeps beside a step."""
    from tightfit.cli import main
    from tightfit.planner.averaging import GLOO_BESIDE_A_STEP

    assert main(["plan", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "32", "--micro-batch", "2",
                 "--grad-accum", "2", "--nproc-per-node", "2", "--strategy", "zero3", "--offload", "host",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["ranks"]
    f = got["zero3_path"]["fsdp2"]
    assert f["link_s"] == 0.0 and f["device_bytes"] == 0
    assert f["step_s"] == pytest.approx(f["compute_s"] + f["collectives_s"] / GLOO_BESIDE_A_STEP + f["optimizer_s"])
    import torch

    from tightfit.models.gpt import GPT, GPTConfig
    from tightfit.parallel.costs import ModelProfile, comm_per_step
    from tightfit.parallel.mesh import ParallelDims
    from tightfit.parallel.plan import ParallelPlan

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64))
    sent = comm_per_step(ParallelPlan(ParallelDims(dp=2), "zero3", cpu_offload=True),
                         ModelProfile.from_model(model, 32, 2, False), micro_batches=2)["dp"]
    assert sent > 0 and f["collectives_s"] == pytest.approx(sent / got["allreduce_bus_bw"])
    assert got["zero3_path"]["runs"] in ("fsdp2", "exchange")
    assert main(["plan", "--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "32", "--micro-batch", "2",
                 "--nproc-per-node", "2", "--strategy", "zero3", "--offload", "host"]) == 0
    text = capsys.readouterr().out
    assert "FSDP2's ZeRO-3 instead (every rank's shards in its host memory)" in text
    assert "ZeRO-3 with --offload: " in text and "predicted step: FSDP2's all-gathers" in text


@pytest.mark.parametrize("flags", [["--strategy", "ddp", "--offload", "host"],
                                   ["--strategy", "zero3", "--offload", "auto"],
                                   ["--strategy", "zero3", "--offload", "host", "--nproc-per-node", "1"]])
def test_the_flag_outside_zero3_with_the_offload_is_one_line(flags, capsys):
    from tightfit.cli import main

    argv = ["train", "--nproc-per-node", "2", *flags, "--zero3-params", "fsdp2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tightfit: error: --zero3-params fsdp2: "), err
