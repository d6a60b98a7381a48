"""Arithmetic for scale-out planning: what a model needs (`ModelProfile`), what the machines have (`Hardware`),
and the memory per GPU and communication per step of a `ParallelPlan`.

Why arithmetic and not measurement: `tightfit plan` answers for hardware it does not have ("what if 2 nodes of 8
H100s?"), and `--strategy auto` must decide before any process group exists. The formulas are the standard ones
(ZeRO paper sec. 5 and 7, Megatron-LM sec. 3, Korthikanti et al. 2022 for activations) and are written out next to
each term; benchmarks/bench_parallel.py checks the communication figures against bytes actually sent.

Bytes per parameter (`ModelProfile.weight_bytes` etc.): fp32 training keeps weights 4, gradients 4, Adam moments 8;
mixed precision (bf16/fp16) keeps weights 2, gradients 2, and 12 of "optimizer state" (fp32 master + 2 moments).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.nn as nn

from tightfit.errors import UsageError
from tightfit.parallel.plan import ParallelPlan

FAST_LINKS = ("nvlink", "nvswitch", "infiniband")
"""Interconnects fast enough that parameter/gradient sharding (ZeRO, TP) costs about what PP does."""
INTERCONNECTS = ("nvlink", "nvswitch", "pcie", "infiniband", "ethernet")


@dataclass(frozen=True)
class Hardware:
    """A (possibly hypothetical) cluster: `nnodes` nodes of `gpus_per_node` GPUs of `gpu_mem` bytes each."""

    gpus_per_node: int = 1
    nnodes: int = 1
    gpu_mem: int = 80 * 2**30
    """Usable bytes per GPU."""
    interconnect: str = "pcie"
    """The slowest link a collective crosses: within a node nvlink/nvswitch/pcie, across nodes infiniband/ethernet."""

    def __post_init__(self) -> None:
        if self.interconnect not in INTERCONNECTS:
            raise UsageError(f"--interconnect: {self.interconnect!r} is not one of {', '.join(INTERCONNECTS)}")
        if self.gpus_per_node < 1 or self.nnodes < 1 or self.gpu_mem <= 0:
            raise UsageError("hardware: --nproc-per-node, --nnodes and --gpu-mem must be positive")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nnodes

    @property
    def fast(self) -> bool:
        return self.interconnect in FAST_LINKS


@dataclass(frozen=True)
class ModelProfile:
    """The sizes that decide a strategy. Counts are elements; `*_bytes` properties apply the precision."""

    n_params: int
    largest_layer_params: int
    """Largest single Linear/Embedding: what tiling would split, and what TP splits."""
    largest_block_params: int
    """Largest transformer block: what ZeRO-3 gathers at once."""
    n_layers: int
    n_heads: int
    hidden: int
    vocab: int
    seq_len: int = 1024
    micro_batch: int = 1
    mixed_precision: bool = True
    blocks_params: int = 0
    """Parameters in the repeated blocks (0: unknown, taken as all). ZeRO-3 re-gathers these in backward; the
    rest (embeddings, head) stays gathered from forward to backward."""
    checkpointed: bool = False
    """Every block recomputes its forward in backward (parallel/activation_checkpoint.py)."""

    @property
    def weight_bytes(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def grad_bytes(self) -> int:
        return 2 if self.mixed_precision else 4

    @property
    def optim_bytes(self) -> int:
        return 12 if self.mixed_precision else 8

    @property
    def state_bytes(self) -> int:
        """Weights + gradients + optimizer states of the whole model (16 bytes/param either way)."""
        return self.n_params * (self.weight_bytes + self.grad_bytes + self.optim_bytes)

    @property
    def largest_layer_bytes(self) -> int:
        """What the largest layer needs on the GPU while it computes: its weights and their gradients."""
        return self.largest_layer_params * (self.weight_bytes + self.grad_bytes)

    @property
    def activation_bytes(self) -> int:
        """Activations kept for backward, whole model, one micro-batch (Korthikanti et al.: 34·s·b·h bytes per
        layer in 16-bit plus 5·a·s²·b for attention scores; doubled in fp32). Checkpointed: each layer's input
        (2·s·b·h) and one layer's activations while it recomputes (their "full recomputation")."""
        s, b, h, a = self.seq_len, self.micro_batch, self.hidden, self.n_heads
        per_layer = 34 * s * b * h + 5 * a * s * s * b
        kept = self.n_layers * 2 * s * b * h + per_layer if self.checkpointed else self.n_layers * per_layer
        return kept * (1 if self.mixed_precision else 2)

    def fits(self, gpu_mem: int) -> bool:
        return self.state_bytes + self.activation_bytes <= gpu_mem

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_model(cls, model: nn.Module, seq_len: int, micro_batch: int, mixed_precision: bool) -> "ModelProfile":
        """Profile a model (a meta-device model is fine: only shapes are read)."""
        from tightfit.parallel.data_parallel import repeated_blocks

        blocks = repeated_blocks(model)
        leaves = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))
                  or type(m).__name__ == "Conv1D"]
        cfg = getattr(model, "config", None)
        hidden = getattr(cfg, "n_embd", None) or getattr(cfg, "hidden_size", None) or 0
        heads = getattr(cfg, "n_head", None) or getattr(cfg, "num_attention_heads", None) or 1
        vocab = getattr(cfg, "vocab_size", 0)
        return cls(n_params=sum(p.numel() for p in model.parameters()),
                   largest_layer_params=max((sum(p.numel() for p in m.parameters(recurse=False)) for m in leaves),
                                            default=0),
                   largest_block_params=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
                   n_layers=len(blocks), n_heads=heads, hidden=hidden, vocab=vocab, seq_len=seq_len,
                   micro_batch=micro_batch, mixed_precision=mixed_precision,
                   blocks_params=sum(p.numel() for b in blocks for p in b.parameters()))


def memory_per_gpu(plan: ParallelPlan, prof: ModelProfile) -> dict[str, int]:
    """Bytes per GPU by kind under `plan` (the most loaded rank; stages are assumed balanced).

    Model parallelism (pp × tp) divides everything; then ZeRO divides optimizer states (1), + gradients (2),
    + weights (3) over dp. ZeRO-3 also holds one gathered block; with CPU offload only that stays on the GPU.
    """
    d = plan.dims
    mp = d.pp * d.tp
    p = prof.n_params / mp
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[plan.dp_mode] if d.dp > 1 or plan.cpu_offload else 0
    w = p * prof.weight_bytes / (d.dp if stage >= 3 else 1)
    g = p * prof.grad_bytes / (d.dp if stage >= 2 else 1)
    o = p * prof.optim_bytes / (d.dp if stage >= 1 else 1)
    gathered = prof.largest_block_params / d.tp * prof.weight_bytes * 2 if stage == 3 else 0
    if stage >= 2 and d.pp > 1:
        # torch's pipeline schedule keeps an FSDP2 stage's parameters gathered and its gradients unsharded from the
        # first micro-batch's backward to the step's end (pipelining/stage.py: no reshard after backward, no
        # reduction until the last): the stage's whole parameters and gradients, beside the shards at rest
        gathered, g = p * prof.weight_bytes, p * prof.grad_bytes
    if plan.cpu_offload:  # on the GPU only the units kept there (unit_split.py): fp32 shard, gradient, moments
        kept = sum(n for _, n in plan.kept_on_device) / d.tp
        w, g, o = kept * 4, kept * 4, kept * 8
    # Activations: a stage holds its layers' activations for the micro-batches in flight (pp for 1F1B, all m for
    # GPipe); TP splits most of them by tp.
    in_flight = 1 if d.pp == 1 else (min(d.pp, plan.pp_microbatches) if plan.pp_schedule == "1f1b"
                                     else plan.pp_microbatches)
    act = prof.activation_bytes / d.pp / d.tp * in_flight
    out = {"weights": int(w), "grads": int(g), "optim": int(o), "gathered": int(gathered), "activations": int(act)}
    out["total"] = sum(out.values())
    return out


def comm_per_step(plan: ParallelPlan, prof: ModelProfile, global_batch: int | None = None,
                  micro_batches: int = 1) -> dict[str, int]:
    """Bytes each GPU sends per optimizer step, by dimension (ring collectives: an all-reduce of X bytes over n
    ranks sends 2(n−1)/n·X, an all-gather or reduce-scatter (n−1)/n·X, a broadcast from each owner ~(n−1)/n·X).

    - dp, ddp: gradient all-reduce, 2Ψ·(n−1)/n. zero1 (torch ZeroRedundancyOptimizer): the same all-reduce plus
      the broadcast of updated parameters, 3Ψ (the ZeRO paper's 2Ψ assumes a reduce-scatter instead). zero2:
      all-gather + reduce-scatter, 2Ψ. zero3: all-gather in forward and (blocks only) in backward +
      reduce-scatter, ≤ 3Ψ.
    - tp: 4 all-reduces of the [b, s, h] activations per layer per micro-batch (2 forward, 2 backward).
    - pp: each micro-batch's activation forward and its gradient backward across each stage boundary.
    `micro_batches` (`--grad-accum`, pp == 1): ZeRO-2/3 gather and reduce-scatter again for each (parallelize.py's
    forward_backward), DDP and ZeRO-1 all-reduce once a step.
    """
    d = plan.dims
    psi = prof.n_params / (d.pp * d.tp)  # elements this rank's dp group reduces
    n = d.dp
    dp_bytes = 0.0
    if n > 1:
        frac = (n - 1) / n
        g, w = psi * prof.grad_bytes, psi * prof.weight_bytes
        # ZeRO-3 gathers every weight in forward and the blocks' again in backward (tightfit keeps the root group
        # gathered between the two: it is needed again at once).
        w_again = (prof.blocks_params or prof.n_params) / (d.pp * d.tp) * prof.weight_bytes
        dp_bytes = {"ddp": 2 * frac * g, "zero1": 2 * frac * g + frac * w, "zero2": frac * (g + w),
                    "zero3": frac * (w + w_again + g)}[plan.dp_mode]
        if plan.dp_mode in ("zero2", "zero3") and d.pp == 1:
            dp_bytes *= micro_batches
    mb = prof.micro_batch
    micro = plan.pp_microbatches if d.pp > 1 else 1
    act = mb * prof.seq_len * prof.hidden * prof.weight_bytes  # one [b, s, h] activation
    tp_bytes = 0.0
    if d.tp > 1:
        tp_bytes = 4 * 2 * (d.tp - 1) / d.tp * act * (prof.n_layers / d.pp) * micro
    pp_bytes = 2 * act * micro if d.pp > 1 else 0.0
    out = {"dp": int(dp_bytes), "tp": int(tp_bytes), "pp": int(pp_bytes)}
    out["total"] = sum(out.values())
    return out
