"""[Note: gradients land converted] (offload/step/gradients.py): on the GPU's path a step's first gradients come off
the device as fp32 and land as their sum, with no host pass and no pool buffer for the host tier; later
micro-batches are packed in the compute dtype and added on the host. Run on the CPU suite's GPU-shaped device
(device memory apart from the host's, the strict mover's late copies), against the same model with every state on
the device, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from offload_helpers import tiny_gpt, train

from tightfit import Placement, Tier
from tightfit.offload.memory_model import (
    CONVERT_CHUNK,
    UnitSize,
    conversion_bytes,
    step_memory,
    tier_states,
)
from tightfit.offload.runtime.host_memory import HostPool
from tightfit.offload.step import gradients


@pytest.fixture
def recorded(monkeypatch):
    """Every ship grant's buffers (name -> dtype) and every host add, as the engine asks for them."""
    monkeypatch.setenv("TIGHTFIT_CPU_DEVICE", "separate")
    seen = {"ships": [], "adds": 0}
    reserve, add_into = HostPool.reserve, gradients._add_into

    def record_reserve(self, job, sizes, *a, **k):
        if job.startswith("ship grads"):
            seen["ships"].append({name: dtype for name, (_, dtype) in sizes.items()})
        return reserve(self, job, sizes, *a, **k)

    def record_add(*a):
        seen["adds"] += 1
        return add_into(*a)

    monkeypatch.setattr(HostPool, "reserve", record_reserve)
    monkeypatch.setattr(gradients, "_add_into", record_add)
    return seen


@pytest.mark.parametrize("early", [False, True])
def test_host_gradients_of_one_micro_batch_land_as_their_sum(recorded, early):
    bf16 = dict(compute_dtype=torch.bfloat16, steps=3, early=early)
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), **bf16)
    recorded["ships"].clear()
    losses, *_ = train(tiny_gpt, Placement.everywhere(Tier.HOST), **bf16)
    assert losses == expected
    assert recorded == {"ships": [], "adds": 0}  # no pack, no widening pass: copied into the sum itself


def test_later_micro_batches_are_packed_in_the_compute_dtype_and_added(recorded):
    bf16 = dict(compute_dtype=torch.bfloat16, steps=2, accum=3, clip=1.0)
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), **bf16)
    recorded["ships"].clear()
    losses, *_ = train(tiny_gpt, Placement.everywhere(Tier.HOST), **bf16)
    assert losses == expected
    units = len(recorded["ships"]) // 4  # 2 steps x 2 later micro-batches
    assert units > 1 and recorded["ships"] == [{"pack": torch.bfloat16}] * 4 * units
    assert recorded["adds"] == 4 * units


def test_nvme_gradients_of_a_first_micro_batch_come_in_an_fp32_pack(recorded, tmp_path):
    bf16 = dict(compute_dtype=torch.bfloat16, steps=2, accum=2)
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), **bf16)
    recorded["ships"].clear()
    losses, *_ = train(tiny_gpt, Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path)), **bf16)
    assert losses == expected
    ships = recorded["ships"]
    units = len(ships) // 4  # 2 steps x 2 micro-batches, every unit shipped in each
    first = {"pack": torch.float32}  # the sum itself: no accumulator
    later = {"pack": torch.bfloat16, "grads": torch.float32}
    assert units > 1 and ships == ([first] * units + [later] * units) * 2


def test_the_plan_counts_page_locked_sums_and_the_devices_conversion():
    """The host tier's gradients are page-locked, one mapping each (rounded to a page), where device memory is apart;
    a GPU converts a bounded chunk at a time, a temporary the engine's own count leaves out."""
    units = [UnitSize("root", 1000, 1000), UnitSize("blocks.0", 3000, 3000)]
    host = Placement.everywhere(Tier.HOST)
    rounded = sum(-(-b // 4096) * 4096 - b for b in (2000, 6000, 4000, 12000))  # params (bf16), then gradients
    assert tier_states(units, host, 2, separate=True)[Tier.HOST] - tier_states(units, host, 2)[Tier.HOST] == rounded
    assert conversion_bytes(units, host, 2) == 4 * 3000 and conversion_bytes(units, host, 4) == 0
    assert conversion_bytes(units, Placement.everywhere(Tier.DEVICE), 2) == 0
    assert conversion_bytes([UnitSize("blocks.0", 10**9, 10**9)], host, 2) == 4 * CONVERT_CHUNK
    mem = step_memory(units, host, 2, cuda=True)
    assert mem.phases["backward"]["device"]["grad conversion"] == 12000
    assert "grad conversion" not in mem.phases["forward"]["device"]
    assert mem.engine_device() == max(sum(v for k, v in mem.phases[ph]["device"].items() if k != "grad conversion")
                                      for ph in mem.phases)


def test_a_placement_that_packs_first_gradients_in_the_compute_dtype(recorded):
    """`Placement.land_grads_fp32` False (the planner's choice where the link binds): a step's first gradients leave
    in bf16 too and the host widens them; the same bits."""
    bf16 = dict(compute_dtype=torch.bfloat16, steps=2)
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), **bf16)
    recorded["ships"].clear()
    packed = Placement.everywhere(Tier.HOST, land_grads_fp32=False)
    losses, *_ = train(tiny_gpt, packed, **bf16)
    assert losses == expected
    units = len(recorded["ships"]) // 2
    assert units > 1 and recorded["ships"] == [{"pack": torch.bfloat16}] * 2 * units
    assert recorded["adds"] == 2 * units
    assert Placement.from_json(packed.to_json()).land_grads_fp32 is False
    assert Placement.from_dict({}).land_grads_fp32 is True  # a plan file from before the option


@pytest.mark.parametrize("chunk", [97, 4096])
def test_the_conversion_in_chunks_is_the_whole_copy(recorded, monkeypatch, chunk):
    """Both movers convert a gradient `CONVERT_CHUNK` elements at a time (the CUDA temporary's bound): with chunks
    that split every parameter at odd places, the strict mover's late copies give the device tier's bits."""
    from tightfit.offload.runtime import movers

    monkeypatch.setattr(movers, "CONVERT_CHUNK", chunk)
    bf16 = dict(compute_dtype=torch.bfloat16, steps=2, accum=2)
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), **bf16)
    losses, *_ = train(tiny_gpt, Placement.everywhere(Tier.HOST), **bf16)
    assert losses == expected
    g = torch.randn(3, 1000).to(torch.bfloat16)
    dst, pieces = torch.full((3000,), -1.0), []
    movers._copy_converting(dst.view(3, 1000), g, lambda d, c: (pieces.append(c.numel()), d.copy_(c)))
    assert torch.equal(dst, g.float().view(-1)) and max(pieces) <= chunk and sum(pieces) == 3000


def test_gradients_a_system_would_not_page_lock_come_through_packs(recorded, monkeypatch):
    """Where page-locking the host tier's gradients is refused they stay pageable, and a step's first gradients come
    through a pack as the later ones do: the same bits, no copy into pageable memory from the device."""
    from tightfit.offload.runtime.host_memory import RegisteredAllocator

    real = RegisteredAllocator.allocate

    def refuse_fp32(self, numel, dtype):
        if dtype == torch.float32:
            raise RuntimeError("cudaHostRegister of 4096 B failed (error 2)")
        return real(self, numel, dtype)

    bf16 = dict(compute_dtype=torch.bfloat16, steps=2)
    expected, *_ = train(tiny_gpt, Placement.everywhere(Tier.DEVICE), **bf16)
    monkeypatch.setattr(RegisteredAllocator, "allocate", refuse_fp32)
    recorded["ships"].clear()
    losses, *_ = train(tiny_gpt, Placement.everywhere(Tier.HOST), **bf16)
    assert losses == expected
    assert recorded["ships"] and all(s == {"pack": torch.bfloat16} for s in recorded["ships"])
