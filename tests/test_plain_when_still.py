"""`--offload auto` where nothing would move: plain PyTorch and fused AdamW run the step, under the plan.

[Note: nothing to move, no engine] in tightfit/planner/planner.py: a placement with every state on the device, no
tile and no checkpointed unit leaves the engine only its own cost, so `tightfit train` plans and runs plain PyTorch
there; anything the plan moves, tiles or recomputes keeps the engine.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import tightfit.train.memory as memory
from tightfit.cli import main
from tightfit.config import Config
from tightfit.models.gpt import GPT, GPTConfig
from tightfit.planner import HardwareProfile, make_plan
from tightfit.train.checkpoint import read_all

GPU = HardwareProfile.synthetic()


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=4, n_embd=256, n_head=4, vocab_size=256))


def _cfg(grad_accum: int = 1, **memory_flags) -> Config:
    c = Config()
    c.train.micro_batch, c.train.seq_len, c.train.precision, c.train.grad_accum = 8, 128, "fp32", grad_accum
    for k, v in memory_flags.items():
        setattr(c.memory, k, v)
    return c


def test_a_plan_that_moves_nothing_is_plain_pytorch_when_the_loop_can_run_it():
    hw = replace(GPU, unit_overhead_s=3e-4, step_overhead_s=5e-4)  # the engine's own host time, as probed
    engine = make_plan(_meta_gpt(), _cfg(), hw)
    plain = make_plan(_meta_gpt(), _cfg(), hw, plain_if_still=True)
    assert engine.shape.engine  # `tightfit.plan(...)`: a user's `tightfit.wrap` runs the engine
    assert not plain.shape.engine and plain.mode == "auto"
    assert plain.reasons[0].startswith("engine: none") and "--offload device" in plain.reasons[0]
    assert "plain PyTorch, no offload engine" in plain.summary() and "engine: none" in plain.summary()
    # The same states on the same device; the engine's own host time is not in plain PyTorch's step.
    assert plain.prediction.peak["device"] == pytest.approx(engine.prediction.peak["device"], rel=0.05)
    assert plain.prediction.host_s < engine.prediction.host_s
    assert plain.prediction.step_s <= engine.prediction.step_s


def test_under_autocast_the_engine_stays():
    """bf16: plain PyTorch would keep fp32 parameters (frozen ones too) and their casts, which the plan does not
    count."""
    c = _cfg()
    c.train.precision = "bf16"
    assert make_plan(_meta_gpt(), c, GPU, plain_if_still=True).shape.engine


@pytest.mark.parametrize("flags, why", [
    ({"gpu_mem": "64MiB"}, "states offloaded"),
    ({"checkpointing": "on"}, "units recomputed"),
    ({"accumulation": "unit"}, "unit-major order asked for"),
    ({"offload": "device"}, "the engine asked for"),
])
def test_the_engine_stays_wherever_it_has_work(flags, why):
    plan = make_plan(_meta_gpt(), _cfg(grad_accum=4, **flags), GPU, plain_if_still=True)
    assert plan.shape.engine, why


def _args(tiny_args, out_dir) -> list[str]:
    i = tiny_args.index("--out-dir")
    return tiny_args[: i + 1] + [str(out_dir)] + tiny_args[i + 2:]


def _run(tiny_args, out_dir, *extra) -> list[dict]:
    assert main(["train", *_args(tiny_args, out_dir), "--steps", "6", *extra]) == 0
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records if r["kind"] == "train"]


def _same_weights(a, b, prefixes: tuple[str, ...] = ("model.",)) -> bool:
    """Do the checkpoints of runs `a` and `b` hold the same tensors under `prefixes`, bit for bit?"""
    wa, wb = ({k: v for k, v in read_all(run).items() if k.startswith(prefixes)} for run in (a, b))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_auto_runs_plain_pytorch_bit_for_bit_and_compares_it_with_its_plan(tiny_args, tmp_path, capsys, monkeypatch):
    none = _run(tiny_args, tmp_path / "none", "--offload", "none")
    built = []
    real = memory.OffloadMemory.__init__
    monkeypatch.setattr(memory.OffloadMemory, "__init__", lambda *a, **k: (built.append(1), real(*a, **k))[1])
    auto = _run(tiny_args, tmp_path / "auto")
    out = capsys.readouterr().out
    assert not built, "the engine was built for a plan that moves nothing"
    assert "engine: none" in out and "predicted vs measured" in out and "process RSS" in out
    assert _losses(auto) == _losses(none) and _losses(auto)
    assert _same_weights(tmp_path / "auto", tmp_path / "none", ("model.", "optim."))
    record = next(r for r in auto if r["kind"] == "plan_vs_measured")
    assert record["measured"]["rss_peak"] > 0 and record["predicted"]["rss_peak"] > 0
    # --offload device still runs the engine on the same tier, and resumes the plain run's checkpoint.
    assert main(["train", *_args(tiny_args, tmp_path / "auto"), "--steps", "8", "--resume", "--offload", "device"]) == 0
    assert built


def test_a_streamed_hugging_face_model_is_filled_in_place(tiny_args, tmp_path, llama_folder):
    """An offloadable HF model is built on the meta device and its weights read in afterwards: plain PyTorch
    allocates its parameters (tied ones once) before they are read."""
    pytest.importorskip("transformers")
    model = ["--model", f"hf:{llama_folder}"]
    none = _run(tiny_args, tmp_path / "none", *model, "--offload", "none")
    auto = _run(tiny_args, tmp_path / "auto", *model)
    assert _losses(auto) == _losses(none)


def test_a_lora_fine_tune_that_fits_is_plain_pytorch_with_the_adapters_of_a_plain_run(tiny_args, tmp_path,
                                                                                     llama_folder):
    """The frozen base streamed in under peft's names, the adapters' initial values drawn as a plain run draws
    them: the same steps as `--offload none`."""
    pytest.importorskip("peft")
    flags = ["--model", f"hf:{llama_folder}", "--lora", "r=4,alpha=8"]
    none = _run(tiny_args, tmp_path / "none", *flags, "--offload", "none")
    auto = _run(tiny_args, tmp_path / "auto", *flags)
    assert _losses(auto) == _losses(none) and _losses(auto)
    assert _same_weights(tmp_path / "auto", tmp_path / "none")


def test_tied_weights_streamed_in_stay_one_parameter(tiny_args, tmp_path):
    """GPT-2 ties its head to its embedding: built on the meta device, the two modules hold one parameter, which
    plain PyTorch allocates once, so it trains as one (as `--offload none`'s model does)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256,
                                                         n_positions=64)).save_pretrained(folder)
    flags = ["--model", f"hf:{folder}"]
    none = _run(tiny_args, tmp_path / "none", *flags, "--offload", "none")
    auto = _run(tiny_args, tmp_path / "auto", *flags)
    assert _losses(auto) == _losses(none) and _losses(auto)
    assert _same_weights(tmp_path / "auto", tmp_path / "none")
