"""The H200 deadlock (issue 25) and a randomized stress of the engine's resource handling, on the CPU.

On the first GPU run a 1.1B Llama with every state in host memory deadlocked in its first backward
(../shared/gpu-runs/2026-11-26/deadlock_stacks.txt): the thread running backward took a compute-dtype gradient pack
from the bounded staging pool while the gradient worker, holding an earlier pack, waited in the same pool for an fp32
buffer to upcast into. Backward on a GPU runs many units ahead of the worker, so the packs in flight filled the pool.
The CPU suite could not see it: host gradients were added in place on a CPU device (no pack, no upcast) and CPU
backward never outran the worker. Now the suite runs the GPU's path (device_kind.py: packs, upcasts, page-rounded
pools, jobs started late so backward runs ahead) and every job is granted its whole buffer set at once
([Note: jobs and grants], tightfit/offload/runtime/host_memory.py).

Both tests use only the public API (wrap, Placement, tightfit.optim.AdamW) on `device="cpu:0"` (which the code
before this change took for a GPU, so its pack path ran there too), find the smallest host budget `wrap` accepts by
bisection, and train at it in a subprocess under a timeout: a hang fails the test instead of stalling the suite.
On 4a4245c both fail (a hang, or "a staging buffer does not fit the bytes left for staging" at the first step).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

COMMON = textwrap.dedent("""
    import dataclasses, faulthandler, os, sys, tempfile, torch
    import tightfit
    from tightfit import Placement, Tier, UnitPlacement
    from tightfit.errors import UsageError
    from tightfit.offload import engine_of
    from tightfit.offload.step.unit_major import UnitMajor

    faulthandler.dump_traceback_later(float(os.environ.get("HANG_S", "100")), exit=True)
    SWAP = tempfile.mkdtemp()
    DEVICE = os.environ.get("DEADLOCK_DEVICE", "cpu:0")  # "cuda": the same scenario on a GPU (test_offload_cuda.py)

    def same(got, ref):
        # Bitwise on the CPU; on a GPU within 1e-5 (its kernels need not repeat every bit run to run).
        if DEVICE == "cuda":
            return len(got) == len(ref) and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref))
        return got == ref

    def smallest_host_budget(build, placement, dtype):
        '''The least host budget (bytes) wrap accepts for this model and placement, by bisection.'''
        lo, hi = 0, 1 << 34
        while hi - lo > 64:
            mid = (lo + hi) // 2
            model = build()
            try:
                tightfit.wrap(model, dataclasses.replace(placement, host_budget=mid), compute_dtype=dtype,
                              device=DEVICE)
            except UsageError:
                lo = mid
                continue
            engine_of(model).close()
            hi = mid
        return hi

    def run(build, placement, dtype, steps, mode, accum, batch_of, order="micro"):
        torch.manual_seed(0)
        model = build()
        tightfit.wrap(model, placement, compute_dtype=dtype, device=DEVICE)
        opt = tightfit.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        declare = {"early": opt.step_during_backward, "preload": opt.preload_during_backward}.get(mode)
        # The micro-batches unit by unit, their block inputs in host memory or not.
        runner = UnitMajor(model, boundaries_on_host=order == "unit, inputs on host") if order != "micro" else None
        losses = []
        for step in range(steps):
            forwards = [lambda i=step * accum + micro: batch_of(model, i) / accum for micro in range(accum)]
            if runner is not None:
                losses += [loss.item() for loss in runner.run(forwards, before_backward=declare)]
            for micro, forward in enumerate(forwards if runner is None else []):
                loss = forward()
                if micro == accum - 1 and declare is not None:
                    declare()
                loss.backward()
                losses.append(loss.item())
            if mode in ("preload", "plain"):
                opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        engine_of(model).close()
        return losses
""")

LLAMA = COMMON + textwrap.dedent("""
    from transformers import LlamaConfig, LlamaForCausalLM

    tier, ratio = sys.argv[1], float(sys.argv[2])

    def llama(ratio):
        # TinyLlama's proportions at a tiny width: the root (embedding + head) `ratio` times a block
        hidden, inter = 32, 88
        block = 2 * hidden * hidden + 2 * hidden * hidden // 4 + 3 * hidden * inter
        vocab = int(ratio * block / (2 * hidden))
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=32, use_cache=False,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        return (lambda: LlamaForCausalLM(cfg)), vocab

    build, vocab = llama(ratio)

    def batch_of(model, i):
        x = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(i)).to(DEVICE)
        return model(input_ids=x, labels=x).loss

    for dtype in (torch.bfloat16, torch.float32):
        base = Placement.everywhere(tier, nvme_dir=SWAP if tier == "nvme" else None)
        smallest = smallest_host_budget(build, base, dtype)
        ref = run(build, base, dtype, 3, "early", 1, batch_of)
        for factor in (1.0, 1.5):
            for mode in ("early", "preload"):
                budget = dataclasses.replace(base, host_budget=int(smallest * factor))
                got = run(build, budget, dtype, 3, mode, 1, batch_of)
                if mode == "early":
                    assert same(got, ref), (dtype, factor, got, ref)  # a budget changes no bit of the result
                print("ok", tier, ratio, dtype, factor, mode, smallest, flush=True)
    print("finished")
""")


@pytest.mark.parametrize("tier,ratio", [("host", 3), pytest.param("host", 6, marks=pytest.mark.slow),
                                        pytest.param("nvme", 3, marks=pytest.mark.slow), ("nvme", 6)])
def test_smallest_accepted_host_budget_trains_llama_with_backward_ahead(tmp_path, tier, ratio):
    """The H200 deadlock: a Llama with states in host memory (and on NVMe), bf16 and fp32, root/block ~3 (TinyLlama)
    and ~6 (a vocabulary-heavy model), at the smallest host budget wrap accepts and 1.5x it, each unit stepped
    during backward (the GPU run's path) and with clipping (preloads), losses bitwise those of an unbounded run."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "-c", LLAMA, tier, str(ratio)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env={**os.environ, "HANG_S": "200"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert "finished" in proc.stdout.split("\n")


STRESS = COMMON + textwrap.dedent("""
    import random
    from tightfit.models.gpt import GPT, GPTConfig

    seeds = [int(s) for s in sys.argv[1].split(",")]
    TIERS = ["device", "host", "nvme"]

    def batch_of(model, i):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
        return model(x, torch.roll(x, -1, 1))

    for seed in seeds:
        rnd = random.Random(seed)
        os.environ["TIGHTFIT_STRICT_SEED"] = str(seed)  # the strict mover's and workers' random delays
        layers, width = rnd.choice([2, 3, 5]), rnd.choice([16, 32])
        build = lambda: GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=layers, n_head=2, n_embd=width))
        units = ["root"] + [f"blocks.{i}" for i in range(layers)]
        per_unit = {u: UnitPlacement(*(Tier(rnd.choice(TIERS)) for _ in range(4))) for u in units}
        dtype = rnd.choice([torch.float32, torch.bfloat16])
        mode, accum = rnd.choice(["early", "preload", "plain"]), rnd.choice([1, 2])
        base = Placement(units=per_unit, nvme_dir=SWAP, prefetch_depth=rnd.choice([0, 1, 3]))
        factor = rnd.choice([1.0, 1.0, 1.2, 2.0])
        # Drawn last, so the earlier draws of a seed stay what they were: units whose params and master are on the
        # host may have the device cast their uploaded master ([Note: the device casts the master]).
        base = dataclasses.replace(base, cast_on_device=rnd.choice([False, True]))
        # The micro-batches in micro-batch-major order, or unit by unit (offload/step/unit_major.py), against the
        # unbudgeted run in micro-batch-major order: the same bits either way.
        order = rnd.choice(["micro", "unit"])
        if order == "unit" and rnd.random() < 0.5:  # [Note: boundaries on the host]
            order = "unit, inputs on host"
        ref = run(build, base, dtype, 3, mode, accum, batch_of)
        smallest = smallest_host_budget(build, base, dtype)
        got = run(build, dataclasses.replace(base, host_budget=int(smallest * factor)), dtype, 3, mode, accum, batch_of,
                  order)
        assert same(got, ref), (seed, order, got, ref)
        print("ok", seed, layers, width, dtype, mode, accum, factor, base.cast_on_device, order, flush=True)
    print("finished")
""")


# Seeds 1-15 in `make test`, 16-45 in `make test-slow` (the same trial with other draws; 14 s a group on the VM).
@pytest.mark.parametrize("seeds", [",".join(map(str, range(first, first + 15))) if first < 16 else
                                   pytest.param(",".join(map(str, range(first, first + 15))), marks=pytest.mark.slow)
                                   for first in (1, 16, 31)])
def test_random_placements_budgets_and_delays_never_hang_or_change_a_bit(tmp_path, seeds):
    """Random per-unit placements (every tier for every state), dtypes, micro-batches, look-ahead depths and step
    modes, at or near the smallest host budget, under random copy and job delays: every run finishes, with the
    losses of the same run without a host budget."""
    proc = subprocess.run([sys.executable, "-c", STRESS, seeds], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "HANG_S": "250"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    assert "finished" in proc.stdout.split("\n")
