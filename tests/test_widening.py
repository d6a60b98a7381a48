"""`add_widening`: a narrower float tensor added into a wider one, bit for bit as torch's mixed-dtype `add_`."""

from __future__ import annotations

import pytest
import torch

from tightfit.offload.runtime import widening


@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16, torch.float32])
def test_the_sum_has_the_bits_of_torchs_mixed_add_across_chunk_edges(monkeypatch, narrow):
    """Chunks of 1000 elements over 2,501 (two whole, one partial), and a tensor shaped like a parameter: every
    element as `dst.add_(src)` gives it, including values that round (large + small) and signed zeros."""
    monkeypatch.setattr(widening, "CHUNK", 1000)
    monkeypatch.setattr(widening._local, "scratch", None, raising=False)
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(41, 61, generator=g) * 1e4
    src = (torch.randn(41, 61, generator=g) * 1e-3).to(narrow)
    dst.view(-1)[:3] = torch.tensor([0.0, -0.0, 1.0])
    src.view(-1)[:3] = torch.tensor([-0.0, -0.0, 2.0 ** -30]).to(narrow)
    expected = dst.clone()
    expected.add_(src)
    widening.add_widening(dst, src)
    assert torch.equal(dst.view(torch.int32), expected.view(torch.int32))
    assert dst.view(-1)[1].item() == 0.0 and torch.signbit(dst.view(-1)[1])


def test_a_thread_keeps_its_own_scratch_of_one_chunk(monkeypatch):
    """The scratch is per thread (the gradient worker and the thread running backward add at once) and one chunk
    long, made once: a second add reuses it."""
    import threading

    monkeypatch.setattr(widening, "CHUNK", 64)
    monkeypatch.setattr(widening._local, "scratch", None, raising=False)
    dst, src = torch.zeros(200), torch.ones(200, dtype=torch.bfloat16)
    widening.add_widening(dst, src)
    mine = widening._local.scratch
    widening.add_widening(dst, src)
    assert widening._local.scratch is mine and mine.numel() == 64 and torch.equal(dst, torch.full((200,), 2.0))
    seen = []
    t = threading.Thread(target=lambda: (widening.add_widening(torch.zeros(10), torch.ones(10, dtype=torch.float16)),
                                         seen.append(widening._local.scratch)))
    t.start()
    t.join()
    assert seen[0] is not None and seen[0] is not mine
