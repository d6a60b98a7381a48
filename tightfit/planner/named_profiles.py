"""Named what-if machines for `tightfit plan --hardware NAME`: one GPU of a class (24, 40 or 80 GiB on PCIe 4 or 5), or
one GPU of a model people rent (H100 SXM / PCIe, H200, A100 40 / 80 GB, L4, RTX 4090) with the share of a machine
such a GPU usually comes with.

Why named profiles: the common question is about a class of machine nobody has at hand yet. Each profile is
written in the file format `hardware_file.py` reads (so it doubles as an example of it), and every figure that is
not a data-sheet capacity is stated in its `assumptions`, which the plan prints. The speeds are *achieved* rates
(what a well-fed kernel or copy reaches), below the data sheet's peaks; bf16 matmul, since bf16 is the compute
dtype `--precision auto` picks on CUDA, by the matmul's smallest side (usually the tokens of a micro-batch; [Note:
matmul rate by the smallest side] in work.py): assumed, not measured, below 1024. Change any of them by
saving the profile to a file and editing it: `tightfit plan --hardware gpu24-pcie4 --json` prints the profile
inside the plan.
"""

from __future__ import annotations

_PCIE4_NVME = ["NVMe: one PCIe 4.0 SSD, 6.0 GB/s sequential O_DIRECT read, 4.5 GB/s write, 1.5 TiB free"]
_WORKSPACE_8 = ("8 MiB of cuBLAS workspace on the device (PyTorch's default before compute capability 9.0: "
                "4096 KiB x 2 + 16 KiB x 8)")
_WORKSPACE_32 = "32 MiB of cuBLAS workspace on the device (PyTorch's default from compute capability 9.0, Hopper)"
_HOST_ISSUE = ("the host issues each op in 10 us and spends 1 ms per unit and micro-batch (1 ms more for a streamed "
               "unit) and 1 ms per step in the offload engine (the probe measures all four: 3 us, 0.6 ms, 0.2 ms and "
               "~0 on a 2-core CPU VM's CPU path)")
_HOST_PASSES = ("the CPU's passes besides AdamW (gradient sums and norms, the clip multiply, the master's cast to the "
                "compute copy) move host memory at AdamW's rate: 28 bytes per parameter at its params/s (the probe "
                "measures them)")
_KERNELS = ("fused attention at the matmul rate of its size, and dropout, tanh, softmax and the other elementwise "
            "ops at the memory bandwidth (`tightfit probe` on the GPU measures both: [Note: attention's own rate] "
            "and [Note: ops slower than their bytes] in planner/work.py)")
_PCIE5_NVME = ["NVMe: one PCIe 5.0 SSD, 11 GB/s sequential O_DIRECT read, 9 GB/s write, 3 TiB free"]

PROFILES: dict[str, dict] = {
    "gpu24-pcie4": {
        "cuda": True, "device_workspace": "8MiB", "device_name": "24 GiB GPU, PCIe 4.0 x16 (RTX 4090 class)",
        "gpu_total": "24GiB", "host_total": "64GiB", "host_available": "60GiB", "nvme_free": "1.5TiB",
        "nvme_read_bw": "6.0GB/s", "nvme_write_bw": "4.5GB/s", "h2d_bw": "25GB/s", "d2h_bw": "25GB/s",
        "duplex_bw": "40GB/s",
        "mem_bw": "900GB/s", "cpu_adam_rate": 1.5e9, "device_adam_rate": 25e9,
        "matmul_flops": {"128": 60e12, "256": 90e12, "512": 110e12, "1024": 120e12, "2048": 140e12,
                         "4096": 150e12, "8192": 150e12},
        "op_overhead_s": 10e-6, "unit_overhead_s": 1e-3, "stream_overhead_s": 1e-3, "step_overhead_s": 1e-3,
        "runtime_rss": "3GiB", "threads": 16,
        "assumptions": ["GPU: 24 GiB, bf16 matmul reaching 150 TFLOP/s at size 4096 (peak 165), 60 at 128 tokens, "
                        "memory-bound ops at 900 GB/s read + write, AdamW 25 G params/s",
                        "PCIe 4.0 x16: 25 GB/s pinned copies each way (32 GB/s link), 40 GB/s both ways at once",
                        "host: 64 GiB RAM, 60 GiB available, 16 cores running fused AdamW at 1.5 G params/s",
                        *_PCIE4_NVME,
                        "a CUDA training process holds 3 GiB of RSS before its model (CUDA context, libraries)",
                        _WORKSPACE_8, _HOST_ISSUE, _HOST_PASSES, _KERNELS]},
    "gpu40-pcie4": {
        "cuda": True, "device_workspace": "8MiB", "device_name": "40 GiB GPU, PCIe 4.0 x16 (A100 40GB PCIe class)",
        "gpu_total": "40GiB", "host_total": "128GiB", "host_available": "120GiB", "nvme_free": "1.5TiB",
        "nvme_read_bw": "6.0GB/s", "nvme_write_bw": "4.5GB/s", "h2d_bw": "25GB/s", "d2h_bw": "25GB/s",
        "duplex_bw": "40GB/s",
        "mem_bw": "1300GB/s", "cpu_adam_rate": 2.5e9, "device_adam_rate": 40e9,
        "matmul_flops": {"128": 90e12, "256": 130e12, "512": 155e12, "1024": 170e12, "2048": 210e12,
                         "4096": 230e12, "8192": 230e12},
        "op_overhead_s": 10e-6, "unit_overhead_s": 1e-3, "stream_overhead_s": 1e-3, "step_overhead_s": 1e-3,
        "runtime_rss": "3GiB", "threads": 32,
        "assumptions": ["GPU: 40 GiB, bf16 matmul reaching 230 TFLOP/s at size 4096 (peak 312), 90 at 128 tokens, "
                        "memory-bound ops at 1.3 TB/s read + write, AdamW 40 G params/s",
                        "PCIe 4.0 x16: 25 GB/s pinned copies each way (32 GB/s link), 40 GB/s both ways at once",
                        "host: 128 GiB RAM, 120 GiB available, 32 cores running fused AdamW at 2.5 G params/s",
                        *_PCIE4_NVME,
                        "a CUDA training process holds 3 GiB of RSS before its model (CUDA context, libraries)",
                        _WORKSPACE_8, _HOST_ISSUE, _HOST_PASSES, _KERNELS]},
    "gpu80-pcie5": {
        "cuda": True, "device_workspace": "32MiB", "device_name": "80 GiB GPU, PCIe 5.0 x16 (H100 PCIe class)",
        "gpu_total": "80GiB", "host_total": "256GiB", "host_available": "240GiB", "nvme_free": "3TiB",
        "nvme_read_bw": "11GB/s", "nvme_write_bw": "9GB/s", "h2d_bw": "50GB/s", "d2h_bw": "50GB/s",
        "duplex_bw": "80GB/s",
        "mem_bw": "1700GB/s", "cpu_adam_rate": 2.5e9, "device_adam_rate": 55e9,
        "matmul_flops": {"128": 150e12, "256": 220e12, "512": 270e12, "1024": 300e12, "2048": 450e12,
                         "4096": 500e12, "8192": 500e12},
        "op_overhead_s": 10e-6, "unit_overhead_s": 1e-3, "stream_overhead_s": 1e-3, "step_overhead_s": 1e-3,
        "runtime_rss": "3GiB", "threads": 32,
        "assumptions": ["GPU: 80 GiB, bf16 matmul reaching 500 TFLOP/s at size 4096 (peak 756), 150 at 128 tokens, "
                        "memory-bound ops at 1.7 TB/s read + write, AdamW 55 G params/s",
                        "PCIe 5.0 x16: 50 GB/s pinned copies each way (64 GB/s link), 80 GB/s both ways at once",
                        "host: 256 GiB RAM, 240 GiB available, 32 cores running fused AdamW at 2.5 G params/s",
                        *_PCIE5_NVME,
                        "a CUDA training process holds 3 GiB of RSS before its model (CUDA context, libraries)",
                        _WORKSPACE_32, _HOST_ISSUE, _HOST_PASSES, _KERNELS]},
}
"""Name -> profile in the file format (hardware_file.py)."""

# The shape of an achieved bf16 matmul rate against its smallest side, as a share of what it reaches at 4096 and above
# (the classes' tables above): small matmuls do not fill the GPU.
_MATMUL_SHAPE = {"128": 0.36, "256": 0.55, "512": 0.7, "1024": 0.8, "2048": 0.93, "4096": 1.0, "8192": 1.0}


def _rented(name: str, *, gib: int, peak: float, achieved: float, mem_tbs: float, pcie: int, host_gib: int,
            cores: int, hopper: bool, measured: list[str] = (),
            achieved_note: str = "assumed 0.7 of the data sheet's peak", adam: float | None = None) -> dict:
    """A profile of one rented GPU: data-sheet capacities, achieved rates stated as assumed (or measured)."""
    link = {4: ("PCIe 4.0 x16", 25, 32), 5: ("PCIe 5.0 x16", 50, 64)}[pcie]
    adam_note = "measured" if adam else "assumed"
    adam = adam or round(1.5e9 * max(1.0, cores / 16) ** 0.7, -8)
    nvme = _PCIE5_NVME if pcie == 5 else _PCIE4_NVME
    return {
        "cuda": True, "device_name": name, "gpu_total": f"{gib}GiB", "host_total": f"{host_gib}GiB",
        "host_available": f"{int(host_gib * 0.94)}GiB", "nvme_free": "3TiB" if pcie == 5 else "1.5TiB",
        "nvme_read_bw": "11GB/s" if pcie == 5 else "6.0GB/s", "nvme_write_bw": "9GB/s" if pcie == 5 else "4.5GB/s",
        "h2d_bw": f"{link[1]}GB/s", "d2h_bw": f"{link[1]}GB/s", "duplex_bw": f"{int(link[1] * 1.6)}GB/s",
        "mem_bw": f"{int(mem_tbs * 850)}GB/s",
        "cpu_adam_rate": adam, "device_adam_rate": round(mem_tbs * 850e9 / 32, -9),
        "matmul_flops": {k: round(achieved * v, -12) for k, v in _MATMUL_SHAPE.items()},
        "op_overhead_s": 10e-6, "unit_overhead_s": 1e-3, "stream_overhead_s": 1e-3, "step_overhead_s": 1e-3,
        "runtime_rss": "3GiB",
        "threads": cores,
        "device_workspace": "32MiB" if hopper else "8MiB",
        "assumptions": [*measured,
                        f"GPU: {name}, {gib} GiB; bf16 matmul reaching {achieved / 1e12:.0f} TFLOP/s at size 4096 "
                        f"and above ({achieved_note}; data sheet {peak / 1e12:.0f} dense), down to "
                        f"{achieved * 0.36 / 1e12:.0f} at 128 tokens; memory-bound ops at {mem_tbs * 0.85:.2f} TB/s "
                        f"(0.85 of {mem_tbs} TB/s)",
                        f"{link[0]}: {link[1]} GB/s pinned copies each way ({link[2]} GB/s link), "
                        f"{int(link[1] * 1.6)} GB/s both ways at once",
                        f"host share: {host_gib} GiB RAM, {cores} cores running fused AdamW at {adam / 1e9:.1f} G "
                        f"params/s ({adam_note})",
                        *nvme,
                        "a CUDA training process holds 3 GiB of RSS before its model (CUDA context, libraries)",
                        _WORKSPACE_32 if hopper else _WORKSPACE_8, _HOST_ISSUE, _HOST_PASSES, _KERNELS]}


def _lent_h200(profile: dict) -> dict:
    """The `h200` profile: the rented-GPU template with what the H200 lent to this project measured put in place of
    its assumptions (benchmarks/gpu-runs/2026-11-27/h200-measured.json, the probe `tightfit train` ran there and
    the machine's floors; AdamW from 2026-11-26's second run). The disk stays assumed: the lent machine's was a
    VM's, not a rented H200's NVMe."""
    measured = {
        "op_overhead_s": 16.3e-6, "unit_overhead_s": 0.96e-3, "stream_overhead_s": 1.87e-3, "step_overhead_s": 1.59e-3,
        "h2d_bw": "55.4GB/s", "d2h_bw": "55.2GB/s", "duplex_bw": "98.2GB/s", "host_pass_bw": "50.7GB/s",
        "device_workspace": "64MiB",
        # The probe's sizes (tokens of a micro-batch, the matmul's smallest side); the template's above them.
        "matmul_flops": {**profile["matmul_flops"], "32": 26.0e12, "64": 53.1e12, "128": 102.5e12, "256": 204.8e12,
                         "512": 375.1e12, "1024": 529.2e12},
        "attention_flops": {"64": 21.7e12, "256": 56.9e12, "1024": 230.6e12},
    }
    replaced = {_WORKSPACE_32, _HOST_ISSUE, _HOST_PASSES, _KERNELS}
    assumptions = [a for a in profile["assumptions"]
                   if a not in replaced and not a.startswith(("GPU:", "PCIe"))]  # the matmul rates, the copies'
    assumptions.insert(0, "bf16 matmul at 2048 tokens 741 TFLOP/s and at 4096 797 (assumed: 0.93 and 1.0 of the "
                          "8192 figure); memory-bound ops at 4.08 TB/s (assumed: 0.85 of the data sheet's 4.8)")
    return {**profile, **measured, "assumptions": [
        "measured on the H200 lent on 2026-11-26: 139.8 GiB visible to torch, 16 CPU cores, 125 GiB RAM, bf16 matmul "
        "797 TFLOP/s at 8192, fused AdamW on its CPU at 3.35 G params/s (over 64 M parameters on the engine's 11 "
        "step-thread cores; 3.12 on 2026-11-27); on 2026-11-27 (benchmarks/gpu-runs/2026-11-27/): bf16 matmul "
        "26.0 / 53.1 / 102.5 / 204.8 / 375.1 / 529.2 TFLOP/s at 32 / 64 / 128 / 256 / 512 / 1024 tokens, fused "
        "attention 21.7 / 56.9 / 230.6 at 64 / 256 / 1024, the host issuing an op in 16.3 us and spending 0.96 ms "
        "per unit and micro-batch in the engine (1.87 ms more streamed) and 1.59 ms per step, pinned copies 55.4 GB/s "
        "to the GPU, 55.2 from it, 98.2 both ways at once, the CPU's passes besides AdamW 50.7 GB/s, 64 MiB of "
        "cuBLAS workspace held after a first bf16 linear's forward and backward",
        *assumptions]}


PROFILES.update({
    "h100-sxm": _rented("NVIDIA H100 SXM 80GB", gib=80, peak=989e12, achieved=690e12, mem_tbs=3.35, pcie=5,
                        host_gib=220, cores=24, hopper=True),
    "h100-pcie": _rented("NVIDIA H100 PCIe 80GB", gib=80, peak=756e12, achieved=530e12, mem_tbs=2.0, pcie=5,
                         host_gib=180, cores=24, hopper=True),
    # The H200 this project was lent (2026-11-26 and 27): what was measured there is said so (`_lent_h200`).
    "h200": _lent_h200(_rented("NVIDIA H200", gib=139, peak=989e12, achieved=797e12, mem_tbs=4.8, pcie=5,
                               host_gib=125, cores=16, hopper=True,
                               achieved_note="measured: an 8192^3 bf16 matmul on the H200 lent on 2026-11-26",
                               adam=3.35e9)),
    "a100-40gb": _rented("NVIDIA A100 40GB", gib=40, peak=312e12, achieved=230e12, mem_tbs=1.55, pcie=4,
                         host_gib=85, cores=12, hopper=False, achieved_note="assumed 0.74 of the data sheet's peak"),
    "a100-80gb": _rented("NVIDIA A100 80GB", gib=80, peak=312e12, achieved=230e12, mem_tbs=2.0, pcie=4,
                         host_gib=170, cores=12, hopper=False, achieved_note="assumed 0.74 of the data sheet's peak"),
    "l4": _rented("NVIDIA L4", gib=24, peak=121e12, achieved=85e12, mem_tbs=0.3, pcie=4, host_gib=48, cores=8,
                  hopper=False),
    "rtx4090": _rented("NVIDIA GeForce RTX 4090", gib=24, peak=165e12, achieved=150e12, mem_tbs=1.0, pcie=4,
                       host_gib=64, cores=16, hopper=False,
                       achieved_note="assumed 0.9 of the data sheet's peak (fp32 accumulate)"),
})
