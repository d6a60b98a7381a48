"""Train a plain torch.nn model with tightfit.wrap: nothing in the model or the loop changes.

    python examples/wrap_plain_torch.py [--steps N]

Two models, each wrapped with a different placement:
- an `nn.TransformerEncoder` regressor: its `layers` ModuleList holds repeated blocks, so each layer becomes an
  offload unit by itself (automatic detection); every state goes to NVMe (a swap folder in /tmp here);
- an `nn.Sequential` MLP: nothing repeats inside a ModuleList, so the units are named explicitly
  (`units=["0", "2", "4"]`, module paths as in `named_modules()`); its fp32 masters and Adam moments go to host
  memory while the compute weights stay on the device.
Both must match the same model trained with plain torch.optim.AdamW, which is checked at the end.
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch
import torch.nn as nn

import tightfit
import tightfit.optim
from tightfit import Placement, Tier, UnitPlacement
from tightfit.offload.step.engine import engine_of


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, make_batch) -> float:
    """The ordinary loop."""
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        x, y = make_batch(g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)

    # 1. nn.TransformerEncoder: units found automatically (layers.0 ... layers.3), all states on NVMe.
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=4, enable_nested_tensor=False)
    target = torch.randn(32, 32)

    def seq_batch(g):
        x = torch.randn(8, 16, 32, generator=g)
        return x, x @ target  # [B, T, 32] -> [B, T, 32]

    plain = copy.deepcopy(encoder)
    swap = tempfile.mkdtemp(prefix="tightfit-swap-")
    tightfit.wrap(encoder, Placement.everywhere(Tier.NVME, nvme_dir=swap))
    print("encoder units:", list(engine_of(encoder).units))
    ours = train(encoder, tightfit.optim.AdamW(encoder.parameters(), lr=1e-3), args.steps, seq_batch)
    ref = train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), args.steps, seq_batch)
    print(f"encoder: final loss {ours:.5f} wrapped, {ref:.5f} plain PyTorch")
    assert abs(ours - ref) <= 1e-4 * abs(ref) + 1e-6

    # 2. nn.Sequential MLP: explicit units; compute weights on the device, masters and moments on the host.
    mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def mlp_batch(g):
        x = torch.randn(64, 16, generator=g)
        return x, x.sin().sum(-1, keepdim=True)

    plain = copy.deepcopy(mlp)
    placement = Placement(default=UnitPlacement(params=Tier.DEVICE, master=Tier.HOST, grads=Tier.HOST,
                                                optim=Tier.HOST))
    tightfit.wrap(mlp, placement, units=["0", "2", "4"])
    print("mlp units:", list(engine_of(mlp).units))
    ours = train(mlp, tightfit.optim.AdamW(mlp.parameters(), lr=1e-2), args.steps, mlp_batch)
    ref = train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2), args.steps, mlp_batch)
    print(f"mlp: final loss {ours:.5f} wrapped, {ref:.5f} plain PyTorch")
    assert abs(ours - ref) <= 1e-4 * abs(ref) + 1e-6
    for model in (encoder, mlp):
        engine_of(model).close()


if __name__ == "__main__":
    main()
