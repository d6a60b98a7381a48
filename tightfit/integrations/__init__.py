"""Adapters that let other training frameworks drive a wrapped model.

Why a package of its own: the engine and `tightfit.optim` know nothing about any framework; each integration is
one file that maps a framework's hooks (clipping, gradient-norm logging, checkpoint files) onto tightfit's public
calls, and imports its framework only when used.

- `tightfit.integrations.hf_trainer`: `TightfitTrainer`, a `transformers.Trainer` whose model is wrapped (PEFT
  models included).
"""
