"""A ~1B-parameter Llama on one GPU under a 24 GiB cap: tightfit with its states offloaded against plain PyTorch.

    python benchmarks/bench_gpu_llama.py                                  # TinyLlama-1.1B's shape, 24 GiB cap
    python benchmarks/bench_gpu_llama.py --device cpu --hidden 64 --intermediate 128 --layers 2 --heads 4 \\
        --kv-heads 2 --vocab 256 --seq 32 --batch 2 --steps 3 --warmup 1  # smoke test: the code path, in seconds

The model is Hugging Face's LlamaForCausalLM built from a LlamaConfig (random init, nothing downloaded), by
default in TinyLlama-1.1B's shape (22 layers, hidden 2048, MLP 5632, 32 heads, 4 kv heads, vocab 32000: 1.10 B
parameters). Where transformers is not installed, the project's own GPT (tightfit/models/gpt.py) of about the same
size stands in (20 layers, width 2048, vocab 32000: 1.14 B), and the figures say so (`model`, `model_note`).

Sides, each in its own process on a GPU (bench_gpu_util.py), on the same weights (seeded CPU init), batches of
random tokens, bf16 compute with fp32 master weights, AdamW (without clipping unless `--clip`), each step's micro-batches
run as `tightfit train` runs them (MemorySetup.accumulate: in unit-major order where the side's plan chose it):
- plain: `tightfit train --offload none`'s setup: fp32 parameters, gradients and moments on the GPU, bf16 autocast,
  `torch.optim.AdamW(fused=True)`, under the same cap. Where that does not fit (out of memory), `plain-uncapped`
  runs the same on the whole GPU: plain PyTorch's speed where it fits at all.
- tightfit: what `tightfit train --gpu-mem 24GiB` does: the planner places the states for the cap and the machine's
  RAM, `tightfit.wrap`, each unit's AdamW step during backward.
- tightfit-host: the same with every state in host memory (`--offload host`): offloaded whatever the planner thinks.
- tightfit-nvme: every state on NVMe (`--offload nvme`, a swap folder under `--nvme`, default a temporary folder).
`--sides plain-uncapped,...` skips the capped plain side (out of memory under a 24 GiB cap: `make gpu-check` does).
Each offloaded side also reports its bytes to and from the device and the disk per step (the engine's counters), for
the floors' bound (bench_gpu_floors.py, scripts/gpu_check_report.py).
Reported per side: median step time after `--warmup`, tokens/s, MFU, CUDA peaks (allocated and reserved), losses.
MFU = model FLOPs per step (bench_gpu_util.step_flops: 6 x Linear weights x tokens + attention) / step time / the
GPU's peak bf16 FLOP/s, from a datasheet table by device name, else a measured bf16 matrix product (both given).
A side that fails is reported with its error; the exit status is then 1 (an expected plain OOM under the cap is no
failure when plain-uncapped ran). `--json-out PATH` also writes the figures there. On `--device cpu` the sides run
in this process with no cap: the figures mean nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu_util as util  # noqa: E402

SIDES = ("plain", "plain-uncapped", "tightfit", "tightfit-host", "tightfit-nvme")


def _which_model(args) -> tuple[str, str]:
    """("llama" | "gpt", why): Hugging Face's Llama where transformers is importable, else the project's GPT."""
    if args.model == "gpt":
        return "gpt", "asked for (--model gpt)"
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        if args.model == "llama":
            raise SystemExit(f"bench_gpu_llama.py: --model llama needs transformers ({e})") from e
        return "gpt", f"transformers is not installed ({e}): the project's GPT of about the same size stands in"
    return "llama", f"transformers {transformers.__version__} LlamaForCausalLM, random init"


def build_model(args):
    """The model on the CPU, seeded: every side starts from the same weights. Returns (model, n_layer, attn_width)."""
    import torch

    kind, _ = _which_model(args)
    torch.manual_seed(0)
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq, use_cache=False,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        return LlamaForCausalLM(cfg), args.layers, args.hidden
    from tightfit.models.gpt import GPT, GPTConfig

    layers = args.gpt_layers or args.layers
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=args.heads,
                    n_embd=args.hidden)
    return GPT(cfg), layers, args.hidden


def loss_fn(model):
    from tightfit.models.gpt import GPT

    if isinstance(model, GPT):
        return lambda x, y: model(x, y)
    return lambda x, y: model(input_ids=x, labels=x).loss  # HF shifts the labels itself


def _batches(args, device):
    import torch

    def batch_of(step: int):
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        return x.to(device), torch.roll(x, -1, 1).to(device)

    return batch_of


def _autocast(device):
    import torch

    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


def run_side(args, side: str) -> dict:
    import torch

    from tightfit.config import Config
    from tightfit.train.memory import setup_memory

    device = util.cap_device(args.device, None if side == "plain-uncapped" else args.cap_gib)
    model, n_layer, width = build_model(args)
    n_params, n_linear = sum(p.numel() for p in model.parameters()), util.linear_params(model)
    cfg = Config()
    cfg.train.micro_batch, cfg.train.seq_len, cfg.train.device = args.batch, args.seq, device.type
    cfg.train.precision = "bf16"
    # The plan predicts the step the side runs: the host side's micro-batches are the plan's grad-accum.
    cfg.train.grad_accum = args.host_accum if side == "tightfit-host" else 1
    cfg.optim.grad_clip, cfg.optim.lr, cfg.optim.weight_decay = args.clip, 1e-4, 0.1
    cfg.memory.offload = {"plain": "none", "plain-uncapped": "none", "tightfit": "auto", "tightfit-host": "host",
                          "tightfit-nvme": "nvme"}[side]
    if side == "tightfit-nvme":
        import tempfile

        cfg.memory.nvme = args.nvme or tempfile.mkdtemp(prefix="tightfit-bench-")
    if device.type == "cuda" and side != "plain-uncapped":
        cfg.memory.gpu_mem = f"{args.gpu_mem_gib or args.cap_gib}GiB"
    # plain: model.to(device) + fused AdamW; a tightfit side runs the engine even where its plan would move nothing
    mem = setup_memory(model, cfg, device, torch.bfloat16, plain_if_still=False)
    print(mem.describe(), file=sys.stderr, flush=True)
    try:
        util.reset_peaks(device)
        autocast = _autocast(device)  # as tightfit train runs bf16, plain or offloaded
        compute = loss_fn(mem.model)

        accum = args.host_accum if side == "tightfit-host" else 1
        batch_of = _batches(args, device)

        timers = None
        if side.startswith("tightfit"):
            from tightfit.offload.step.engine import engine_of

            timers = engine_of(mem.model).timers  # the engine's threads over the measured steps

        def forward(x, y):
            with autocast():
                return compute(x, y) / accum

        def step(x, y) -> float:
            # As `tightfit train` runs a step: its micro-batches in the plan's order (unit- or micro-batch-major,
            # MemorySetup.accumulate), the loss summed on the device (one host sync a step), the clip, the step.
            # Micro-batch 0 is (x, y); the others the batches after it.
            batches = [(x, y)] + [batch_of(10_000 + m) for m in range(1, accum)]
            total = torch.zeros((), device=device)
            for loss in mem.accumulate([lambda x=x, y=y: forward(x, y) for x, y in batches]):
                total += loss
            mem.clip_and_step(args.clip)
            return total.item()

        tokens = accum * args.batch * args.seq
        out = util.timed_steps(device, args.steps, args.warmup, batch_of, step, tokens, timers=timers)
        flops = accum * util.step_flops(n_linear, n_layer, width, args.batch, args.seq)
        out["tokens_per_step"] = tokens
        out.update(params=n_params, linear_params=n_linear, step_flops=flops, plan=mem.describe(),
                   achieved_flops=flops / out["median_step_s"])
        if timers is not None:
            out["engine_peaks"] = mem.peak_memory()
            out["plan_vs_measured"] = mem.plan_record(out["median_step_s"])
            out["placement"] = util.placement_of(mem)  # what replay_gpu_plans.py predicts again
            out["moved_per_step"] = util.moved_per_step(mem.model, args.steps)
            out["accumulation"] = mem.plan.accumulation  # unit- or micro-batch-major (MemorySetup.accumulate)
        return out
    finally:
        mem.close()


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["auto", "llama", "gpt"], default="auto",
                    help="auto: Llama where transformers is installed, else the project's GPT")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--gpt-layers", type=int, default=20, help="layers of the GPT that stands in for the Llama")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory cap of every side but plain-uncapped")
    ap.add_argument("--gpu-mem-gib", type=float, default=None, help="tightfit's --gpu-mem (default: the cap)")
    ap.add_argument("--sides", default="plain,tightfit,tightfit-host,tightfit-nvme",
                    help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--device", default=None, help="cuda (default where there is one) or cpu (smoke test)")
    ap.add_argument("--nvme", default=None, help="swap folder of the tightfit-nvme side (default: a temporary one)")
    ap.add_argument("--host-accum", type=int, default=1, help="micro-batches per step of the tightfit-host side "
                    "(8: 32k tokens per step at 2 x 2048, where the CPU optimizer's time is spread over them)")
    ap.add_argument("--clip", type=float, default=0.0, help="gradient clipping of every side (0: none)")
    ap.add_argument("--json-out", default=None, help="also write the figures to this file")
    ap.add_argument("--isolate", action="store_true", help="each side in its own process on the CPU too "
                    "(always so on a GPU)")
    ap.add_argument("--side", help=argparse.SUPPRESS)  # one side, in a child process
    ap.add_argument("--result", help=argparse.SUPPRESS)  # where the child writes its result
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps <= args.warmup:
        ap.error(f"--steps must be more than --warmup ({args.warmup})")
    unknown = set(args.sides.split(",")) - set(SIDES)
    if unknown:
        ap.error(f"--sides: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SIDES)}")
    return args


def _child_argv(args) -> list[str]:
    keys = ("model", "layers", "gpt_layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "batch", "seq",
            "steps", "warmup", "cap_gib", "gpu_mem_gib", "device", "nvme", "host_accum", "clip")
    argv = []
    for k in keys:
        if getattr(args, k) is not None:
            argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return argv


def main() -> None:
    args = parse_args()
    if args.side:
        util.child_main(args.result, lambda: run_side(args, args.side))
        return
    import torch

    kind, why = _which_model(args)
    here = args.device == "cpu" and not args.isolate
    results: dict = {"benchmark": "bench_gpu_llama", "model": kind, "model_note": why,
                     "config": {k: v for k, v in vars(args).items() if k not in ("side", "result", "isolate")}}
    sides = [s for s in SIDES if s in args.sides.split(",")]
    for side in list(sides):
        results[side] = util.run_side(__file__, side, _child_argv(args),
                                      (lambda s=side: run_side(args, s)) if here else None)
        if side == "plain" and results[side].get("out_of_memory"):
            results[side]["fits_under_cap"] = False
            sides.append("plain-uncapped")
            results["plain-uncapped"] = util.run_side(__file__, "plain-uncapped", _child_argv(args),
                                                      (lambda: run_side(args, "plain-uncapped")) if here else None)
        util.save_partial(args.json_out, results)
    # Measured after the sides, so this process holds no GPU memory while they run.
    try:
        peak = results["peak"] = util.peak_flops(torch.device(args.device))
    except Exception as e:  # noqa: BLE001 - the sides' figures stand without it
        peak = results["peak"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for side in sides:
        r = results[side]
        if "achieved_flops" in r and "peak_flops" in peak:
            r["mfu"] = r["achieved_flops"] / peak["peak_flops"]
            r["mfu_vs_measured_matmul"] = r["achieved_flops"] / peak["measured_matmul_bf16_flops"]
    plain = next((results[s] for s in ("plain", "plain-uncapped") if "tokens_per_s" in results.get(s, {})), None)
    if plain:
        for side in ("tightfit", "tightfit-host", "tightfit-nvme"):
            if "tokens_per_s" in results.get(side, {}):
                results[side]["tokens_per_s_over_plain"] = results[side]["tokens_per_s"] / plain["tokens_per_s"]
    failed = [s for s in sides if "error" in results[s] and not (s == "plain" and "plain-uncapped" in results)]
    results["failed_sides"] = failed
    util.write_json(args.json_out, results)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
