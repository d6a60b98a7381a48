"""torchrun worker for tests/test_parallel_equivalence.py: many strategies in one process group.

Every rank first trains the reference GPT alone on the whole global batch (the one-process reference), then, for
each case named on the command line, builds the same model from the same seed, parallelises it, trains the same 5
steps on its share of the same batches, and checks losses (relative difference <= 1e-5) and final weights.
Rank 0 prints one line `CASE <name> OK max_loss_rel=... max_weight_diff=...` per case; a mismatch raises.

Case syntax: strategy[:key=value,...] with keys tp, pp, sched, mb, offload, kept=N (with offload=1: the first N units
of parallel/unit_split.py's order keep their shards on the device), model (gpt|hf-gpt2|hf-llama), ac=1 (every
block's activations recomputed in backward: parallel/activation_checkpoint.py),
accum=N (gradient accumulation over N calls, pp == 1), bf16=1 (FSDP2 gathers in bf16, the forward under autocast:
losses and weights within 2e-2 of the fp32 reference), resume=1 (save the full state after 3 steps, rebuild
everything from it and continue: must match too), and strided=refuse (DTensor refuses to redistribute a
`_StridedShard` that alone shards its dim, as torch before 2.13 does: HF GPT-2's packed c_attn must train, save
and resume without DTensor moving it).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tightfit.models.gpt import GPT, GPTConfig
from tightfit.parallel.data_parallel import repeated_blocks
from tightfit.parallel.mesh import build_mesh, init_distributed, leave_process, shutdown
from tightfit.parallel.parallelize import make_optimizer, parallelize
from tightfit.parallel.plan import parse_strategy
from tightfit.parallel.state import gather_full_state, load_moments

STEPS, B, T, VOCAB = 5, 8, 16, 64
LR, WD, CLIP = 3e-3, 0.1, 1.0
EPS = 1e-6
# Why eps 1e-6 (not 1e-8): Adam's update g/(|g|+eps) turns an element whose gradient is ~1e-9 (pure float rounding
# noise, e.g. a GELU in its flat tail) into a full +-lr step, so two correct runs that add the same numbers in a
# different order (sharded matmuls) would differ by ~lr on such elements. eps 1e-6 damps exactly those elements.
# Likewise the model has no biases: the key projection's bias has an exactly-zero gradient (softmax ignores it).


def build_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=4, n_head=4, n_embd=32, bias=False))
    if kind == "hf-gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
        return GPT2LMHeadModel(cfg)
    if kind == "hf-llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                          tie_word_embeddings=False)
        return LlamaForCausalLM(cfg)
    raise ValueError(kind)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def logits_of(out):
    return out if isinstance(out, torch.Tensor) else out.logits


def reference(kind: str):
    model = build_model(kind)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=EPS)
    losses = []
    for s in range(STEPS):
        x, y = batch(s)
        logits = logits_of(model(x))
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


RESUME_AT = 3


def resume(pm, opt, kind, plan, mesh, env, ac: bool = False):
    """Checkpoint round trip mid-run: gather the full state (rank 0), give it to every rank, build a fresh model
    from it, parallelise it again and restore the AdamW moments; training must continue exactly."""
    full = [gather_full_state(pm, opt)]
    dist.broadcast_object_list(full, src=0)
    full = full[0]
    assert any(k.startswith("optim.") for k in full), "no optimizer moments gathered"
    getattr(opt, "close", lambda: None)()  # shard_states.py's thread and hooks
    model = build_model(kind)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(full[f"model.{n}"])
    pm2 = parallelize(model, plan, mesh, env.device, checkpoint=ac)
    opt2 = make_optimizer(pm2, lr=LR, weight_decay=WD, eps=EPS)
    loaded = load_moments(pm2, opt2, full.__getitem__)
    assert loaded > 0 or plan.dp_mode == "zero1", "no moments restored"
    return pm2, opt2


@contextmanager
def refusing_lone_strided_shards(on: bool):
    """While on, DTensor's redistribution raises on a `_StridedShard` that no other placement shares its tensor
    dim with, the ValueError torch 2.11 raises ("unable to be interpreted into a corresponding shard_order")."""
    if not on:
        yield
        return
    from torch.distributed.tensor import _api, _dispatch, _redistribute
    from torch.distributed.tensor.placement_types import _StridedShard

    def lone(placements) -> bool:
        return any(isinstance(p, _StridedShard) and [getattr(q, "dim", None) for q in placements].count(p.dim) == 1
                   for p in placements)

    real = _redistribute.redistribute_local_tensor

    def refusing(local, current_spec, target_spec, *args, **kwargs):
        if current_spec.placements != target_spec.placements and \
                (lone(current_spec.placements) or lone(target_spec.placements)):
            raise ValueError(f"placements {current_spec.placements} -> {target_spec.placements}: unable to be "
                             "interpreted into a corresponding shard_order (torch < 2.13, simulated)")
        return real(local, current_spec, target_spec, *args, **kwargs)

    modules = [m for m in (_redistribute, _dispatch, _api) if getattr(m, "redistribute_local_tensor", None) is real]
    for m in modules:
        m.redistribute_local_tensor = refusing
    try:
        yield
    finally:
        for m in modules:
            m.redistribute_local_tensor = real


def run_case(spec: str, env, refs) -> str:
    strategy, _, opts = spec.partition(":")
    if "=" in strategy:  # "model=hf-llama" alone is not a strategy
        raise ValueError(f"case {spec!r}: write strategy:key=value")
    kv = dict(o.split("=") for o in opts.split(",") if o)
    with refusing_lone_strided_shards(kv.get("strided") == "refuse"):
        return _run_case(spec, strategy, kv, env, refs)


def _run_case(spec: str, strategy: str, kv: dict, env, refs) -> str:
    kind = kv.get("model", "gpt")
    plan = parse_strategy(strategy, env.world_size, tp=int(kv.get("tp", 0)), pp=int(kv.get("pp", 0)),
                          pp_schedule=kv.get("sched", "1f1b"), pp_microbatches=int(kv.get("mb", 2)),
                          cpu_offload=kv.get("offload") == "1")
    if kv.get("kept"):  # the first N units keep their shards on the device, the rest offloaded (unit_split.py)
        from dataclasses import replace

        from tightfit.parallel.unit_split import zero3_units

        plan = replace(plan, kept_on_device=tuple(zero3_units(build_model(kind), plan.dims.dp)[:int(kv["kept"])]))
    if kind not in refs:
        refs[kind] = reference(kind)
    ref_losses, ref_params = refs[kind]
    mesh = build_mesh(plan.dims, env.device)
    ac = kv.get("ac") == "1"
    bf16 = kv.get("bf16") == "1"
    pm = parallelize(build_model(kind), plan, mesh, env.device, checkpoint=ac,
                     param_dtype=torch.bfloat16 if bf16 else None)
    opt = make_optimizer(pm, lr=LR, weight_decay=WD, eps=EPS)
    gathered: set = set()  # the dtypes a block's parameters have while it computes (FSDP2 gathers them so)
    blocks = repeated_blocks(pm.module)[:1]
    hooks = [b.register_forward_pre_hook(lambda m, i: gathered.update(p.dtype for p in m.parameters()))
             for b in blocks]  # after FSDP2's own pre-hook (its all-gather), before its post-forward reshard
    dp_rank, b = mesh["dp"].get_local_rank(), B // plan.dims.dp
    losses = []
    t0 = time.perf_counter()
    for s in range(STEPS):
        if s == RESUME_AT and kv.get("resume") == "1":
            pm, opt = resume(pm, opt, kind, plan, mesh, env, ac)
        x, y = batch(s)
        x, y = x[dp_rank * b:(dp_rank + 1) * b], y[dp_rank * b:(dp_rank + 1) * b]
        accum = int(kv.get("accum", 1))  # gradient accumulation over `accum` calls, dp sync on the last only
        parts = []
        for i, (xa, ya) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # the run's, with --precision bf16
                parts.append(pm.forward_backward(xa, ya, 1.0 / accum, sync=i == accum - 1))
            if i == 0 and accum > 1 and plan.dp_mode in ("zero2", "zero3") and plan.dims.pp == 1:
                # reduce-scattered into the shards at once, not held whole until the last micro-batch
                held = [n for n, p in pm.module.named_parameters() if p.requires_grad and p.grad is None]
                assert not held, f"{spec}: no sharded gradient after micro-batch 1: {held[:3]}"
        local = torch.stack(parts).mean()
        pm.clip_grad_norm_(CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(pm.global_loss(local))
    elapsed = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    if bf16:  # FSDP2 gathered the block in bf16 (its shards fp32): MixedPrecisionPolicy, not autocast alone
        assert gathered == {torch.bfloat16}, f"{spec}: block gathered as {gathered}"
        assert all(p.dtype == torch.float32 for p in pm.module.parameters()), f"{spec}: shards not fp32"
    tol = 2e-2 if bf16 else 1e-5  # bf16 compute against the fp32 reference
    loss_rel = max(abs(a - r) / abs(r) for a, r in zip(losses, ref_losses))
    assert loss_rel <= tol, f"{spec}: losses {losses} vs reference {ref_losses} (rel {loss_rel:.2e})"
    full = pm.full_state_dict()
    assert full, f"{spec}: rank holds no parameters"
    wdiff = 0.0
    for name, t in full.items():
        ref = ref_params[name]
        assert t.shape == ref.shape, f"{spec}: {name} shape {tuple(t.shape)} vs {tuple(ref.shape)}"
        wdiff = max(wdiff, (t - ref).abs().max().item())
        assert torch.allclose(t, ref, rtol=tol, atol=tol), f"{spec}: weight {name} differs by {wdiff:.2e}"
    # Every reference parameter must live on some rank.
    names = [None] * env.world_size
    dist.all_gather_object(names, sorted(full))
    missing = set(ref_params) - set().union(*map(set, names))
    assert not missing, f"{spec}: parameters on no rank: {sorted(missing)[:5]}"
    return f"CASE {spec} OK plan={plan.name} mesh=({plan.dims}) max_loss_rel={loss_rel:.1e} " \
           f"max_weight_diff={wdiff:.1e} time={elapsed:.1f}s"


def main() -> None:
    torch.set_num_threads(1)
    env = init_distributed(timeout_s=60)
    refs: dict = {}
    failures = 0
    for spec in sys.argv[1:]:
        try:
            line = run_case(spec, env, refs)
        except Exception as e:  # report and go on: one launch checks many cases
            import traceback
            traceback.print_exc()
            line = f"CASE {spec} FAIL {type(e).__name__}: {str(e)[:400]}"
            failures += 1
            print(f"[rank {env.rank}] {line}", flush=True)  # before the barrier: other ranks may be stuck
        dist.barrier()
        if env.rank == 0 and "FAIL" not in line:
            print(f"[rank {env.rank}] {line}", flush=True)
    shutdown()
    leave_process(1 if failures else 0)  # not the interpreter's teardown: [Note: leaving the process group]


if __name__ == "__main__":
    main()
