"""Checkpoints that scale: shards written in the background with bounded memory, committed by the index, leftovers
of a killed save cleaned at the next start, the disk a checkpoint needs checked before training, kill -9 safe."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import re
import signal
import subprocess
import sys
import threading
import time

from pathlib import Path

import pytest
import torch

from tightfit.cli import main
from tightfit.errors import UsageError
from tightfit.train import checkpoint as ckpt
from tightfit.train import checkpoint_writer as cw

RNG = {ckpt.RNG_TORCH: torch.get_rng_state(), ckpt.RNG_DATA: torch.Generator().get_state()}


def _groups(n=3, numel=1024):
    return [(f"blocks.{i}", [(f"model.blocks.{i}.w", torch.full((numel,), float(i)))]) for i in range(n)]


def test_save_returns_before_the_disk_is_written(tmp_path, monkeypatch):
    """The step after a save does not wait for the disk: start_save returns with the shards still being written."""
    release = threading.Event()
    real = cw.write_shard

    def slow(path, items, metadata=None):
        release.wait(30)
        return real(path, items, metadata)

    monkeypatch.setattr(cw, "write_shard", slow)
    t0 = time.perf_counter()
    writer = ckpt.start_save(tmp_path / "c", _groups(), step=1, config={}, signature="", rng=RNG)
    assert time.perf_counter() - t0 < 5 and not writer.done()
    assert ckpt.latest(tmp_path / "c") is None  # nothing committed yet
    release.set()
    folder = writer.wait()
    assert folder == tmp_path / "c" / "step-00000001" and ckpt.latest(tmp_path / "c") == folder
    assert torch.equal(ckpt.read_all(folder)["model.blocks.2.w"], torch.full((1024,), 2.0))


def test_queue_bounds_the_memory_held(tmp_path, monkeypatch):
    """`put` blocks while the groups waiting for the disk exceed queue_bytes (one group always passes)."""
    release = threading.Event()
    real = cw.write_shard
    monkeypatch.setattr(cw, "write_shard", lambda *a: (release.wait(30), real(*a))[1])
    writer = cw.CheckpointWriter(tmp_path / "c", 1, queue_bytes=6000)
    writer.put("a", [("model.a", torch.zeros(1024))])  # 4 KiB: taken by the writer thread, held until written
    done = threading.Event()
    threading.Thread(target=lambda: (writer.put("b", [("model.b", torch.zeros(1024))]), done.set())).start()
    assert not done.wait(0.5)  # 8 KiB would be queued: waits for the disk
    release.set()
    assert done.wait(10)
    writer.close(ckpt.index_fields(step=1, config={}, signature=""))
    assert writer.wait() is not None


def test_failed_save_keeps_the_previous_checkpoint_and_leaves_nothing(tmp_path, monkeypatch):
    root = tmp_path / "c"
    first = ckpt.save_checkpoint(root, [("model.w", torch.ones(4))], step=1, config={}, signature="", rng=RNG)
    calls = []
    real = cw.write_shard

    def full_disk(path, items, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, items, metadata)

    monkeypatch.setattr(cw, "write_shard", full_disk)
    writer = ckpt.start_save(root, _groups(), step=2, config={}, signature="", rng=RNG)
    with pytest.raises(UsageError, match="No space left on device.*previous checkpoint is untouched"):
        writer.wait()
    assert sorted(p.name for p in root.iterdir()) == [first.name]
    assert torch.equal(ckpt.read_all(first)["model.w"], torch.ones(4))


class _LateEnd(threading.Event):
    """The writer thread's `done` event, set by that thread, which then lingers (as a descheduled thread would)."""

    def set(self):
        super().set()
        if threading.current_thread().name == "tightfit-checkpoint":
            time.sleep(0.5)


@pytest.mark.parametrize("how", ["wait", "abort"])
def test_no_writer_thread_outlives_wait_or_abort(tmp_path, how):
    """A distributed rank ends its process right after its last save ([Note: leaving the process group]): once
    `wait()` or `abort()` returns, the writer thread has ended, not merely signalled that it is done."""
    writer = cw.CheckpointWriter(tmp_path / "c", 1)
    writer._done = _LateEnd()  # before any group: the thread is waiting for work and has not touched it
    writer.put("a", [("model.a", torch.zeros(16))])
    if how == "wait":
        writer.close(ckpt.index_fields(step=1, config={}, signature=""))
        assert writer.wait() is not None
    else:
        writer.abort()
    assert [t.name for t in threading.enumerate() if t.name == "tightfit-checkpoint"] == []


def test_non_finite_tensor_is_never_committed(tmp_path):
    root = tmp_path / "c"
    ckpt.save_checkpoint(root, [("model.w", torch.ones(4))], step=1, config={}, signature="", rng=RNG)
    bad = [("model.w", torch.tensor([1.0, float("nan"), 2.0, 3.0]))]
    with pytest.raises(UsageError, match="model.w holds nan at step 2.*previous checkpoint"):
        ckpt.save_checkpoint(root, bad, step=2, config={}, signature="", rng=RNG)
    assert [s for s, _ in cw.committed(root)] == [1]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]


def test_leftovers_of_a_killed_save_are_cleaned_at_the_next_start(tiny_args, tmp_path, capsys):
    """Only what a save or a removal of tightfit's left is removed: folders that carry its marker (or are empty);
    a folder the user made is never removed, even one named like a checkpoint or a partial save (issue 27)."""
    assert main(["train", *tiny_args, "--steps", "3", "--offload", "none"]) == 0
    root = tmp_path / "run" / "checkpoints"
    partial = root / ".partial-step-00000009-4242"  # a save killed mid-way: the marker is its first file
    partial.mkdir()
    (partial / cw.OWNED).touch()
    (partial / "blocks.0.safetensors").write_bytes(b"x" * 100)
    removing = root / ".removing-step-00000002-4242"  # a removal killed after the rename
    removing.mkdir()
    (removing / cw.OWNED).touch()
    (removing / "index.json").write_text("{}")
    (root / ".removing-step-00000001-4242").mkdir()  # killed after the marker went, before the folder did
    user = {"step-00000007": "root.safetensors", ".partial-step-00000008-1": "mine.txt", "step-mine": "x"}
    for folder, file in user.items():  # the user's folders: no marker
        (root / folder).mkdir()
        (root / folder / file).write_bytes(b"precious")
    (root / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["train", *tiny_args, "--steps", "5", "--resume", "--offload", "none"]) == 0
    out = capsys.readouterr().out
    assert ("removed what an interrupted save left in " f"{root}: .partial-step-00000009-4242, "
            ".removing-step-00000001-4242, .removing-step-00000002-4242") in out, out
    assert sorted(p.name for p in root.iterdir()) == sorted([*user, "notes.txt", "step-00000005"])
    for folder, file in user.items():
        assert (root / folder / file).read_bytes() == b"precious"


def test_a_removal_cut_short_anywhere_leaves_a_checkpoint_or_a_leftover(tmp_path, monkeypatch):
    """[Note: owned leftovers]: a kill at any point of a removal leaves either the whole checkpoint or a folder
    the next start removes; never a `step-*` folder with shards missing."""
    root = tmp_path / "c"
    ckpt.save_checkpoint(root, [("model.w", torch.ones(4))], step=1, config={}, signature="", rng=RNG)
    files = sorted(p.name for p in (root / "step-00000001").iterdir())
    for cut in range(len(files) + 3):  # die after `cut` filesystem operations of the removal
        shutil.rmtree(root, ignore_errors=True)
        ckpt.save_checkpoint(root, [("model.w", torch.ones(4))], step=1, config={}, signature="", rng=RNG)
        ops = [0]
        real = {"unlink": Path.unlink, "rmdir": Path.rmdir, "replace": os.replace}

        def counted(name):
            def op(*a, **k):
                if ops[0] >= cut:
                    raise KeyboardInterrupt
                ops[0] += 1
                return real[name](*a, **k)
            return op

        monkeypatch.setattr(Path, "unlink", counted("unlink"))
        monkeypatch.setattr(Path, "rmdir", counted("rmdir"))
        monkeypatch.setattr(cw.os, "replace", counted("replace"))
        with contextlib.suppress(KeyboardInterrupt):
            cw._remove_checkpoint(root / "step-00000001")
        monkeypatch.undo()
        left = [p.name for p in root.iterdir()]
        if "step-00000001" in left:
            assert sorted(p.name for p in (root / "step-00000001").iterdir()) == sorted({*files, cw.OWNED})
        cw.clean_leftovers(root)
        assert [p.name for p in root.iterdir()] in ([], ["step-00000001"]), (cut, left)


def test_a_run_whose_checkpoint_cannot_fit_is_refused_before_training(tiny_args, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cw, "free_bytes", lambda path: 100 << 10)
    assert main(["train", *tiny_args, "--steps", "3", "--offload", "none", "--save-interval", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tightfit: error: --out-dir: 2 checkpoints of this model (--keep-checkpoints 1, and the "
                          "next one written beside them before the oldest goes) need ")
    assert re.search(r"need [0-9.]+ [KM]iB but .* has 100.0 KiB free", err) and len(err.splitlines()) == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_disk_check_counts_the_new_checkpoint_beside_the_kept_ones(tiny_args, tmp_path, capsys, monkeypatch):
    """Room for one checkpoint is not enough: the next is written before the kept one goes (issue 27). Resumed, the
    kept one is already on the disk and only the new one is asked for."""
    assert main(["train", *tiny_args, "--steps", "2", "--offload", "none"]) == 0
    per = sum(p.stat().st_size for p in ckpt.latest(tmp_path / "run").iterdir())
    capsys.readouterr()
    monkeypatch.setattr(cw, "free_bytes", lambda path: int(per * 1.5))
    fresh = [a if a != str(tmp_path / "run") else str(tmp_path / "fresh") for a in tiny_args]
    assert main(["train", *fresh, "--steps", "2", "--offload", "none", "--save-interval", "1"]) == 2
    assert "2 checkpoints of this model" in capsys.readouterr().err
    assert main(["train", *fresh, "--steps", "2", "--offload", "none"]) == 0  # one save: room for one
    assert main(["train", *tiny_args, "--steps", "4", "--offload", "none", "--resume", "--save-interval", "1"]) == 0
    assert main(["train", *tiny_args, "--steps", "6", "--offload", "none", "--resume", "--keep-checkpoints", "2",
                 "--save-interval", "1"]) == 2
    assert "2 checkpoints of this model (--keep-checkpoints 2" in capsys.readouterr().err
    # "Keep everything" asks room only for what the run writes: one more checkpoint here, not 10^11.
    assert main(["train", *tiny_args, "--steps", "6", "--offload", "none", "--resume", "--keep-checkpoints",
                 "100000000000"]) == 0


def test_checkpoint_size_estimate_covers_what_is_written(tiny_args, tmp_path):
    assert main(["train", *tiny_args, "--steps", "2", "--offload", "none"]) == 0
    folder = ckpt.latest(tmp_path / "run")
    written = sum(p.stat().st_size for p in folder.iterdir())
    from tightfit.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32))
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    need = cw.checkpoint_bytes(shapes, {n for n, _ in shapes})
    assert written <= need < written + (128 << 10)


def _run_cli(args):
    return subprocess.Popen([sys.executable, "-m", "tightfit.cli", "train", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _kill_trials(tiny_args, tmp_path, trials, seed):
    """Train 8 steps saving every step, kill -9 at a random moment, then resume until done: every final result
    is bit-identical to the uninterrupted run's, no checkpoint is corrupt, nothing is left over."""
    def args_for(out):
        i = tiny_args.index("--out-dir")
        return tiny_args[: i + 1] + [str(out)] + tiny_args[i + 2:] + ["--steps", "8", "--save-interval", "1",
                                                                      "--offload", "none"]
    ref_dir = tmp_path / "ref"
    assert main(["train", *args_for(ref_dir)]) == 0
    ref = ckpt.read_all(ref_dir)
    rnd = random.Random(seed)
    for trial in range(trials):
        out = tmp_path / f"t{trial}"
        proc = _run_cli(args_for(out))
        time.sleep(rnd.uniform(2.0, 6.0))  # the CLI imports torch first (~2 s): kills land in training and saves
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        root = out / "checkpoints"
        for _, folder in cw.committed(root):  # every committed checkpoint is complete and passes its checks
            ckpt.read_all(folder)
        done = [s for s, _ in cw.committed(root)][-1:] == [8]
        if not done:  # killed before the end: resume (or start again when nothing was committed)
            resume = ["--resume"] if cw.committed(root) else []
            proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *args_for(out), *resume],
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr
        got = ckpt.read_all(out)
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), f"trial {trial}"
        assert not [p for p in root.iterdir() if p.name.startswith(".partial")]


def test_kill_during_training_and_saves_then_resume_is_exact(tiny_args, tmp_path):
    _kill_trials(tiny_args, tmp_path, trials=1, seed=0)


@pytest.mark.slow
def test_kill_trials_many(tiny_args, tmp_path):
    _kill_trials(tiny_args, tmp_path, trials=20, seed=1)


def test_resume_under_another_placement_from_a_plain_run_matches(tiny_args, tmp_path):
    """Shards are per unit with the same keys whoever wrote them: a plain checkpoint resumes on NVMe and back."""
    i = tiny_args.index("--out-dir")

    def at(name):
        return tiny_args[: i + 1] + [str(tmp_path / name)] + tiny_args[i + 2:] + ["--steps", "6"]
    swap = ["--nvme", str(tmp_path / "swap")]
    assert main(["train", *at("plain"), "--offload", "none"]) == 0
    assert main(["train", *at("mixed"), "--stop-at", "2", "--offload", "none"]) == 0
    assert main(["train", *at("mixed"), "--stop-at", "4", "--resume", "--offload", "nvme", *swap]) == 0
    assert main(["train", *at("mixed"), "--resume", "--offload", "host"]) == 0
    ref, got = ckpt.read_all(tmp_path / "plain"), ckpt.read_all(tmp_path / "mixed")
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=0, msg=k)
    names = sorted(p.name for p in ckpt.latest(tmp_path / "mixed").iterdir())
    assert names == sorted(p.name for p in ckpt.latest(tmp_path / "plain").iterdir())
    assert "blocks.0.safetensors" in names and "root.safetensors" in names and "index.json" in names


def test_nvme_units_are_checkpointed_as_a_copy_of_their_swap_files(tiny_args, tmp_path, monkeypatch):
    """With every state on NVMe no unit passes through the engine on its way to the checkpoint (its swap file's
    byte ranges are copied in the kernel); the tensors read back equal a plain run's."""
    import json

    from safetensors import safe_open

    from tightfit.offload.step.engine import OffloadEngine

    i = tiny_args.index("--out-dir")

    def at(name):
        return tiny_args[: i + 1] + [str(tmp_path / name)] + tiny_args[i + 2:] + ["--steps", "4"]

    assert main(["train", *at("plain"), "--offload", "none"]) == 0

    def no_read(self, unit):
        raise AssertionError("the checkpoint read a unit through the engine")

    monkeypatch.setattr(OffloadEngine, "read_master", no_read)
    assert main(["train", *at("nvme"), "--offload", "nvme", "--nvme", str(tmp_path / "swap")]) == 0
    folder = ckpt.latest(tmp_path / "nvme")
    index = json.loads((folder / cw.INDEX).read_text())
    assert index["tensors"]["model.blocks.0.mlp.up.weight"]["entry"] == "master"
    assert index["tensors"]["optim.blocks.0.mlp.up.weight.exp_avg"]["entry"] == "exp_avg"
    with safe_open(folder / "blocks.0.safetensors", framework="pt") as f:  # any safetensors reader opens a shard
        assert {"master", "exp_avg", "exp_avg_sq"} <= set(f.keys())
    ref, got = ckpt.read_all(tmp_path / "plain"), ckpt.read_all(tmp_path / "nvme")
    assert ref.keys() == got.keys()
    for k in ref:
        if not k.startswith("rng."):  # planning an offloaded run draws random numbers (a trial model)
            torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=0, msg=k)


def test_an_index_whose_view_reads_another_views_bytes_is_refused(tiny_args, tmp_path, capsys):
    """A crafted index: k_proj's view moved onto q_proj's bytes, q_proj's checksum copied. Before the check it
    resumed and trained on q_proj's weights as k_proj's."""
    import json

    i = tiny_args.index("--out-dir")
    run = tiny_args[: i + 1] + [str(tmp_path / "nvme")] + tiny_args[i + 2:]
    assert main(["train", *run, "--steps", "2", "--offload", "nvme", "--nvme", str(tmp_path / "swap")]) == 0
    folder = ckpt.latest(tmp_path / "nvme")
    index = json.loads((folder / cw.INDEX).read_text())
    q, k = (index["tensors"][f"model.blocks.0.attn.{n}.weight"] for n in ("q_proj", "k_proj"))
    assert q["entry"] == k["entry"] == "master"
    k["offset"], k["crc32"] = q["offset"], q["crc32"]
    (folder / cw.INDEX).write_text(json.dumps(index))
    capsys.readouterr()
    assert main(["train", *run, "--steps", "3", "--resume", "--offload", "nvme", "--nvme", str(tmp_path / "swap")]) == 2
    err = capsys.readouterr().err.strip()
    assert "sharing bytes" in err and "blocks.0.attn.k_proj.weight" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("kernel", [True, False])
def test_range_copy_both_ways(tmp_path, kernel):
    """A swap file's byte ranges copy exactly, by copy_file_range (filesystems that share blocks) or by blocks."""
    from tightfit.train.checkpoint_swap import _copy_range, filesystem_type

    src = tmp_path / "src.bin"
    data = os.urandom(3 * (1 << 20) + 123)
    src.write_bytes(data)
    fd = os.open(tmp_path / "dst.bin", os.O_WRONLY | os.O_CREAT)
    try:
        _copy_range(src, 4096, fd, 100, len(data) - 4096, kernel)
    finally:
        os.close(fd)
    assert (tmp_path / "dst.bin").read_bytes()[100:] == data[4096:]
    assert filesystem_type(tmp_path) != ""


def test_a_copied_shard_is_read_back_in_bounded_pieces(tmp_path, monkeypatch):
    """The writer checks a copied NVMe shard a piece at a time (issue 26, item 4: it read each tensor whole, so a
    3B model's 1.6 GB embedding was a 1.6 GB transient at the end of the run): the CRC continued over pieces is the
    whole tensor's, and a NaN in the last piece is still found."""
    import zlib

    from tightfit.utils.safetensors_io import tensor_bytes

    monkeypatch.setattr(cw, "VERIFY_CHUNK", 64)
    t = torch.randn(1000)
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 100 + bytes(tensor_bytes(t)))
    seen = []
    real_empty = torch.empty
    monkeypatch.setattr(cw.torch, "empty", lambda *a, **k: seen.append(a) or real_empty(*a, **k))
    with open(path, "rb") as f:
        assert cw._read_back(f, 100, 1000, torch.float32) == (zlib.crc32(tensor_bytes(t)), None)
    assert seen == [(16,)], seen  # one 64-byte buffer, reused
    t[-1] = float("nan")
    path.write_bytes(b"x" * 100 + bytes(tensor_bytes(t)))
    with open(path, "rb") as f:
        assert cw._read_back(f, 100, 1000, torch.float32)[1] == "nan"


def test_a_partial_folder_name_in_the_way_is_left_alone(tmp_path):
    """A `.partial-step-N-<pid>` folder without tightfit's marker (a copy that landed while a stopped save removed
    its folder, once; or anyone's) is neither reused nor removed: the save takes another name and commits (the
    fresh-check of 2026-11-26 failed with FileExistsError here)."""
    import os

    root = tmp_path / "c"
    root.mkdir()
    foreign = root / f".partial-step-00000001-{os.getpid()}"
    foreign.mkdir()
    (foreign / "blocks.0.safetensors").write_bytes(b"left")
    path = ckpt.save_checkpoint(root, [("model.w", torch.ones(4))], step=1, config={}, signature="", rng=RNG)
    assert path == root / "step-00000001" and (foreign / "blocks.0.safetensors").read_bytes() == b"left"
    assert cw.clean_leftovers(root) == []  # not tightfit's: kept


def test_checkpoints_that_cannot_fit_beside_the_swap_are_refused_before_it_is_filled(tiny_args, tmp_path, capsys,
                                                                                      monkeypatch):
    """The swap files of an all-NVMe run take the disk first: a run whose checkpoints would not fit beside them is
    refused on its plan, before the engine allocates and fills them (the 3.4B Llama was refused 50 s in, after
    writing 47.5 GiB of swap)."""
    import tightfit.train.memory as memory

    swap = tmp_path / "swap"
    monkeypatch.setattr(memory.OffloadMemory, "__init__", lambda *a, **k: pytest.fail("the engine was built"))
    real = cw.free_bytes
    monkeypatch.setattr(cw, "free_bytes", lambda path: min(real(path), 3 << 19))  # 1.5 MiB: the swap is 0.7 MiB
    assert main(["train", *tiny_args, "--steps", "3", "--offload", "nvme", "--nvme", str(swap),
                 "--save-interval", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "of --nvme swap files this plan keeps share this disk" in err, err


def test_the_saved_rng_state_is_the_runs_whatever_the_placement(tiny_args, tmp_path):
    """Planning (the process floor's measurement) drew from torch's global RNG in an offloaded
    run only, so its checkpoints' RNG state differed from a plain run's with identical weights (issue 45)."""
    from safetensors.torch import load_file

    states = []
    for offload in ("none", "host"):
        out = tmp_path / offload
        args = [a if a != tiny_args[tiny_args.index("--out-dir") + 1] else str(out) for a in tiny_args]
        assert main(["train", *args, "--steps", "2", "--offload", offload]) == 0
        states.append(load_file(out / "checkpoints" / "step-00000002" / "rng.safetensors"))
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
