"""A small reference GPT built from plain torch.nn.

Why it exists: tightfit needs a model it controls end to end — for the embedded `tightfit train` default, for the
fidelity tests of every engine (offload, tiling, parallel), and as the example of the structure the unit detector
expects: a `blocks` ModuleList of identical transformer blocks plus leftovers (embeddings, final norm, head).
The model holds no distributed or offload code; those are applied from outside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape of the reference GPT."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256 for byte-level text)."""
    block_size: int = 128
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks (each is one offload unit)."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability (0 keeps training deterministic)."""
    bias: bool = True
    """Use biases in Linear and LayerNorm layers."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


def parameter_count(cfg: GPTConfig) -> int:
    """The parameters `GPT(cfg)` has, counted without building it (a model too large for the machine is refused
    before its modules exist: 100,000 blocks took minutes to build even on the meta device)."""
    d, b = cfg.n_embd, int(cfg.bias)
    block = 12 * d * d + 11 * b * d + 2 * d  # q, k, v, o; up (4d) and down; two LayerNorms
    return 2 * cfg.vocab_size * d + cfg.block_size * d + cfg.n_layer * block + d + b * d  # embeddings, head, ln_f


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        # Separate q/k/v projections (rather than one fused qkv) so tensor parallelism can split heads with a
        # plain column-wise plan: q, k, v are [B, T, C] -> [B, n_head, T, head_dim].
        q = self.q_proj(x).view(B, T, -1, C // self.n_head).transpose(1, 2)
        k = self.k_proj(x).view(B, T, -1, C // self.n_head).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, C // self.n_head).transpose(1, 2)
        drop = self.dropout if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        else:  # [B, 1, T, T] bool: causal and within each packed example
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop)
        y = y.transpose(1, 2).reshape(B, T, -1)  # [B, T, local heads * head_dim]
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.down = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer. `forward(idx, targets)` returns logits, or the mean cross-entropy if targets."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # Scaled init of the residual projections (GPT-2): keeps the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` [B, T]: each token's position in its example, restarting at 0 where an example packed into
        the row starts; attention then stays within each example."""
        B, T = idx.shape  # [B, T] int64 token ids
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        mask = None
        if positions is None:
            pos = torch.arange(T, device=idx.device)
        else:
            pos = positions
            example = torch.cumsum(torch.diff(positions, prepend=positions[:, :1] - 1) != 1, dim=1)  # [B, T]
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = ((example[:, :, None] == example[:, None, :]) & causal)[:, None]  # [B, 1, T, T]
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # [B, T, C]
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
        logits = self.head(self.ln_f(x))  # [B, T, vocab]
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
