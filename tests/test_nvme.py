"""The NVMe tier store: bytes survive a round trip, files stay valid safetensors, errors are clean.

All files live under pytest's tmp_path (a real disk on the test machines); the tmpfs and O_DIRECT-refusal cases
are forced by monkeypatching os calls, and run for real on /dev/shm where it exists.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from tightfit.errors import UsageError
from tightfit.offload.tiers.nvme import store as nvme
from tightfit.offload.runtime.aligned import aligned_empty, is_aligned
from tightfit.offload.tiers.nvme.store import NvmeStore
from tightfit.offload.tiers.nvme.transfer import transfer_size
from tightfit.offload.tiers.nvme.safetensors_file import is_padding

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
# Odd sizes: empty, one element, not a multiple of 4096 bytes, larger than the test chunk size (3 chunks + tail).
SHAPES = [(0,), (1,), (3, 7), (257, 33), (5, 4099)]


def _rand(shape, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**62), 2**62, shape, generator=gen, dtype=dtype)


def _direct_works(folder: Path) -> bool:
    """Whether this filesystem accepts an aligned O_DIRECT write (what the store's direct path needs)."""
    if not getattr(os, "O_DIRECT", 0):
        return False
    p = folder / "probe"
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        try:
            os.pwrite(fd, memoryview(aligned_empty(4096).numpy()), 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        p.unlink(missing_ok=True)


@pytest.fixture
def store(tmp_path):
    # Small chunks so a few-hundred-KiB tensor is already split into several concurrent requests.
    with NvmeStore(tmp_path / "swap", threads=4, chunk_bytes=16384) as s:
        yield s


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned-buf", "unaligned-buf"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bitwise(store, dtype, aligned):
    gen = torch.Generator().manual_seed(0)
    store.create("u", {f"t{i}": (s, dtype) for i, s in enumerate(SHAPES)})
    srcs = {f"t{i}": _rand(s, dtype, gen) for i, s in enumerate(SHAPES)}

    def buf(like):
        if aligned:
            return aligned_empty(like.numel(), dtype).view(like.shape)
        # An address 64 bytes past an aligned one: never matches the (aligned) file offset modulo 4096.
        raw = aligned_empty(like.numel() * like.element_size() + 64)
        return raw[64:].view(dtype).view(like.shape)

    staged = {n: buf(t).copy_(t) for n, t in srcs.items()}
    futs = [store.write("u", n, t) for n, t in staged.items()]
    assert all(f.result() is None for f in futs)  # a done request holds no reference to its tensor
    outs = {n: buf(t).fill_(0) for n, t in srcs.items()}
    for f in [store.read("u", n, outs[n]) for n in outs]:
        f.result()
    for n, t in srcs.items():
        assert torch.equal(outs[n].view(torch.uint8), t.view(torch.uint8)) if t.numel() else outs[n].numel() == 0
    st = store.stats()
    total = sum(t.numel() * t.element_size() for t in srcs.values())
    assert st["bytes_written"] == st["bytes_read"] == total
    if aligned and _direct_works(store.folder):
        assert st["direct_bytes"] > total  # the aligned bodies of both directions skipped the page cache
    if not aligned:
        assert st["direct_bytes"] == 0


def test_safetensors_reader_sees_latest_values(store):
    store.create("w", {"a": ((300, 5), torch.bfloat16), "b": ((7,), torch.float32), "c": ((2, 2), torch.int64)})
    first = {"a": torch.randn(300, 5).bfloat16(), "b": torch.randn(7), "c": torch.arange(4).view(2, 2)}
    second = {"a": torch.randn(300, 5).bfloat16(), "b": torch.randn(7)}
    for values in (first, second):
        for f in [store.write("w", n, t) for n, t in values.items()]:
            f.result()
    loaded = safetensors.torch.load_file(store.path("w"))
    real = {k: v for k, v in loaded.items() if not is_padding(k)}
    assert set(real) == {"a", "b", "c"} and store.names("w") == ["a", "b", "c"]
    assert real["a"].dtype == torch.bfloat16 and torch.equal(real["a"], second["a"])
    assert torch.equal(real["b"], second["b"]) and torch.equal(real["c"], first["c"])
    with safetensors.safe_open(store.path("w"), framework="pt") as f:
        assert f.metadata()["format"] == "pt"
    # Every tensor starts on a 4096 boundary, so O_DIRECT can reach all of them.
    assert all(store.entry("w", n).offset % 4096 == 0 for n in "abc")


def test_fresh_file_reads_zeros_and_packed_layout_is_valid(store):
    store.create("z", {"x": ((10, 3), torch.float32), "y": ((5,), torch.float16)}, align=False)
    loaded = safetensors.torch.load_file(store.path("z"))
    assert set(loaded) == {"x", "y"}  # packed: no padding entries
    assert not loaded["x"].any() and not loaded["y"].any()
    y = torch.randn(5).half()
    store.write("z", "y", y).result()
    assert torch.equal(safetensors.torch.load_file(store.path("z"))["y"], y)


def test_concurrent_writes_from_many_threads(store):
    n = 24
    store.create("c", {f"p{i}": ((1000 + i,), torch.float32) for i in range(n)})
    values = [torch.randn(1000 + i) for i in range(n)]
    futs = [None] * n

    def submit(i):
        futs[i] = store.write("c", f"p{i}", values[i])

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.flush()
    assert all(f.done() and f.exception() is None for f in futs)
    loaded = safetensors.torch.load_file(store.path("c"))
    for i in range(n):
        assert torch.equal(loaded[f"p{i}"], values[i])
    st = store.stats()  # the directions' shares of the busy time add up to it; each is within its own busy time
    assert st["busy_s"] > 0 and st["read_share_s"] + st["write_share_s"] == pytest.approx(st["busy_s"], rel=1e-9)
    assert st["write_share_s"] <= st["write_busy_s"] + 1e-12 and st["bytes_written"] == sum(4 * (1000 + i)
                                                                                            for i in range(n))


def test_budget_is_enforced(tmp_path):
    with NvmeStore(tmp_path / "swap", budget_bytes=64 * 1024) as s:
        s.create("fits", {"a": ((8000,), torch.float32)})  # ~36 KiB
        with pytest.raises(UsageError, match=r"swap folder .*swap.* budget"):
            s.create("too_big", {"a": ((8000,), torch.float32)})
        assert not s.path("too_big").exists() and not list(s.folder.glob("*.partial"))
        s.delete("fits")  # frees its share of the budget
        s.create("too_big", {"a": ((8000,), torch.float32)})
        # Replacing a file gives its share back first: 52 KiB fits in 64 KiB only if the old 36 KiB is freed.
        s.create("too_big", {"a": ((12000,), torch.float32)})
        assert s.used_bytes() == s.path("too_big").stat().st_size == 4096 + 48000


def test_not_enough_free_space_is_a_usage_error(tmp_path, monkeypatch):
    s = NvmeStore(tmp_path / "swap")
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda p: _Usage(1000))
    with pytest.raises(UsageError, match=r"out of space.* is free"):
        s.create("f", {"a": ((1000,), torch.float32)})
    assert not s.path("f").exists()
    s.close()


class _Usage:
    def __init__(self, free):
        self.total, self.used, self.free = free, 0, free


def test_disk_full_at_create_leaves_no_file(tmp_path, monkeypatch):
    with NvmeStore(tmp_path / "swap") as s:
        def full(fd, off, n):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(nvme.os, "posix_fallocate", full)
        with pytest.raises(UsageError, match=r"swap folder .* out of space"):
            s.create("f", {"a": ((1000,), torch.float32)})
        assert list(s.folder.iterdir()) == []


def test_disk_full_during_write_marks_the_entry_failed_and_close_deletes_the_file(store, monkeypatch):
    store.create("f", {"keep": ((500,), torch.float32), "lost": ((6000,), torch.float32)})
    keep, before = torch.randn(500), torch.randn(6000)
    store.write("f", "keep", keep).result()
    store.write("f", "lost", before).result()

    real_pwrite = os.pwrite
    calls = [0]

    def pwrite_fills_up(fd, buf, off):
        calls[0] += 1
        if calls[0] > 1:  # the first chunk lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, buf, off)

    monkeypatch.setattr(nvme.os, "pwrite", pwrite_fills_up)
    fut = store.write("f", "lost", torch.randn(6000))  # 24000 bytes: two 16 KiB-or-less chunks
    with pytest.raises(UsageError, match=r"swap folder .* out of space.*f.safetensors.*'lost'.* free space"):
        fut.result()
    monkeypatch.undo()
    # [Note: failed writes]: half of 'lost' is new, half old. The header still opens in any reader, so the store
    # refuses to read the entry, keeps the rest of the file readable, and deletes the file on close.
    assert store.failed("f") == ["lost"]
    with pytest.raises(UsageError, match=r"'lost' of .*f.safetensors cannot be read: its last write failed"):
        store.read("f", "lost", torch.empty(6000)).result()
    out = torch.empty(500)
    store.read("f", "keep", out).result()
    assert torch.equal(out, keep)
    again = torch.randn(6000)  # a complete write makes the entry whole again
    store.write("f", "lost", again).result()
    assert store.failed("f") == []
    store.read("f", "lost", back := torch.empty(6000)).result()
    assert torch.equal(back, again)


@pytest.mark.parametrize("keep", [False, True], ids=["swap", "kept"])
def test_close_leaves_no_file_with_a_failed_write(tmp_path, monkeypatch, keep):
    real_pwrite = os.pwrite
    with NvmeStore(tmp_path / "swap", threads=1, chunk_bytes=8192, keep=keep) as s:
        s.create("bad", {"x": ((6000,), torch.float32)})
        s.create("good", {"x": ((10,), torch.float32)})
        s.write("good", "x", torch.ones(10)).result()

        def eio(fd, buf, off):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(nvme.os, "pwrite", eio)
        with pytest.raises(UsageError, match=r"writing tensor 'x' of .*bad.safetensors failed at byte \d+ "
                                             r"\(Input/output error\); check the disk"):
            s.write("bad", "x", torch.randn(6000)).result()
        monkeypatch.setattr(nvme.os, "pwrite", real_pwrite)
    left = sorted(p.name for p in (tmp_path / "swap").iterdir())
    # A kept folder keeps its good files; a file with a failed write never stays under its own name.
    assert left == (["bad.safetensors.corrupt", "good.safetensors"] if keep else [])


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0))


def test_fallback_when_filesystem_refuses_o_direct_at_open(tmp_path, monkeypatch):
    real_open = os.open

    def open_without_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(nvme.os, "open", open_without_direct)
    with NvmeStore(tmp_path / "swap", chunk_bytes=8192) as s:
        s.create("f", {"a": ((10000,), torch.bfloat16)})
        src = aligned_empty(10000, torch.bfloat16).copy_(torch.randn(10000))
        s.write("f", "a", src).result()
        out = aligned_empty(10000, torch.bfloat16)
        s.read("f", "a", out).result()
        assert torch.equal(out, src) and s.stats()["direct_bytes"] == 0


def test_fallback_when_o_direct_transfer_is_refused(tmp_path, monkeypatch):
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    real_pwrite, real_preadv = os.pwrite, os.preadv
    refused = [0]

    def pwrite(fd, buf, off):
        if _is_direct(fd):
            refused[0] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, off)

    def preadv(fd, bufs, off):
        if _is_direct(fd):
            refused[0] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(nvme.os, "pwrite", pwrite)
    monkeypatch.setattr(nvme.os, "preadv", preadv)
    with NvmeStore(tmp_path / "swap", threads=1, chunk_bytes=8192) as s:
        s.create("f", {"a": ((50000,), torch.float32)})
        src = aligned_empty(50000, torch.float32).copy_(torch.randn(50000))
        s.write("f", "a", src).result()
        out = aligned_empty(50000, torch.float32)
        s.read("f", "a", out).result()
        assert torch.equal(out, src)
        st = s.stats()
        # One thread: the first direct chunk is refused, every later chunk and request goes buffered.
        assert refused[0] == 1 and st["direct_fallbacks"] == 1 and st["direct_bytes"] == 0


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_round_trip_on_tmpfs():
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d, NvmeStore(d, chunk_bytes=8192) as s:
        s.create("f", {"a": ((3, 9999), torch.float16)})
        src = aligned_empty(3 * 9999, torch.float16).view(3, 9999).copy_(torch.randn(3, 9999))
        s.write("f", "a", src).result()
        out = torch.empty(3, 9999, dtype=torch.float16)
        s.read("f", "a", out).result()
        assert torch.equal(out, src)


def test_attach_existing_file_from_another_writer(tmp_path):
    # safetensors' own writer packs tensors with no alignment: the store must still read and update in place.
    a, b = torch.randn(33, 3), torch.arange(5, dtype=torch.int64)
    (tmp_path / "swap").mkdir()
    safetensors.torch.save_file({"a": a, "b": b}, tmp_path / "swap" / "ckpt.safetensors")
    with NvmeStore(tmp_path / "swap") as s:
        assert sorted(s.attach("ckpt")) == ["a", "b"]
        out = aligned_empty(99, torch.float32).view(33, 3)
        s.read("ckpt", "a", out).result()
        assert torch.equal(out, a)
        s.write("ckpt", "b", b * 7).result()
    # attached files survive close; the update is visible to the ordinary reader
    assert torch.equal(safetensors.torch.load_file(tmp_path / "swap" / "ckpt.safetensors")["b"], b * 7)


def test_attach_rejects_non_safetensors_file(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x05" * 100)
    with NvmeStore(tmp_path) as s, pytest.raises(UsageError, match="junk.safetensors: not a valid safetensors"):
        s.attach("junk")


def test_close_deletes_created_files_unless_kept(tmp_path):
    with NvmeStore(tmp_path / "a") as s:
        s.create("f", {"x": ((4,), torch.float32)})
        assert s.path("f").exists()
    assert not (tmp_path / "a" / "f.safetensors").exists()
    with NvmeStore(tmp_path / "b", keep=True) as s:
        s.create("f", {"x": ((4,), torch.float32)})
        s.write("f", "x", torch.ones(4)).result()
    assert torch.equal(safetensors.torch.load_file(tmp_path / "b" / "f.safetensors")["x"], torch.ones(4))


def test_bad_requests_are_refused(store):
    store.create("f", {"x": ((4, 4), torch.float32)})
    with pytest.raises(ValueError, match="stored as torch.float32"):
        store.write("f", "x", torch.zeros(4, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="stored as"):
        store.read("f", "x", torch.zeros(5, 4))
    with pytest.raises(ValueError, match="contiguous"):
        store.write("f", "x", torch.zeros(4, 4).t())
    with pytest.raises(KeyError, match="no tensor"):
        store.write("f", "nope", torch.zeros(1))
    with pytest.raises(KeyError, match="create"):
        store.read("g", "x", torch.zeros(4, 4))
    with pytest.raises(ValueError, match="plain name"):
        store.create("../escape", {"x": ((1,), torch.float32)})


def test_unwritable_folder_is_a_usage_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UsageError, match="--nvme: cannot create swap folder"):
        NvmeStore(tmp_path / "file" / "swap")


def test_aligned_empty():
    for dtype in (torch.uint8, torch.bfloat16, torch.float64):
        t = aligned_empty(1001, dtype)
        assert is_aligned(t) and t.dtype == dtype and t.numel() == 1001
    assert aligned_empty(0).numel() == 0


def _vma_flags(addr: int) -> list[str]:
    """VmFlags of the mapping holding `addr`, from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="Linux only: madvise(MADV_HUGEPAGE)")
def test_large_aligned_buffers_are_huge_page_backed():
    # [Note: huge pages for disk buffers]: a buffer of 2 MiB or more starts on a 2 MiB boundary, in a mapping of its
    # own advised for huge pages; views keep the mapping alive after the buffer itself is dropped.
    from tightfit.offload.runtime.aligned import HUGE_PAGE

    buf = aligned_empty(3 * HUGE_PAGE // 4 + 5, torch.float32)
    assert buf.data_ptr() % HUGE_PAGE == 0 and buf.numel() == 3 * HUGE_PAGE // 4 + 5
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        assert "hg" in _vma_flags(buf.data_ptr())  # the whole 2 MiB blocks are advised
    buf.fill_(2.0)
    tail = buf[-7:]
    del buf
    tail.add_(1.0)
    assert torch.equal(tail, torch.full((7,), 3.0))
    small = aligned_empty(1000)
    assert is_aligned(small) and "hg" not in _vma_flags(small.data_ptr())  # small ones: the ordinary allocator


def test_transfer_size_is_as_large_as_the_chunk_allows(tmp_path):
    # [Note: transfer size]: ceil(n / chunk_bytes) equal transfers in whole 4096-byte blocks; a read cut that way
    # still moves every byte.
    with NvmeStore(tmp_path / "swap", threads=8, chunk_bytes=4 << 20) as s:
        cut = {n: transfer_size(n, s.chunk_bytes) for n in (1000, 1 << 20, 7 << 20, 64 << 20, (8 << 20) + 1)}
        assert cut[1000] == 4096  # a buffered head or tail: one transfer
        assert cut[1 << 20] == 1 << 20  # one transfer, not one per thread
        assert cut[7 << 20] == (7 << 20) // 2  # two equal halves, not a 4 MiB piece and a 3 MiB one
        assert cut[64 << 20] == 4 << 20
        assert cut[(8 << 20) + 1] == -(-((8 << 20) + 1) // 3 // 4096) * 4096  # three pieces, block-rounded
        assert all(size % 4096 == 0 for size in cut.values())
        data = torch.randint(0, 256, (7 << 20,), dtype=torch.uint8)
        s.create("t", {"x": ((7 << 20,), torch.uint8)})
        s.write("t", "x", data).result()
        back = aligned_empty(7 << 20)
        s.read("t", "x", back).result()
        assert torch.equal(back, data)


@pytest.mark.parametrize("start,count", [(0, 3000), (0, 1024), (1024, 2048), (1000, 3001), (5999, 1), (0, 6000)])
def test_a_range_of_an_entry_moves_alone(tmp_path, start, count):
    # What the optimizer step of a unit with frozen parameters does: read/write the trainable prefix only.
    with NvmeStore(tmp_path / "swap", threads=4, chunk_bytes=8192) as s:
        s.create("f", {"x": ((6000,), torch.float32)})
        whole = torch.randn(6000)
        s.write("f", "x", whole).result()
        before = s.stats()
        new = aligned_empty(count, torch.float32).copy_(torch.randn(count))
        s.write("f", "x", new, start=start).result()
        got = aligned_empty(count, torch.float32)
        s.read("f", "x", got, start=start).result()
        after = s.stats()
        assert torch.equal(got, new)
        moved = (after["bytes_written"] - before["bytes_written"], after["bytes_read"] - before["bytes_read"])
        assert moved == (4 * count, 4 * count)
        if _direct_works(tmp_path) and start * 4 % 4096 == 0 and count * 4 >= 4096:
            # The file offset and the buffer agree modulo 4096: whole blocks go through O_DIRECT.
            assert after["direct_bytes"] - before["direct_bytes"] == 2 * (count * 4 // 4096 * 4096)
        out = torch.empty(6000)
        s.read("f", "x", out).result()
        whole[start:start + count] = new
        assert torch.equal(out, whole)  # the rest of the entry is untouched


def test_a_range_outside_its_entry_is_refused(store):
    store.create("f", {"x": ((100,), torch.float32)})
    for start, n in ((-1, 10), (95, 10), (0, 101)):
        with pytest.raises(ValueError, match=r"f/x: stored as torch.float32 \[100\], got .* from element"):
            store.read("f", "x", torch.empty(n), start=start)
    with pytest.raises(ValueError, match="stored as torch.float32"):
        store.read("f", "x", torch.empty(10))  # no start: the whole entry, its size checked


def test_a_range_written_after_a_failed_write_leaves_the_entry_failed(store, monkeypatch):
    # [Note: failed writes]: only a write of the whole entry makes it readable again; the rest may still be torn.
    store.create("f", {"x": ((6000,), torch.float32)})

    def full(fd, buf, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nvme.os, "pwrite", full)
    with pytest.raises(UsageError, match="out of space"):
        store.write("f", "x", torch.randn(6000)).result()
    monkeypatch.undo()
    store.write("f", "x", torch.randn(100), start=0).result()
    assert store.failed("f") == ["x"]
    with pytest.raises(UsageError, match="cannot be read: its last write failed"):
        store.read("f", "x", torch.empty(100), start=0).result()
    store.write("f", "x", torch.randn(6000)).result()
    assert store.failed("f") == []
