"""`tightfit probe`: measure this machine's speeds once (~10 s; up to ~1 min with `--nvme`) and cache them.

Why these measurements: each is the rate of one term of the step-time model (`costs.py`), measured the way the
engine spends it:
- matmul FLOP/s by the smallest side of the matmul, 32..1024 (a linear layer's training matmuls with that many
  tokens), in the compute dtype ([Note: matmul rate by the smallest side] in work.py);
- memory bandwidth (a large tensor copy), for norms, adds and other memory-bound ops;
- fused attention's FLOP/s by problem size ([Note: attention's own rate] in work.py), and the bytes per second of
  each elementwise op that may run below memory bandwidth, timed alone ([Note: ops slower than their bytes]);
- per-op overhead: a chain of tiny ops with autograd, forward + backward, divided by the aten ops it dispatches
  (counted by the same tracer the model profile uses, so the two agree on what "an op" is);
- the engine's own host time per unit and per step: the engine stepping tiny models of 2 and 6 blocks;
- fused AdamW on CPU (and on the GPU), in parameters per second;
- host<->device copies (pinned, CUDA; a memcpy between tier buffers on a CPU-only machine), and on CUDA both ways
  at once;
- the swap folder's sequential O_DIRECT read/write bandwidth, sustained (a file of up to 16 GiB written twice),
  and how the NVMe tier should drive that disk (I/O threads, largest transfer: `disk_probe.py`);
- the RSS of a fresh process that imported torch and ran a tiny step: the runtime floor under host memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from tightfit.planner.disk_probe import DiskProfile, probe_disk
from tightfit.planner.hardware import PROBE_VERSION, HardwareProfile, current, load_cached, machine_key, save_cached

_MATMUL_SIZES = (32, 64, 128, 256, 512, 1024)
"""Smallest sides probed; a matmul with a larger one runs at the rate of the last (it is no longer thin)."""
_MATMUL_IN, _MATMUL_OUT = 2048, 5632
"""The probed linear layer: a 1-3 B model's MLP projection, 46 MB in fp32, more than a CPU's caches hold and than
glibc's heap keeps, so its weight streams from memory and its fresh weight gradient is new pages, as in training."""


def _operand(*shape: int, device: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random operand drawn from the probe's own generator. A plan probes when it finds no cached profile, after
    the run has seeded torch and before it trains: a draw from the global generator would give a run that probed
    other dropout masks, and another saved RNG state, than the same run with the profile cached."""
    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randn(*shape, generator=generator, device=device, dtype=dtype)


def _timeit(fn, min_s: float = 0.15, max_reps: int = 200) -> float:
    """Median seconds per call over at least `min_s` (after one warm-up call).

    The median, not the minimum: the planner predicts what a step will take on this machine as it is, and a
    shared machine's typical slowdown is part of that; single stalls are not.
    """
    fn()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    times: list[float] = []
    t_start = time.perf_counter()
    while len(times) < max_reps and (time.perf_counter() - t_start < min_s or len(times) < 3):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_matmul(device: str, dtype: torch.dtype) -> dict[int, float]:
    """FLOP/s of a linear layer's three training matmuls with s tokens, by that smallest side s ([Note: matmul rate
    by the smallest side] in work.py): forward (s x i) @ (i x o), input gradient (s x o) @ (o x i), weight
    gradient (o x s) @ (s x i) into a new tensor, as autograd computes them; each timed call does >= ~2 GFLOP (the
    rate excludes the per-op dispatch cost, measured separately, and a busy machine's jitter does not decide it)."""
    out = {}
    i, o = _MATMUL_IN, _MATMUL_OUT
    weight = _operand(o, i, device=device, dtype=dtype)
    for s in _MATMUL_SIZES:
        reps = max(1, round(2e9 / (3 * 2.0 * s * i * o)))
        x = _operand(s, i, device=device, dtype=dtype)
        grad = _operand(s, o, device=device, dtype=dtype)

        def training_matmuls() -> None:
            for _ in range(reps):
                x @ weight.t()
                grad @ weight
                grad.t() @ x

        out[s] = 3 * 2.0 * reps * s * i * o / _timeit(training_matmuls)
    return out


def _psi_some_us() -> int | None:
    """Microseconds some runnable task has waited for a core since boot (Linux PSI); None where the kernel does not
    say (no /proc/pressure: an older kernel, another OS, a container without it)."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some "):
                    return int(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def measure_matmul_and_pressure(device: str, dtype: torch.dtype) -> tuple[dict[int, float], float]:
    """`measure_matmul`, and the share of its wall time in which a runnable task waited for a core (-1: not known):
    what says whether the machine was busy with other work while its speeds were measured."""
    t0, w0 = time.perf_counter(), _psi_some_us()
    rates = measure_matmul(device, dtype)
    t1, w1 = time.perf_counter(), _psi_some_us()
    if w0 is None or w1 is None or t1 <= t0:
        return rates, -1.0
    return rates, min(1.0, max(0.0, (w1 - w0) / 1e6 / (t1 - t0)))


_ATTENTION_SHAPES = ((128, 32, 64), (512, 64, 4), (2048, 128, 1))
"""(tokens, head dim, batch x heads) of the attention the probe times on a CPU: a small model's short sequences, a
mid-sized model's, a 1-8 B model's at 2048 tokens; each call ~0.2-4 GFLOP."""

_GPU_HEADS = 32
"""On a GPU, batch x heads times this: a fused kernel runs a tile of queries per block, and one head of 2048 tokens
kept 16 of an H200's 132 SMs busy (17 TFLOP/s measured, the Llama plan's compute priced 3x plain PyTorch's whole
step: benchmarks/RESULTS.md, "GPU check"). The kernel's launch is the host's op overhead, priced apart, so the rate
is that of a kernel with the GPU to itself, as a model's batch x heads (64 for the 1.1 B Llama) gives it."""


def measure_attention(device: str, dtype: torch.dtype) -> dict[int, float]:
    """FLOP/s of causal fused attention, forward and backward, by problem size (the key the trace gives the
    attention it sees, [Note: attention's own rate] in work.py): the kernel `F.scaled_dot_product_attention`
    picks on this device, FLOPs counted as the trace counts them (the tiles a causal mask keeps)."""
    from tightfit.planner.work import attention_flops, attention_key

    out = {}
    for t, d, bh in _ATTENTION_SHAPES:
        bh *= _GPU_HEADS if device == "cuda" else 1
        q, k, v = (_operand(1, bh, t, d, device=device, dtype=dtype).requires_grad_() for _ in range(3))
        grad = _operand(1, bh, t, d, device=device, dtype=dtype)

        def attention() -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
            q.grad = k.grad = v.grad = None

        flops = attention_flops(bh, t, t, d, causal=True, backward=False) + \
            attention_flops(bh, t, t, d, causal=True, backward=True)
        out[attention_key(t, d, t)] = flops / _timeit(attention, min_s=0.1)
    return out


def measure_timed_ops(device: str, dtype: torch.dtype) -> dict[str, float]:
    """Bytes per second of each op of `work.TIMED_OPS` alone, on this device in the compute dtype, its bytes counted
    as the trace counts them (`work.op_bytes`): 4 M elements on a CPU (an activation of a few thousand tokens),
    64 M on a GPU (where a smaller tensor would time the launch). An op this torch cannot run here is left out (it
    is then priced at memory bandwidth)."""
    from tightfit.planner.work import TIMED_OPS, op_bytes

    aten = torch.ops.aten
    n = (64 << 20) if device == "cuda" else (4 << 20)
    x, g = (_operand(n // 1024, 1024, device=device, dtype=dtype) for _ in range(2))
    y, mask = torch.softmax(x, -1), torch.ones_like(x, dtype=torch.bool)
    calls = {"bernoulli_": (aten.bernoulli_.float, (torch.empty_like(x), 0.9)),
             "native_dropout": (aten.native_dropout, (x, 0.1, True)),
             "native_dropout_backward": (aten.native_dropout_backward, (g, mask, 1 / 0.9)),
             "tanh": (aten.tanh, (x,)), "tanh_backward": (aten.tanh_backward, (g, y)), "exp": (aten.exp, (x,)),
             "sigmoid": (aten.sigmoid, (x,)), "sigmoid_backward": (aten.sigmoid_backward, (g, y)),
             "gelu": (aten.gelu, (x,)), "gelu_backward": (aten.gelu_backward, (g, x)),
             "silu": (aten.silu, (x,)), "silu_backward": (aten.silu_backward, (g, x)),
             "_softmax": (aten._softmax, (x, -1, False)),
             "_softmax_backward_data": (aten._softmax_backward_data, (g, y, -1, dtype)),
             "_log_softmax": (aten._log_softmax, (x, -1, False)),
             "_log_softmax_backward_data": (aten._log_softmax_backward_data, (g, y, -1, dtype))}
    out = {}
    # Dropout draws from the global generators: the run's stay as its seed left them ([Note] in _operand).
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device == "cuda" else []):
        for name in TIMED_OPS:
            op, args = calls[name]
            try:
                result = op(*args)
            except (RuntimeError, NotImplementedError):
                continue
            results = [r for r in (result if isinstance(result, tuple) else (result,)) if isinstance(r, torch.Tensor)]
            nbytes = op_bytes([a for a in args if isinstance(a, torch.Tensor)], results)
            out[name] = nbytes / _timeit(lambda op=op, args=args: op(*args), min_s=0.05)
    return out


def measure_mem_bw(device: str, nbytes: int = 256 << 20) -> float:
    """Bytes read + written per second by a large copy."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _timeit(lambda: dst.copy_(src))


def measure_op_overhead(device: str, dtype: torch.dtype = torch.float32) -> float:
    """Seconds per dispatched aten op on tiny tensors, autograd included; under autocast to `dtype` where that is
    not fp32, as a mixed-precision step dispatches each of its ops ([Note: the host floor's precision])."""
    from tightfit.planner.model_profile import _Tracer

    def chain(x):
        for _ in range(100):
            x = x * 1.0001 + 0.001
        return x.sum()

    def step(dev):
        x = torch.ones(8, device=dev, requires_grad=True)
        with _autocast(dev, dtype):
            y = chain(x)
        y.backward()

    tracer = _Tracer()
    with tracer:
        step("meta")
    n_ops = sum(w.n_ops for w in tracer.work.values())
    return _timeit(lambda: step(device)) / max(1, n_ops)


def _autocast(device: str, dtype: torch.dtype):
    """`torch.autocast` to `dtype` on `device`'s type, or nothing for fp32 (and on meta, where it has no effect)."""
    if dtype == torch.float32 or device == "meta":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


ENGINE_PROBE_BLOCKS = (2, 6)
"""Blocks of the two tiny models `measure_engine_overhead` times: their difference is four units' cost."""


def measure_engine_overhead(device: str, steps: int = 40, tier: str = "device",
                            dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(seconds per unit and micro-batch, seconds per step) of host time the offload engine and a training step
    spend beyond the model's own ops ([Note: the host floor] in costs.py).

    How: the engine itself, every state on `tier` (the device; or the host, where every unit streams and the CPU
    steps it), steps a tiny GPT (width 16, 8 tokens: its kernels cost nothing, so a step is host time) as
    `tightfit train` does: forward (under autocast to `dtype`, computing in `dtype`, where that is not fp32),
    backward, clip, step, zero_grad, the loss read back. With 2 and with 6 blocks, the step time less the model's
    ops at `op_overhead_s` (counted as the plan counts them: `profile_model` at `dtype` on this device) gives a line
    whose slope is the per-unit cost and whose rest, less the 2 blocks' and the root's, is the per-step cost.

    [Note: the host floor's precision] A GPU run computes in bf16 under autocast, where each linear is a cast and a
    bf16 matmul and each op passes autocast's dispatch: the default run's step on the H200 was 38% over a plan whose
    per-op and per-unit figures were timed in fp32 without autocast (19.1 ms against 11.9; batch AF). The probe
    times its host figures at the precision the device's runs use (bf16 on CUDA)."""
    import tightfit
    from tightfit.models.gpt import GPT, GPTConfig
    from tightfit.offload.step.engine import engine_of
    from tightfit.optim import AdamW
    from tightfit.planner.model_profile import DTYPE_NAMES, profile_model

    def model(n_layer: int, on: str) -> torch.nn.Module:
        with torch.random.fork_rng(devices=[]):  # the run's generator stays untouched ([Note] in _operand)
            torch.manual_seed(0)
            with torch.device(on):
                return GPT(GPTConfig(n_layer=n_layer, n_embd=16, n_head=2, block_size=8, vocab_size=64))

    def traced_ops(n_layer: int) -> int:
        prof = profile_model(model(n_layer, "meta"), 1, 8, DTYPE_NAMES[dtype], cuda=torch.device(device).type == "cuda")
        return sum(u.fwd.n_ops + u.bwd.n_ops for u in prof.units)

    def step_s(n_layer: int) -> float:
        m = tightfit.wrap(model(n_layer, "cpu"), tightfit.Placement.everywhere(tier), device=device,
                          compute_dtype=dtype)
        opt = AdamW(m.parameters(), lr=1e-3)
        x = torch.zeros(1, 8, dtype=torch.long, device=device)

        def step() -> None:
            opt.preload_during_backward()
            with _autocast(device, dtype):
                loss = m(x, x)
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            loss.item()

        try:
            for _ in range(3):
                step()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            return sorted(times)[len(times) // 2]
        finally:
            engine_of(m).close()

    op = measure_op_overhead(device, dtype)
    (n1, n2), t, ops = ENGINE_PROBE_BLOCKS, {}, {}
    for n in (n1, n2):
        t[n], ops[n] = step_s(n), traced_ops(n)
    unit = max(0.0, ((t[n2] - t[n1]) - (ops[n2] - ops[n1]) * op) / (n2 - n1))
    per_step = max(0.0, t[n1] - ops[n1] * op - (n1 + 1) * unit)  # n1 blocks and the root unit
    return unit, per_step


def measure_device_workspace() -> int:
    """Bytes a first bf16 linear layer's forward and backward leave allocated on the GPU beyond its tensors: the
    math libraries' workspaces (cuBLAS's, one per thread's handle and stream: the forward's and autograd's device
    thread's), which torch's caching allocator holds for the process.

    The workspaces the probe's earlier matmuls made are dropped first: they are made once per process, so measured
    after them the figure was 0 (the second H200 run's probe), and the default run's CUDA peak was 73 MiB over a
    plan that counted none."""
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    before = torch.cuda.memory_allocated()
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.linear(x, w).sum().backward()
    torch.cuda.synchronize()
    held = sum(t.numel() * t.element_size() for t in (x, w, x.grad, w.grad))
    return max(0, torch.cuda.memory_allocated() - before - held)


ADAM_NUMEL = 64 << 20
"""Parameters the probe's AdamW steps: 1 GiB of fp32 master, gradients and moments, past any host's caches, as a
unit's states are when the engine steps it (each step reads them from memory once). Over 4 M parameters (64 MiB)
the second H200 run's host stepped 9.67 G parameters/s, out of its caches, and 3.35-3.92 over 64 M; the plan had
priced the 1.2 B GPT's CPU optimizer at the first (benchmarks/RESULTS.md, "GPU check")."""


def measure_adam(device: str, numel: int = ADAM_NUMEL, threads: int | None = None) -> float:
    """Parameters per second of torch's fused AdamW (fp32 params, grads and moments), on `threads` intra-op threads
    (None: this thread's count)."""
    p = torch.nn.Parameter(_operand(numel, device=device))
    p.grad = _operand(numel, device=device)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return numel / _timeit(opt.step, min_s=0.2)
    finally:
        torch.set_num_threads(before)


def measure_cpu_adam(cuda: bool) -> float:
    """CPU AdamW's rate on the threads the engine's step thread runs it on ([Note: thread budget] in
    offload/runtime/workers.py: on a GPU machine the cores but the gradient worker's and one)."""
    from tightfit.offload.runtime.workers import thread_budget

    return measure_adam("cpu", threads=thread_budget(torch.get_num_threads(), cuda)["step"])


def measure_host_passes(numel: int | None = None) -> float:
    """Bytes per second (read + written) of the elementwise passes the engine makes over host memory besides AdamW
    on a GPU machine ([Note: host passes] in costs.py), run as it runs them: a bf16 gradient pack added into its
    fp32 sum, the sum's norm, the clip coefficient's multiply, the new master cast to bf16. Host tensors, on every
    machine (a plan uses the figure only where the device is a GPU). `numel` (default `host_pass_numel()`): more
    than the host's caches hold, as the units of a model offloaded from a GPU are."""
    from tightfit.offload.runtime.widening import add_widening

    numel = numel or host_pass_numel()

    pack = _operand(numel, device="cpu").to(torch.bfloat16)
    acc, cast = _operand(numel, device="cpu"), torch.empty(numel, dtype=torch.bfloat16)
    half = torch.tensor(0.5)

    def passes() -> None:
        add_widening(acc, pack)
        torch._foreach_norm([acc], 2.0)
        torch._foreach_mul_([acc], half)  # (acc + pack) / 2 stays bounded over the repetitions
        cast.copy_(acc)

    moved = numel * ((2 + 4 + 4) + 4 + (4 + 4) + (4 + 2))
    return moved / _timeit(passes, min_s=0.2)


HOST_PASS_BYTES = 256 << 20
"""The least the host-pass measurement's tensors take (pack, sum and cast: 8 bytes an element)."""


def host_pass_numel(llc_bytes: int | None = None) -> int:
    """Elements of the host-pass measurement: its tensors take 4x the host's last-level caches (all sockets'),
    at least `HOST_PASS_BYTES`, at most 2 GiB.

    [Note: passes beyond the cache] Sized at a fixed 256 MiB, the measurement ran partly in the caches of the GPU
    hosts, whose last-level caches are hundreds of MiB: the H200 hosts measured 37.8 to 84.9 GB/s while the
    gradient worker added a 1.1 B Llama's 4.4 GB of fp32 sums at about 30 GB/s (benchmarks/RESULTS.md, batch AF:
    its step 2.9 s against 1.2 predicted). Where the caches cannot be read, the least size."""
    llc = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    return min(max(HOST_PASS_BYTES, 4 * llc), 2 << 30) // 8


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu") -> int:
    """Bytes of the host's last-level caches, each shared cache counted once (Linux's sysfs; 0 where unreadable)."""
    seen: dict[str, int] = {}
    for index in Path(root).glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        seen[f"{level}:{shared}"] = nbytes if level >= 3 else 0
    top = max((int(k.split(":")[0]) for k, v in seen.items() if v), default=0)
    return sum(v for k, v in seen.items() if int(k.split(":")[0]) == top)


def measure_copies(nbytes: int = 256 << 20) -> tuple[float, float]:
    """(host->device, device->host) bytes/s: pinned copies on CUDA; on CPU, a memcpy as the engine does each, on one
    core: a fetch copies into a flat buffer it has just re-allocated (fresh memory, advised huge pages:
    step/unit.py, [Note: first touch]), a gradient pack into a pool buffer that stays allocated (touched memory)."""
    if torch.cuda.is_available():
        host = torch.empty(nbytes // 4, pin_memory=True)
        dev = torch.empty(nbytes // 4, device="cuda")
        h2d = nbytes / _timeit(lambda: dev.copy_(host, non_blocking=True))
        d2h = nbytes / _timeit(lambda: host.copy_(dev, non_blocking=True))
        return h2d, d2h
    from tightfit.utils import huge_pages

    a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

    def into_fresh() -> None:
        fresh = torch.empty(nbytes // 4)
        huge_pages.advise(fresh)
        fresh.copy_(a)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine's copy threads run them ([Note: one core per copy] in movers.py)
    try:
        return nbytes / _timeit(into_fresh), nbytes / _timeit(lambda: b.copy_(a))
    finally:
        torch.set_num_threads(threads)


def measure_duplex(nbytes: int = 256 << 20) -> float:
    """Bytes per second host->device and device->host together, one pinned copy each way in flight at once on two
    streams, as an offloaded step has them; 0 without CUDA (a CPU-only machine's copies share its cores and the
    model adds them)."""
    if not torch.cuda.is_available():
        return 0.0
    host_up, host_down = torch.empty(nbytes // 4, pin_memory=True), torch.empty(nbytes // 4, pin_memory=True)
    dev_up, dev_down = torch.empty(nbytes // 4, device="cuda"), torch.ones(nbytes // 4, device="cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(up):
            dev_up.copy_(host_up, non_blocking=True)
        with torch.cuda.stream(down):
            host_down.copy_(dev_down, non_blocking=True)

    return 2 * nbytes / _timeit(both)


_RUNTIME_RSS_CODE = ("import psutil, torch, tightfit, tightfit.planner\n"
                     "from tightfit.models.gpt import GPT, GPTConfig\n"
                     "from tightfit.optim import AdamW\n"
                     "m = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))\n"
                     "tightfit.wrap(m, tightfit.Placement.everywhere('host'), device='cpu')\n"
                     "opt = AdamW(m.parameters())\n"
                     "x = torch.zeros(2, 16, dtype=torch.long)\n"
                     "m(x, x).backward(); opt.step()\n"
                     "print(psutil.Process().memory_info().rss)\n")
"""What every training process pays before its model: torch, tightfit (planner and engine imported), the engine's
threads and one tiny wrapped step with the CPU optimizer."""


def start_runtime_rss() -> subprocess.Popen | None:
    """Start `measure_runtime_rss`'s child now, to be waited for later (None where it cannot start).

    [Note: the probe's overlap] The child is a fresh Python importing torch on one core: on the H200 lent, 12.4 of
    the first run's 32 s probe. A GPU probe starts it first and measures what keeps the host's cores idle meanwhile
    (the GPU's kernels, the copies, the disk: ~10 s there), and waits for it before the first measurement the
    host's cores make (AdamW on the CPU). A CPU-only probe runs it last, as before: there every measurement needs
    the cores."""
    try:
        return subprocess.Popen([sys.executable, "-c", _RUNTIME_RSS_CODE], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=_child_env())
    except OSError:
        return None


def measure_runtime_rss(started: subprocess.Popen | None = None) -> int:
    """RSS of a fresh Python that imported torch and tightfit and ran a tiny training step; `started`: that child,
    already running (`start_runtime_rss`), else it runs now. This process's RSS where the child fails."""
    if started is None:
        line = _last_line_of_child(_RUNTIME_RSS_CODE, timeout=120)
    else:
        try:
            out, _ = started.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            started.kill()
            out, _ = started.communicate()
        lines = (out or "").strip().splitlines()
        line = lines[-1] if started.returncode == 0 and lines else None
    if line is not None and line.isdigit():
        return int(line)
    import psutil

    return psutil.Process().memory_info().rss


SUSTAINED_BYTES = 16 << 30
"""Most bytes the sustained disk measurement writes ([Note: sustained bandwidth] in disk_probe.py); at most a quarter
of the swap disk's free space."""


def measure_disk(folder: str | None, nbytes: int = 256 << 20, sustained: bool = True,
                 volume: int | None = None) -> DiskProfile:
    """Bandwidth of sequential O_DIRECT transfers in `folder` (a temporary folder when None), and the NVMe tier's
    I/O threads and largest transfer for its disk. With a swap folder and `sustained`, the bandwidth is the
    sustained one (up to ~50 s more): what a run that streams tens of GiB a step gets, over `volume` bytes (default
    `SUSTAINED_BYTES`, at most a quarter of the free space)."""
    if folder:
        os.makedirs(folder, exist_ok=True)
        room = (volume or min(SUSTAINED_BYTES, shutil.disk_usage(folder).free // 4)) if sustained else 0
        return probe_disk(folder, nbytes, sustained_bytes=room)
    with tempfile.TemporaryDirectory(prefix="tightfit-probe-") as d:
        return probe_disk(d, nbytes)


def run_probe(folder: str | None = None, save: bool = True, sustained: bool = True,
              disk_volume: int | None = None) -> HardwareProfile:
    """Measure this machine (disk speed in `folder`, the swap folder; sustained and disk_volume: see
    `measure_disk`) and cache the result."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    gpu_total = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    rss_child = start_runtime_rss() if cuda else None  # [Note: the probe's overlap]
    attention, timed_ops = _small_kernels(device, dtype)
    h2d, d2h = measure_copies()
    disk = measure_disk(folder, sustained=sustained, volume=disk_volume)
    runtime_rss = measure_runtime_rss(rss_child) if rss_child is not None else None  # the host's cores from here on
    cpu_adam = measure_cpu_adam(cuda)
    matmul, pressure = measure_matmul_and_pressure(device, dtype)
    hw = HardwareProfile(
        key=machine_key(), cuda=cuda, device_name=torch.cuda.get_device_name(0) if cuda else "cpu",
        gpu_total=gpu_total, gpu_free=gpu_total, host_total=0, host_available=0, nvme_free=0,
        nvme_read_bw=disk.read_Bps, nvme_write_bw=disk.write_Bps, nvme_mixed_bw=disk.mixed_Bps,
        nvme_device=disk.device, nvme_measured_bytes=disk.measured_bytes,
        nvme_volumes=_disk_volumes(disk) if folder else {},
        nvme_io_threads=disk.threads, nvme_chunk_bytes=disk.chunk_bytes, h2d_bw=h2d, d2h_bw=d2h,
        duplex_bw=measure_duplex(),
        mem_bw=measure_mem_bw(device),
        cpu_adam_rate=cpu_adam, device_adam_rate=measure_adam("cuda") if cuda else cpu_adam,
        host_pass_bw=measure_host_passes(),
        matmul_flops=matmul, cpu_pressure=pressure, op_overhead_s=measure_op_overhead(device, dtype),
        attention_flops=attention, timed_op_bw=timed_ops,
        **_engine_overhead(device, dtype), device_workspace=measure_device_workspace() if cuda else 0,
        runtime_rss=runtime_rss or measure_runtime_rss(), threads=torch.get_num_threads(), measured_at=time.time(),
        probe_version=PROBE_VERSION)
    hw = current(hw, folder)
    if save:
        save_cached(hw)
    return hw


def _small_kernels(device: str, dtype: torch.dtype) -> tuple[dict[int, float], dict[str, float]]:
    """Attention's rates and the timed elementwise ops' ([Note: attention's own rate], [Note: ops slower than their
    bytes] in work.py), measured first: their tensors are a few MiB, and once the copies' 256 MiB buffers had come
    and gone the same attention measured 35-52 GFLOP/s where a fresh process, and the default run's own profile,
    measured 58-66 (the 2-core VM, batch Y)."""
    return measure_attention(device, dtype), measure_timed_ops(device, dtype)


def _engine_overhead(device: str, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """The engine's host figures, or none (0: the plan leaves them out) with a warning where the engine could not
    run on this device: a probe that fails here must not keep a run from planning."""
    try:
        unit, step = measure_engine_overhead(device, dtype=dtype)
        streamed, _ = measure_engine_overhead(device, tier="host", dtype=dtype)
    except Exception as e:  # noqa: BLE001 - any failure of the tiny run: said, and the figures left out
        print(f"tightfit probe: warning: the engine's host time per unit was not measured on {device} "
              f"({type(e).__name__}: {str(e)[:200]}); plans leave it out", file=sys.stderr)
        return {"unit_overhead_s": 0.0, "step_overhead_s": 0.0, "stream_overhead_s": 0.0}
    return {"unit_overhead_s": unit, "step_overhead_s": step, "stream_overhead_s": max(0.0, streamed - unit)}


def _disk_volumes(disk: DiskProfile) -> dict[int, list[float]]:
    """The cached profile's disk rates by volume, where they were measured on the same disk, with `disk`'s added
    (replacing an earlier measurement of its volume)."""
    cached = load_cached()
    volumes = dict(cached.nvme_volumes) if cached and disk.device and cached.nvme_device == disk.device else {}
    volumes[disk.measured_bytes] = [disk.read_Bps, disk.write_Bps, disk.mixed_Bps]
    return volumes


def refresh_speeds(hw: HardwareProfile) -> HardwareProfile:
    """`hw` with the compute-side speeds (matmul, attention, the timed elementwise ops, memory, per-op overhead, the
    engine's host time, AdamW, copies) measured again now, by a fresh Python with this process's thread count.

    For a shared machine whose load changes from minute to minute: ~5 s, the disk and runtime figures are kept.
    Apart for the reason `probe_apart` is: the measurements' buffers, freed, stay in this process's heap (the
    planner benchmark's processes, which take their RSS floor after this, planned 100 MiB more than they held
    once the small kernels were measured first: batch Y). Where the child cannot run, here."""
    return _apart("_refresh_from_json", json.dumps(hw.to_dict())) or _refresh_here(hw)


def _refresh_from_json(hw_json: str) -> HardwareProfile:
    """`refresh_speeds`' child: the profile given as JSON, its speeds measured again here."""
    return _refresh_here(HardwareProfile.from_dict(json.loads(hw_json)))


def _refresh_here(hw: HardwareProfile) -> HardwareProfile:
    """`refresh_speeds`, measured in this process."""
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    attention, timed_ops = _small_kernels(device, dtype)
    h2d, d2h = measure_copies()
    cpu_adam = measure_cpu_adam(cuda)
    matmul, pressure = measure_matmul_and_pressure(device, dtype)
    return replace(hw, matmul_flops=matmul, cpu_pressure=pressure, attention_flops=attention, timed_op_bw=timed_ops,
                   mem_bw=measure_mem_bw(device), op_overhead_s=measure_op_overhead(device, dtype),
                   cpu_adam_rate=cpu_adam, host_pass_bw=measure_host_passes(),
                   **_engine_overhead(device, dtype),
                   device_adam_rate=measure_adam("cuda") if cuda else cpu_adam, h2d_bw=h2d, d2h_bw=d2h,
                   duplex_bw=measure_duplex(),
                   measured_at=time.time())


def load_or_probe(folder: str | None = None, before_probe: Callable[[], None] | None = None) -> HardwareProfile:
    """The cached profile of this machine, measured now if there is none (`before_probe()` first: a caller says
    so); capacities re-read live."""
    hw = load_cached()
    if hw is None:  # quick: the sustained disk figures are `tightfit probe --nvme DIR`'s
        if before_probe is not None:
            before_probe()
        hw = probe_apart(folder)
    return current(hw, folder)


def probe_apart(folder: str | None) -> HardwareProfile:
    """The quick probe (no sustained disk measurement), run and cached by a fresh Python with this process's thread
    count, so the profile's key and matmul rates are this run's.

    Why apart: the probe's buffers (a 256 MiB copy into fresh memory, a 256 MiB bandwidth copy: ~0.8 GiB at once)
    would be the training process's. They raised its RSS high-water mark, the peak a run compares with its plan,
    by more than the run itself held (a first `make train`: 904 MiB measured against 549 predicted), and took room
    that `--cpu-mem` gives the run. Where the child cannot run (no interpreter, tightfit not importable there) the
    probe runs here, as it did before."""
    return _apart("_quick_probe", folder or "") or run_probe(folder, sustained=False)


def _quick_probe(folder: str) -> HardwareProfile:
    """`probe_apart`'s child: the quick probe, cached ("": no swap folder)."""
    return run_probe(folder or None, sustained=False)


def _apart(function: str, arg: str) -> HardwareProfile | None:
    """The profile this module's `function(arg)` returns, called by a fresh Python with this process's thread
    count; None where that failed."""
    code = ("import json, sys, torch\n"
            "torch.set_num_threads(int(sys.argv[3]))\n"
            "from tightfit.planner import probe\n"
            "print(json.dumps(getattr(probe, sys.argv[1])(sys.argv[2]).to_dict()))\n")
    line = _last_line_of_child(code, function, arg, str(torch.get_num_threads()), timeout=600)
    if line is not None:
        with contextlib.suppress(ValueError, TypeError):
            return HardwareProfile.from_dict(json.loads(line))
    return None


def _child_env() -> dict[str, str]:
    """The environment of a child that imports this tightfit (see `_last_line_of_child`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                         *filter(None, [env.get("PYTHONPATH")])])
    return env


def _last_line_of_child(code: str, *args: str, timeout: float) -> str | None:
    """The last line `python -c code args...` printed, or None where it failed. The child imports this tightfit:
    the folder it was imported from goes first on the child's path (a benchmark or a worktree that put its own
    checkout on `sys.path` measures that checkout's code)."""
    try:
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                             env=_child_env())
    except (subprocess.SubprocessError, OSError):
        return None
    lines = res.stdout.strip().splitlines()
    return lines[-1] if res.returncode == 0 and lines else None
