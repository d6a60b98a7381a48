"""`tightfit train` on fine-tuning records from the command line: LoRA on the NVMe tier exported for peft and merged,
the token cache, resuming at the same example, the record formats and the bad records (one line, exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import peft
import pytest
import torch
import transformers

import sft_helpers as h
from tightfit.cli import main

SEQ = 64


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    model, _ = h.setup(tmp_path_factory.mktemp("ft"), seq=SEQ)
    return model


def _args(llama: Path, data: Path, out: Path, *extra: str, steps: int = 4) -> list[str]:
    return ["train", "--model", f"hf:{llama}", "--data", str(data), "--seq-len", str(SEQ), "--micro-batch", "2",
            "--grad-accum", "2", "--steps", str(steps), "--lr", "1e-2", "--warmup-steps", "0", "--log-interval", "1",
            "--eval-interval", str(steps), "--eval-batches", "2", "--tensorboard", "off", "--out-dir", str(out),
            *extra]


def _losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


def test_lora_on_nvme_exports_an_adapter_peft_loads_and_a_merged_model_with_its_logits(llama, tmp_path):
    data = h.write_jsonl(tmp_path / "chat.jsonl", h.chat_records(40))
    swap = tmp_path / "swap"
    swap.mkdir()
    out, adapter, merged = tmp_path / "run", tmp_path / "adapter", tmp_path / "merged"
    lora = ["--lora", "r=8,alpha=16,targets=q_proj,k_proj,v_proj,o_proj", "--offload", "nvme", "--nvme", str(swap)]
    assert main(_args(llama, data, out, *lora, "--export-hf", str(adapter))) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    x = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(input_ids=x).logits
    tuned = peft.PeftModel.from_pretrained(base, adapter).eval()
    assert sorted(tuned.peft_config["default"].target_modules) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    with torch.no_grad():
        adapted = tuned(input_ids=x).logits
    assert (adapted - plain).abs().max() > 1e-4  # the adapters were trained (B starts at zero)
    # The finished run, exported again with the adapters merged into the base.
    assert main(_args(llama, data, out, *lora, "--resume", "--export-hf", str(merged), "--merge-lora")) == 0
    whole = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert not any("lora" in n for n, _ in whole.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(whole(input_ids=x).logits, adapted, rtol=0, atol=1e-5)


def test_a_resumed_fine_tune_continues_at_the_same_example(llama, tmp_path):
    data = h.write_jsonl(tmp_path / "pc.jsonl", h.prompt_completion_records(40))
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main(_args(llama, data, whole, steps=6)) == 0
    assert main(_args(llama, data, parts, "--stop-at", "3", steps=6)) == 0
    assert main(_args(llama, data, parts, "--resume", steps=6)) == 0
    assert _losses(parts) == _losses(whole)  # bitwise: the same rows, in the same order, after the resume


def test_the_token_cache_is_reused_and_remade_when_the_data_changes(llama, tmp_path, capsys):
    data = h.write_jsonl(tmp_path / "text.jsonl", h.text_records(40))
    out = tmp_path / "run"
    assert main(_args(llama, data, out, "--keep-checkpoints", "0")) == 0
    assert "tokenized 40 records" in capsys.readouterr().out
    assert main(_args(llama, data, out, "--keep-checkpoints", "0")) == 0
    assert "from the token cache" in capsys.readouterr().out
    h.write_jsonl(data, h.text_records(41))
    assert main(_args(llama, data, out, "--keep-checkpoints", "0")) == 0
    assert "tokenized 41 records" in capsys.readouterr().out
    assert len([p for p in (out / "tokens").iterdir() if not p.name.startswith(".")]) == 2


def test_parquet_a_datasets_folder_and_jsonl_give_the_same_losses(llama, tmp_path):
    records = h.chat_records(40, seed=3)
    jsonl = h.write_jsonl(tmp_path / "chat.jsonl", records)
    ds = datasets.Dataset.from_list(records)
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    runs = {}
    for name, data in (("jsonl", jsonl), ("parquet", tmp_path / "chat.parquet"), ("saved", tmp_path / "saved")):
        assert main(_args(llama, data, tmp_path / name, "--keep-checkpoints", "0")) == 0
        runs[name] = _losses(tmp_path / name)
    assert runs["jsonl"] == runs["parquet"] == runs["saved"]


def test_masking_turn_by_turn_equals_the_templates_generation_markers(tmp_path):
    from tightfit.finetune.render import Renderer
    from tightfit.models.tokenizer import HFTokenizer

    h.make_tokenizer(tmp_path / "marked", h.MARKED_TEMPLATE)
    h.make_tokenizer(tmp_path / "plain", h.PLAIN_TEMPLATE)
    marked = Renderer(HFTokenizer(tmp_path / "marked"), "messages")
    plain = Renderer(HFTokenizer(tmp_path / "plain"), "messages")
    assert marked.markers and not plain.markers
    for i, r in enumerate(h.chat_records(30, seed=5)):
        ids, mask = plain(r, f"record {i}")
        assert (ids, mask) == marked(r, f"record {i}")
        assert 0 < sum(mask) < len(mask)


def test_turn_by_turn_on_a_byte_level_bpe_equals_chatml_generation_markers(tmp_path):
    """A real BPE, where tokens merge across a turn's edges: the rendered text's characters decide, as
    transformers decides with generation markers."""
    import tokenizer_helpers
    from tightfit.finetune.render import Renderer
    from tightfit.models.tokenizer import HFTokenizer
    from tightfit.train.data import stdlib_files

    text = "".join(f.read_text(errors="replace") for f in stdlib_files()[:60])[:300_000]
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
              "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>"
              "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folders = {}
    for name, template in (("marked", chatml), ("plain", chatml.replace("{% generation %}", "").replace(
            "{% endgeneration %}", ""))):
        folder = tokenizer_helpers.byte_level(tmp_path / name, text)
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = template
        tok.save_pretrained(folder)
        folders[name] = Renderer(HFTokenizer(folder), "messages")
    assert folders["marked"].markers and not folders["plain"].markers
    lines = [x for x in text.splitlines() if x.strip()][:400]
    for i in range(40):
        msgs = []
        for j in range(1 + i % 3):
            msgs += [{"role": "user", "content": lines[(7 * i + j) % 400]},
                     {"role": "assistant", "content": " " * (i % 2) + lines[(11 * i + 3 * j) % 400]}]
        ids, mask = folders["plain"]({"messages": msgs}, f"record {i}")
        assert (ids, mask) == folders["marked"]({"messages": msgs}, f"record {i}")
        assert 0 < sum(mask) < len(mask)


def _error(capsys, args) -> str:
    """The one line a refused run prints (without its "tightfit: error: "), having exited with 2."""
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("tightfit: error: ")
    return err[len("tightfit: error: "):]


BAD = [
    ('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n{"messages": [\n',
     "line 2: not JSON"),
    ('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n{"text": "w1"}\n',
     "line 2: has no 'messages' field"),
    ('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n'
     '{"messages": [{"role": "robot", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n',
     "line 2: the chat template refuses it (unknown role robot)"),
    ('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n'
     '{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": " "}]}\n',
     "line 2: 'messages' item 1 is an empty assistant answer"),
    ('{"prompt": "w1 w2", "completion": "w3"}\n{"prompt": "w1", "completion": 7}\n',
     "line 2: 'prompt' and 'completion' must both be strings"),
    ('[1, 2]\n', "line 1: is a JSON list"),
]


@pytest.mark.parametrize("content,message", BAD)
def test_a_bad_record_is_one_line_naming_file_and_record_and_can_be_skipped(llama, tmp_path, capsys, content,
                                                                          message):
    data = tmp_path / "bad.jsonl"
    good = h.chat_records(20) if "messages" in content else h.prompt_completion_records(20)
    data.write_text(content + "".join(json.dumps(r) + "\n" for r in good))
    err = _error(capsys, _args(llama, data, tmp_path / "run", "--keep-checkpoints", "0"))
    assert f"--data: {data} {message}" in err and "--skip-bad-records" in err, err
    if content.startswith("["):
        return  # the first record decides the format: one that is no object cannot be skipped
    assert main(_args(llama, data, tmp_path / "run", "--keep-checkpoints", "0", "--skip-bad-records")) == 0
    assert "1 bad records skipped" in capsys.readouterr().out


def test_records_flags_on_text_and_too_long_examples_are_one_line(llama, tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("w1 w2 " * 500)
    err = _error(capsys, ["train", "--data", str(corpus), "--train-on-prompt"])
    assert err.startswith("--train-on-prompt: applies to records")
    data = h.write_jsonl(tmp_path / "t.jsonl", [{"text": " ".join(["w1"] * 100)}] * 20)
    err = _error(capsys, _args(llama, data, tmp_path / "run", "--no-truncate"))
    assert err.startswith("--no-truncate: example 1 of --data has 102 tokens, more than --seq-len 64")
    err = _error(capsys, ["train", "--data", str(data), "--lora", "r=0"])
    assert err.startswith("--lora: r='0' is not valid")
    err = _error(capsys, ["train", "--model", f"hf:{llama}", "--data", str(data), "--merge-lora"])
    assert err.startswith("--merge-lora: merges the adapters")


def test_unit_major_order_on_packed_records_is_micro_batch_majors_bit_for_bit(llama, tmp_path):
    """Packed rows carry positions into every block: each unit runs its micro-batches in turn and gets the same."""
    data = h.write_jsonl(tmp_path / "chat.jsonl", h.chat_records(40, seed=6))
    runs = {}
    for order in ("unit", "micro"):
        out = tmp_path / order
        assert main(_args(llama, data, out, "--keep-checkpoints", "0", "--offload", "host", "--accumulation", order,
                          "--lora", "r=4")) == 0
        runs[order] = _losses(out)
    assert runs["unit"] == runs["micro"]


def test_held_out_records_from_val_data_or_a_dataset_dicts_validation_split(llama, tmp_path, capsys):
    train = h.chat_records(40, seed=7)
    val = h.chat_records(6, seed=8)
    h.write_jsonl(tmp_path / "train.jsonl", train)
    h.write_jsonl(tmp_path / "val.jsonl", val)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train), "validation": datasets.Dataset.from_list(val)}
                         ).save_to_disk(str(tmp_path / "dd"))
    evals = {}
    for name, extra in (("files", ["--data", str(tmp_path / "train.jsonl"), "--val-data", str(tmp_path / "val.jsonl")]),
                        ("dict", ["--data", str(tmp_path / "dd")])):
        args = _args(llama, tmp_path / "x", tmp_path / name, "--keep-checkpoints", "0")
        args[args.index("--data"):args.index("--data") + 2] = extra
        assert main(args) == 0
        assert "40 train / 6 held-out examples" in capsys.readouterr().out
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        evals[name] = [r["val_loss"] for r in rows if r.get("kind") == "eval"]
    assert evals["files"] == evals["dict"] and len(evals["files"]) == 1


def test_resuming_with_another_lora_of_the_same_shapes_is_refused(llama, tmp_path, capsys):
    data = h.write_jsonl(tmp_path / "chat.jsonl", h.chat_records(30))
    out = tmp_path / "run"
    assert main(_args(llama, data, out, "--lora", "r=4,alpha=8", "--stop-at", "2")) == 0
    err = _error(capsys, _args(llama, data, out, "--lora", "r=4,alpha=16", "--resume"))
    assert err.startswith("--lora: the checkpoint in") and "r=4,alpha=8" in err, err
