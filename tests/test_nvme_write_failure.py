"""A disk write that fails during training ([Note: failed writes] in tightfit/offload/tiers/nvme/file.py).

The optimizer's write-backs are not awaited, so a write that fails is found later: it must surface as one clear
line at the next step (naming the unit's file, the entry and what to do), no later read may hand out the entry's
torn bytes, and closing must leave no swap file behind that a reader would take for valid.
"""

from __future__ import annotations

import contextlib
import errno
import os

import pytest
import torch

import tightfit
from offload_helpers import one_torch_thread  # noqa: F401  (autouse fixture: one intra-op thread)
from offload_helpers import batch, loss_of, tiny_gpt
from tightfit import Placement, Tier
from tightfit.errors import UsageError
from tightfit.offload.tiers.nvme import store as nvme
from tightfit.offload.step.engine import engine_of
from tightfit.offload.tiers.nvme.store import DiskTuning
from tightfit.optim import AdamW


def _wrapped(swap):
    torch.manual_seed(0)
    # Small transfers, so an entry is several chunks and a write can fail half-way.
    model = tightfit.wrap(tiny_gpt(), Placement.everywhere(Tier.NVME, nvme_dir=str(swap)),
                          disk=DiskTuning(threads=2, chunk_bytes=8192))
    return model, AdamW(model.parameters(), lr=1e-2), engine_of(model)


def _disk_full_after_the_first_chunk(store, unit: str, entry: str):
    """A pwrite that fails with ENOSPC for every chunk of `unit`'s `entry` but its first: new bytes in front, old
    ones behind (a torn entry)."""
    file = store._files[unit]
    e = file.entries[entry]
    assert e.nbytes > 2 * 8192
    real_pwrite = os.pwrite

    def pwrite(fd, buf, off):
        if fd in (file.fd, file.dfd) and e.offset < off < e.offset + e.nbytes:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, buf, off)

    return pwrite


def _close_as_the_trainer_does(engine) -> None:
    with contextlib.suppress(Exception):  # tightfit.train: the error in flight is the one to report
        engine.close()


@pytest.mark.parametrize("entry", ["exp_avg", "params"])
def test_a_failed_write_back_is_an_error_at_the_next_step_and_its_entry_unreadable(tmp_path, monkeypatch, entry):
    # exp_avg is next read by the next opt.step(); params (the fp32 master too) by the next forward.
    model, opt, engine = _wrapped(tmp_path / "swap")
    store = engine.stores[Tier.NVME].nvme
    loss_of(model, *batch(0)).backward()
    monkeypatch.setattr(nvme.os, "pwrite", _disk_full_after_the_first_chunk(store, "blocks.1", entry))
    with pytest.raises(UsageError) as err:
        opt.step()  # its write-backs run (and fail) in the background: reported here if they failed in time,
        opt.zero_grad()  # else by the next step at the latest
        loss_of(model, *batch(1)).backward()
        opt.step()
    monkeypatch.undo()
    # Whichever comes first, the failed write itself (WriteBacks.check) or the read of its entry, the one line
    # names the unit's file, the entry, the cause and what to do.
    msg = str(err.value)
    assert "\n" not in msg
    assert str(tmp_path / "swap") in msg and "blocks.1.safetensors" in msg and f"tensor {entry!r}" in msg, msg
    assert "out of space" in msg and "free space on that disk" in msg, msg

    assert store.failed("blocks.1") == [entry]
    e = store.entry("blocks.1", entry)
    with pytest.raises(UsageError, match=rf"{entry!r} of .*blocks.1.safetensors cannot be read: its last write"):
        store.read("blocks.1", entry, torch.empty(e.shape, dtype=e.dtype)).result()
    _close_as_the_trainer_does(engine)
    for s in engine.stores.values():  # in case close stopped early (see the test below)
        s.close()


def test_closing_after_a_failed_write_leaves_no_swap_file(tmp_path, monkeypatch):
    swap = tmp_path / "swap"
    model, opt, engine = _wrapped(swap)
    loss_of(model, *batch(0)).backward()
    monkeypatch.setattr(nvme.os, "pwrite", _disk_full_after_the_first_chunk(engine.stores[Tier.NVME].nvme,
                                                                              "blocks.1", "exp_avg"))
    message = "out of space: blocks.1.safetensors could not take tensor 'exp_avg'"
    try:
        opt.step()  # queued for the next forward; here, run now (while the disk still fails)
        engine.wait_steps()  # the write-back is not awaited: the step reports its failure only if it failed in time
        reported = False
    except UsageError as e:
        assert message in str(e)
        reported = True
    engine.stores[Tier.NVME].wait()  # the failing write has run (with the failing disk) before the disk is fixed
    monkeypatch.undo()
    if reported:
        engine.close()
    else:
        with pytest.raises(UsageError, match=message):
            engine.close()  # no step came after the failed write: close reports it
    left = [str(p.relative_to(swap)) for p in swap.rglob("*")] if swap.exists() else []  # the run's folder too
    for s in engine.stores.values():
        s.close()
    assert not left, f"swap files left behind: {left}"
