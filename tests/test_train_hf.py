"""`tightfit train --model hf:PATH`: plain and streamed-into-NVMe runs agree; --export-hf loads in transformers."""

from __future__ import annotations

import pytest
import torch
from tightfit.train.checkpoint import read_all

from tightfit.cli import main

transformers = pytest.importorskip("transformers")


def _run(tiny_args, out_dir, *extra):
    i = tiny_args.index("--out-dir")
    args = tiny_args[: i + 1] + [str(out_dir)] + tiny_args[i + 2:]
    assert main(["train", *args, "--steps", "4", *extra]) == 0
    return {k: v for k, v in read_all(out_dir).items() if k.startswith("model.")}


def test_hf_model_plain_and_streamed_to_nvme_agree_and_export(tiny_args, tmp_path, llama_folder):
    model = ["--model", f"hf:{llama_folder}"]
    plain = _run(tiny_args, tmp_path / "plain", *model, "--offload", "none")
    export = tmp_path / "export"
    nvme = _run(tiny_args, tmp_path / "nvme", *model, "--offload", "nvme", "--nvme", str(tmp_path / "swap"),
                "--export-hf", str(export))
    assert plain.keys() == nvme.keys() and len(plain) > 0
    for k in plain:
        torch.testing.assert_close(nvme[k], plain[k], rtol=1e-6, atol=0, msg=k)
    # The export is an ordinary Hugging Face folder holding the trained weights.
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), nvme[f"model.{name}"]), name
    original = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    assert not torch.equal(original.model.layers[0].mlp.up_proj.weight, loaded.model.layers[0].mlp.up_proj.weight)


def test_export_hf_refuses_the_reference_gpt(tiny_args, capsys, tmp_path):
    assert main(["train", *tiny_args, "--steps", "2", "--export-hf", str(tmp_path / "x")]) == 2
    assert "--export-hf" in capsys.readouterr().err


def test_export_hf_from_a_finished_run_without_training_more(tiny_args, tmp_path, llama_folder):
    """A run that ended without --export-hf exports later with --resume at its final step (issue 27: refused with
    "ask for more than that", so exporting cost more training)."""
    out = tmp_path / "run"
    trained = _run(tiny_args, out, "--model", f"hf:{llama_folder}", "--offload", "host")
    export = tmp_path / "export"
    _run(tiny_args, out, "--model", f"hf:{llama_folder}", "--offload", "host", "--resume", "--export-hf",
         str(export))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    for name, p in loaded.named_parameters():
        assert torch.equal(p.detach(), trained[f"model.{name}"]), name
