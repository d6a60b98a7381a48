"""Bad input: one line naming the flag or file, exit status 2, no traceback, existing checkpoints untouched."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tightfit.cli import main


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def test_real_process_exit_status_and_single_line():
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", "--gpu-mem", "8XB"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "--gpu-mem" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("extra,needle", [
    (["--data", "/nonexistent/corpus"], "--data"),
    (["--steps", "-3"], "--steps"),
    (["--gpu-mem", "8XB"], "--gpu-mem"),
    (["--micro-batch", "0"], "--micro-batch"),
    (["--seed", "99999999999999999999"], "--seed"),  # was a ValueError traceback from torch.manual_seed (issue 45)
    (["--seed", "-1"], "--seed"),
])
def test_bad_flags(tiny_args, capsys, extra, needle):
    assert main(["train", *tiny_args, *extra]) == 2
    assert needle in _error_line(capsys)


def test_help_says_each_default_once(capsys):
    """A help that states its default is not followed by "(default: None)" (issue 45)."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere, hyphens included
    assert "(default:None)" not in text
    assert "(default:byte-leveltokens,vocab256)" in text and "(default:1337)" in text
    # Each flag's help says "(default:" once: a help that words its default otherwise gets a second one appended.
    per_flag = re.split(r"(?=--[a-z])", text)
    assert all(part.count("default:") <= 1 for part in per_flag), [p for p in per_flag if p.count("default:") > 1]


def test_empty_data_folder(tiny_args, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", *tiny_args, "--data", str(empty)]) == 2
    assert "--data" in _error_line(capsys)


@pytest.fixture
def trained_run(tiny_args, tmp_path):
    assert main(["train", *tiny_args, "--steps", "3"]) == 0
    return tmp_path / "run" / "checkpoints" / "step-00000003" / "root.safetensors"  # one shard of the checkpoint


def test_resuming_a_suspect_checkpoint_warns(tiny_args, trained_run, capsys):
    """A checkpoint its run marked suspect (taken inside a loss spike), resumed by name or as the newest: a warning
    naming it and where a healthy one is (issue 45: it resumed without a word)."""
    from tightfit.train.health import SUSPECT, set_verdict

    set_verdict(trained_run.parent, SUSPECT, float("nan"))
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "4", "--resume", "--resume-step", "3"]) == 0
    out = capsys.readouterr().out
    assert "warning: the checkpoint of step 3 was taken inside a loss spike" in out, out


def test_another_model_of_the_same_shapes_is_not_resumed(tiny_args, trained_run, capsys):
    """--n-head 4 where the checkpoint's model has 2: every shape matches, the model is another (issue 45: it printed
    a notice and trained on)."""
    before = _digest(trained_run)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6", "--resume", "--n-head", "4"]) == 2
    err = _error_line(capsys)
    assert "--n-head" in err and "another model" in err
    assert _digest(trained_run) == before


def test_checkpoint_from_a_different_model(tiny_args, trained_run, capsys):
    before = _digest(trained_run)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6", "--resume", "--n-embd", "48"]) == 2
    err = _error_line(capsys)
    assert "different model" in err and "--resume" in err
    assert _digest(trained_run) == before


def test_truncated_checkpoint(tiny_args, trained_run, capsys):
    trained_run.write_bytes(trained_run.read_bytes()[:-64])
    before = _digest(trained_run)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6", "--resume"]) == 2
    assert "root.safetensors" in _error_line(capsys)
    assert _digest(trained_run) == before


def test_corrupt_checkpoint(tiny_args, trained_run, capsys):
    trained_run.write_bytes(b"garbage" * 100)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6", "--resume"]) == 2
    assert "root.safetensors" in _error_line(capsys)


def test_fresh_run_refuses_to_overwrite_a_checkpoint(tiny_args, trained_run, capsys):
    before = _digest(trained_run)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "6"]) == 2
    assert "--resume" in _error_line(capsys)
    assert _digest(trained_run) == before


def test_resume_without_a_checkpoint(tiny_args, capsys):
    assert main(["train", *tiny_args, "--steps", "3", "--resume"]) == 2
    err = _error_line(capsys)
    assert "--resume" in err and "does not exist" in err


# ---- issue 17, item 5: tracebacks that became one line (exit 2) ---------------------------------------------------

def _out_dir(tiny_args, path) -> list[str]:
    i = tiny_args.index("--out-dir") + 1
    return [*tiny_args[:i], str(path), *tiny_args[i + 1:]]


def test_out_dir_under_a_file(tiny_args, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["train", *_out_dir(tiny_args, tmp_path / "afile" / "run"), "--steps", "1"]) == 2
    err = _error_line(capsys)
    assert "--out-dir" in err and "is a file" in err


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="needs Linux /proc")
def test_unreadable_data_file(tiny_args, capsys):
    # /proc/self/mem is a regular file that fails with EIO at offset 0: unreadable even for root.
    assert main(["train", *tiny_args, "--data", "/proc/self/mem", "--steps", "1"]) == 2
    err = _error_line(capsys)
    assert "--data" in err and "cannot read /proc/self/mem" in err


@pytest.mark.parametrize("offload", ["none", "host"])
def test_beta_out_of_range_names_the_flag(tiny_args, capsys, offload):
    assert main(["train", *tiny_args, "--beta1", "1.5", "--offload", offload]) == 2
    assert "--beta1: must be in [0, 1)" in _error_line(capsys)


def _tiny_hf(folder):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2)).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("offload", ["none", "auto"])
def test_hf_weights_whose_header_is_a_json_list(tiny_args, tmp_path, capsys, offload):
    folder = _tiny_hf(tmp_path / "hf")
    header = b"[1,2,3]"
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    capsys.readouterr()
    assert main(["train", *tiny_args, "--model", f"hf:{folder}", "--offload", offload, "--steps", "1"]) == 2
    err = _error_line(capsys)
    assert "model.safetensors" in err and "not a safetensors file" in err


def test_hf_config_with_a_field_of_the_wrong_type(tiny_args, tmp_path, capsys):
    import json

    folder = _tiny_hf(tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    config["n_embd"] = config["hidden_size"] = "x"
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["train", *tiny_args, "--model", f"hf:{folder}", "--steps", "1"]) == 2
    assert "config.json: transformers cannot read it" in _error_line(capsys)


def test_probe_swap_folder_under_a_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["probe", "--nvme", str(tmp_path / "afile" / "x")]) == 2
    assert "--nvme" in _error_line(capsys)


@pytest.mark.parametrize("kwargs,needle", [
    ({"device": "gpu"}, "'gpu' is not a device"),
    ({"device": "cuda"}, "no CUDA device"),
    ({"disk": "threads0"}, "DiskTuning(threads=...)"),
])
def test_wrap_keywords(tmp_path, kwargs, needle):
    import torch

    import tightfit
    from tightfit.errors import UsageError
    from tightfit.offload.tiers.nvme.store import DiskTuning
    from tightfit.offload.placement import Placement, Tier

    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    placement = Placement.everywhere(Tier.HOST)
    if "disk" in kwargs:
        placement = Placement.everywhere(Tier.NVME, nvme_dir=str(tmp_path / "swap"))
        kwargs = {"disk": DiskTuning(threads=0)}
    with pytest.raises(UsageError, match=re.escape(needle)):
        tightfit.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4)), placement, **kwargs)
    assert not (tmp_path / "swap").exists()  # the swap folder claimed for the refused store was given back


# ---- issue 17, item 8: what was accepted in silence -----------------------------------------------------------------

@pytest.mark.parametrize("extra,needle", [
    (["--grad-clip", "nan"], "--grad-clip: must be a finite number"),
    (["--max-time", "nan"], "--max-time: must be a finite number"),
    (["--weight-decay", "inf"], "--weight-decay: must be a finite number"),
    (["--strategy", "bogus"], "--strategy: cannot read 'bogus'"),
    (["--offload", "none", "--nvme", "/tmp/x"], "--nvme: has no effect with --offload none"),
    (["--offload", "none", "--cpu-mem", "1GiB"], "--cpu-mem: has no effect with --offload none"),
])
def test_silent_acceptance_is_refused(tiny_args, capsys, extra, needle):
    assert main(["train", *tiny_args, *extra]) == 2
    assert needle in _error_line(capsys)


@pytest.mark.parametrize("toml,needle", [
    ("[train]\nmicro_batch = true\n", "train.micro_batch (--micro-batch): expected int, got True"),
    ("[train]\nsteps = 2.5\n", "train.steps (--steps): expected an integer, got 2.5"),
    ("[optim]\ngrad_clip = nan\n", "optim.grad_clip (--grad-clip): must be a finite number"),
])
def test_toml_values_of_the_wrong_kind(tiny_args, tmp_path, capsys, toml, needle):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    assert main(["train", *tiny_args, "--config", str(path)]) == 2
    assert needle in _error_line(capsys)


def test_config_that_is_a_folder(tiny_args, tmp_path, capsys):
    assert main(["train", *tiny_args, "--config", str(tmp_path)]) == 2
    assert "is a folder; give the TOML file itself" in _error_line(capsys)


def test_a_strategy_with_one_process_is_a_notice(tiny_args, capsys):
    assert main(["plan", *tiny_args, "--strategy", "zero3"]) == 0
    assert "--strategy zero3 applies to runs of several processes" in capsys.readouterr().err


def test_env_names_a_swap_folder_that_does_not_exist(tmp_path, capsys):
    assert main(["env", "--nvme", str(tmp_path / "not" / "yet")]) == 0
    out = capsys.readouterr().out
    assert f"free at {tmp_path} (swap folder {tmp_path / 'not' / 'yet'} does not exist yet" in out
    (tmp_path / "afile").write_text("x")
    assert main(["env", "--nvme", str(tmp_path / "afile" / "x")]) == 2
    assert "--nvme" in _error_line(capsys)


def test_distributed_launch_refuses_missing_data_in_one_line(tiny_args, tmp_path):
    args = [*tiny_args, "--data", str(tmp_path / "nowhere")]  # the last --data wins
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *args, "--nproc-per-node", "2"],
                          capture_output=True, text=True, timeout=120, cwd=str(Path(__file__).resolve().parent.parent))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert "--data" in proc.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,needle", [
    (["--disk-volume", "8GiB"], "add --nvme DIR"),
    (["--disk-volume", "lots", "--nvme", "{tmp}"], "cannot read size 'lots'"),
    (["--disk-volume", "1MiB", "--nvme", "{tmp}"], "below the least"),
    (["--disk-volume", "1000TiB", "--nvme", "{tmp}/new"], "free space or measure a smaller volume"),
])
def test_probe_disk_volume_errors(tmp_path, capsys, args, needle):
    argv = ["probe", *(a.replace("{tmp}", str(tmp_path)) for a in args)]
    assert main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith("tightfit: error: --disk-volume") and needle in line


def _under_address_limit(args: list[str], limit: int) -> subprocess.CompletedProcess:
    import resource

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-m", "tightfit.cli", *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=limited, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_model_that_fits_ram_but_not_the_process_limit_is_refused_before_it_is_built(tmp_path):
    """`ulimit -v 3 GiB` and a 1.6 B-parameter GPT (6.4 GB of fp32 weights, within this machine's RAM): refused by
    the size check naming the limit, not a MemoryError traceback from the allocator."""
    proc = _under_address_limit(["train", "--n-layer", "8", "--n-embd", "4096", "--steps", "1", "--out-dir",
                                 str(tmp_path / "run"), "--keep-checkpoints", "0"], 3 << 30)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "ulimit -v" in err and err.startswith("tightfit: error: --n-embd/--n-layer/--seq-len:"), err


def test_an_allocation_the_process_limit_refuses_past_the_checks_is_one_line(tmp_path):
    """A limit the size check cannot see coming (the model fits, its first step's buffers do not): one line."""
    proc = _under_address_limit(["train", "--n-layer", "2", "--n-embd", "1024", "--micro-batch", "64",
                                 "--seq-len", "512", "--steps", "1", "--offload", "none", "--out-dir",
                                 str(tmp_path / "run"), "--keep-checkpoints", "0"], 1600 << 20)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "Traceback" not in err, err[-2000:]
    assert err.splitlines()[-1].startswith("tightfit: error: out of memory: an allocation failed (its address-space "
                                          "limit, ulimit -v, is 1600 MiB)"), err


def test_an_out_dir_too_long_for_what_is_written_below_it_is_refused_before_training(tmp_path, capsys):
    """A path near PATH_MAX: its shards' paths pass 4096 bytes, so the first save failed (ENAMETOOLONG) after the
    training; a name over NAME_MAX failed at the first mkdir. Both are refused before the first step now."""
    rem = 4050 - len(str(tmp_path))
    deep = tmp_path.joinpath(*["d" * 200] * (rem // 201), "e" * (rem % 201 - 1))
    assert 4096 - 128 < len(str(deep)) < 4096  # a valid path, with too little room below it
    capsys.readouterr()
    assert main(["train", "--steps", "1", "--out-dir", str(deep)]) == 2
    err = capsys.readouterr().err.strip()
    assert "PATH_MAX" in err and err.startswith("tightfit: error: --out-dir: the path is") and len(err.splitlines()) == 1
    assert main(["train", "--steps", "1", "--out-dir", str(tmp_path / ("n" * 300))]) == 2
    err = capsys.readouterr().err.strip()
    assert "more than the 255 a file name may have" in err and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir())  # nothing made
