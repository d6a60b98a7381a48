"""tightfit owns what it writes (issue 17, item 3): one run per --out-dir and per --nvme folder, swap files in the
run's own subfolder, created exclusively, and nothing it did not create is ever removed or written through."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch

from tightfit.cli import main
from tightfit.errors import UsageError
from tightfit.offload.tiers.nvme.store import NvmeStore
from tightfit.offload.tiers.nvme.file import MANIFEST
from tightfit.offload.tiers.nvme.swap_folder import RUN_PREFIX, SwapFolder
from tightfit.utils.run_lock import LOCK_NAME, RunLock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = "import sys, time; from tightfit.utils.run_lock import RunLock; RunLock.acquire(sys.argv[1], '--out-dir'); " \
       "print('locked', flush=True); time.sleep(120)"


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def holder(tmp_path):
    """Another process holding the lock of a folder; yields (folder, its PID)."""
    folder = tmp_path / "held"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield folder, proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_held_lock_is_refused_naming_the_holder(holder):
    folder, pid = holder
    with pytest.raises(UsageError, match=rf"--out-dir: .* in use by another tightfit run \(PID {pid}\)"):
        RunLock.acquire(folder, "--out-dir")


def test_a_dead_holder_frees_the_lock(holder):
    folder, pid = holder
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    with RunLock.acquire(folder, "--out-dir") as lock:  # the kernel dropped the dead process's lock
        assert (folder / LOCK_NAME).read_text().strip() == str(os.getpid())
    assert not (folder / LOCK_NAME).exists() and lock.folder.is_dir()  # the folder was not created by us: stays


def test_release_removes_what_it_created_and_nothing_else(tmp_path):
    with RunLock.acquire(tmp_path / "new" / "run", "--out-dir"):
        pass
    assert not (tmp_path / "new" / "run").exists()  # created by the lock and left empty: removed
    with RunLock.acquire(tmp_path / "kept", "--out-dir"):
        (tmp_path / "kept" / "metrics.jsonl").write_text("{}\n")
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["metrics.jsonl"]


def test_a_symlink_at_the_lock_name_is_refused_and_left(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).symlink_to(target)
    with pytest.raises(UsageError, match="symlink"):
        RunLock.acquire(tmp_path / "run", "--out-dir")
    assert (tmp_path / "run" / LOCK_NAME).is_symlink() and target.read_text() == "mine"


def test_a_hard_link_at_the_lock_name_is_refused_and_left(tmp_path):
    """The lock truncated and rewrote a user's file hard-linked at its name (issue 45)."""
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (tmp_path / "run").mkdir()
    os.link(target, tmp_path / "run" / LOCK_NAME)
    with pytest.raises(UsageError, match="hard link"):
        RunLock.acquire(tmp_path / "run", "--out-dir")
    assert target.read_text() == "mine" and (tmp_path / "run" / LOCK_NAME).read_text() == "mine"
    RunLock.acquire(tmp_path / "run2", "--out-dir").release()  # a lock of its own still works


def test_second_cli_run_on_a_held_out_dir_is_refused(tiny_args, holder, capsys):
    folder, pid = holder
    args = [a if a != tiny_args[tiny_args.index("--out-dir") + 1] else str(folder) for a in tiny_args]
    assert main(["train", *args, "--steps", "2"]) == 2
    err = _one_line(capsys)
    assert "--out-dir" in err and f"PID {pid}" in err
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]  # nothing written beside the holder's lock


def test_second_cli_run_on_a_held_swap_folder_is_refused(tiny_args, holder, capsys):
    folder, pid = holder
    assert main(["train", *tiny_args, "--steps", "2", "--offload", "nvme", "--nvme", str(folder)]) == 2
    err = _one_line(capsys)
    assert "--nvme" in err and f"PID {pid}" in err
    assert sorted(p.name for p in folder.iterdir()) == [LOCK_NAME]


def test_store_never_replaces_or_follows_what_it_did_not_create(tmp_path):
    user = tmp_path / "u.safetensors"
    user.write_bytes(b"user data")
    target = tmp_path / "target.bin"
    target.write_bytes(b"precious")
    (tmp_path / "v.safetensors.partial").symlink_to(target)
    with NvmeStore(tmp_path) as s:
        with pytest.raises(UsageError, match="was not written by this run"):
            s.create("u", {"x": ((4,), torch.float32)})
        with pytest.raises(UsageError, match="in the way"):
            s.create("v", {"x": ((4,), torch.float32)})
        s.create("w", {"x": ((4,), torch.float32)})
        s.create("w", {"x": ((8,), torch.float32)})  # its own file: replaced
    assert user.read_bytes() == b"user data" and target.read_bytes() == b"precious"
    assert (tmp_path / "v.safetensors.partial").is_symlink() and not (tmp_path / "v.safetensors").exists()
    assert not (tmp_path / "w.safetensors").exists()  # created by the store: removed on close


def test_nvme_run_leaves_user_files_and_symlinks_untouched(tiny_args, tmp_path, capsys):
    swap = tmp_path / "swap"
    swap.mkdir()
    target = tmp_path / "target.bin"
    target.write_bytes(b"precious")
    user = {name: os.urandom(64) for name in ("root.safetensors", "blocks.0.safetensors", "notes.txt")}
    for name, data in user.items():
        (swap / name).write_bytes(data)
    (swap / "blocks.1.safetensors.partial").symlink_to(target)
    assert main(["train", *tiny_args, "--steps", "3", "--offload", "nvme", "--nvme", str(swap)]) == 0
    assert {p.name for p in swap.iterdir()} == {*user, "blocks.1.safetensors.partial"}  # the run left nothing
    for name, data in user.items():
        assert (swap / name).read_bytes() == data
    assert (swap / "blocks.1.safetensors.partial").is_symlink() and target.read_bytes() == b"precious"


def test_leftovers_of_a_dead_run_are_cleaned_and_named(tiny_args, tmp_path, capsys):
    """A dead run's swap files go when its manifest lists them; nothing else does: not a user's file in its folder,
    not a folder named like one without a manifest (issue 27)."""
    swap = tmp_path / "swap"
    dead = swap / f"{RUN_PREFIX}999999-0badf00d"
    dead.mkdir(parents=True)
    (dead / MANIFEST).write_text("root.safetensors\nblocks.0.safetensors\nblocks.1.safetensors\n")
    for name in ("root.safetensors", "blocks.0.safetensors.partial", "blocks.1.safetensors.corrupt"):
        (dead / name).write_bytes(b"\0" * 4096)
    mixed = swap / f"{RUN_PREFIX}999998-0badf00d"  # a dead run's folder where the user put files
    mixed.mkdir()
    (mixed / MANIFEST).write_text("root.safetensors\n../escape.safetensors\n")
    (mixed / "root.safetensors").write_bytes(b"\0" * 10)
    (mixed / "notes.txt").write_text("mine")
    (mixed / "weights.safetensors").write_text("mine too")  # named like a swap file, but not listed
    (swap / "escape.safetensors").write_text("mine")
    unlisted = swap / f"{RUN_PREFIX}123-abcd"  # named like a run's folder, but no manifest: the user's
    unlisted.mkdir()
    (unlisted / "weights.safetensors").write_text("precious")
    assert main(["train", *tiny_args, "--steps", "2", "--offload", "nvme", "--nvme", str(swap)]) == 0
    out = capsys.readouterr().out
    assert f"removed the leftovers of a dead run (PID 999999) from --nvme: {dead} (3 swap files, 12.0 KiB)" in out
    assert "PID 999998" in out and "the folder stays" in out
    assert f"left {unlisted} in place" in out and "no manifest" in out
    assert not dead.exists()
    assert sorted(p.name for p in mixed.iterdir()) == [MANIFEST, "notes.txt", "weights.safetensors"]
    assert (unlisted / "weights.safetensors").read_text() == "precious"
    assert {p.name for p in swap.iterdir()} == {mixed.name, unlisted.name, "escape.safetensors"}


def test_two_engines_of_one_process_share_the_swap_folder(tmp_path):
    a = SwapFolder.claim(tmp_path / "swap")
    b = SwapFolder.claim(tmp_path / "swap")
    assert a.path != b.path and a.path.parent == b.path.parent == tmp_path / "swap"
    a.release()
    assert b.lock.held and (tmp_path / "swap" / LOCK_NAME).exists()
    b.release()
    assert not (tmp_path / "swap").exists()


def test_out_dir_under_a_file_is_one_line(tiny_args, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    args = [a if a != tiny_args[tiny_args.index("--out-dir") + 1] else str(blocker / "run") for a in tiny_args]
    assert main(["train", *args, "--steps", "2"]) == 2
    err = _one_line(capsys)
    assert "--out-dir" in err and "is a file" in err


def test_distributed_launch_refuses_a_held_out_dir_before_starting_workers(tiny_args, holder):
    folder, pid = holder
    args = [a if a != tiny_args[tiny_args.index("--out-dir") + 1] else str(folder) for a in tiny_args]
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "tightfit.cli", "train", *args, "--nproc-per-node", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert f"PID {pid}" in proc.stderr and time.time() - t0 < 60


def test_a_swap_folder_deleted_under_the_run_is_named_as_such(tiny_args, tmp_path, capsys, monkeypatch):
    """Deleting the run's swap subfolder by hand used to read 'cannot write the checkpoint ... free space'; it is
    named for what it is, and the previous checkpoint stays (issue 27)."""
    import shutil

    import tightfit.train.checkpoint_swap as cs
    from tightfit.train.checkpoint_writer import committed

    real = cs.swap_copy

    def deleted_meanwhile(unit, with_optim):
        copy = real(unit, with_optim)
        if copy.ranges[0][1].parent.exists() and committed(tmp_path / "run" / "checkpoints"):
            shutil.rmtree(copy.ranges[0][1].parent)
        return copy

    monkeypatch.setattr(cs, "swap_copy", deleted_meanwhile)
    swap = tmp_path / "swap"
    assert main(["train", *tiny_args, "--steps", "4", "--save-interval", "2", "--offload", "nvme", "--nvme",
                 str(swap)]) == 2
    err = _one_line(capsys)
    assert "--nvme: the swap file " in err and "is gone (was " in err and "free space" not in err, err
    assert [s for s, _ in committed(tmp_path / "run" / "checkpoints")] == [2]
