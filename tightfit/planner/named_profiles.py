"""Named what-if machines for `tightfit plan --hardware NAME`: one GPU of 24, 40 or 80 GiB on PCIe 4 or 5.

Why named profiles: the common question is about a class of machine nobody has at hand yet. Each profile is
written in the file format `hardware_file.py` reads (so it doubles as an example of it), and every figure that is
not a data-sheet capacity is stated in its `assumptions`, which the plan prints. The speeds are *achieved* rates
(what a well-fed kernel or copy reaches), below the data sheet's peaks; bf16 matmul, since bf16 is the compute
dtype `--precision auto` picks on CUDA, by the matmul's smallest side (usually the tokens of a micro-batch; [Note:
matmul rate by the smallest side] in model_profile.py): assumed, not measured, below 1024. Change any of them by
saving the profile to a file and editing it: `tightfit plan --hardware gpu24-pcie4 --json` prints the profile
inside the plan.
"""

from __future__ import annotations

_PCIE4_NVME = ["NVMe: one PCIe 4.0 SSD, 6.0 GB/s sequential O_DIRECT read, 4.5 GB/s write, 1.5 TiB free"]
_PCIE5_NVME = ["NVMe: one PCIe 5.0 SSD, 11 GB/s sequential O_DIRECT read, 9 GB/s write, 3 TiB free"]

PROFILES: dict[str, dict] = {
    "gpu24-pcie4": {
        "cuda": True, "device_name": "24 GiB GPU, PCIe 4.0 x16 (RTX 4090 class)",
        "gpu_total": "24GiB", "host_total": "64GiB", "host_available": "60GiB", "nvme_free": "1.5TiB",
        "nvme_read_bw": "6.0GB/s", "nvme_write_bw": "4.5GB/s", "h2d_bw": "25GB/s", "d2h_bw": "25GB/s",
        "mem_bw": "900GB/s", "cpu_adam_rate": 1.5e9, "device_adam_rate": 25e9,
        "matmul_flops": {"128": 60e12, "256": 90e12, "512": 110e12, "1024": 120e12, "2048": 140e12,
                         "4096": 150e12, "8192": 150e12},
        "op_overhead_s": 10e-6, "runtime_rss": "3GiB", "threads": 16,
        "assumptions": ["GPU: 24 GiB, bf16 matmul reaching 150 TFLOP/s at size 4096 (peak 165), 60 at 128 tokens, "
                        "memory-bound ops at 900 GB/s read + write, AdamW 25 G params/s",
                        "PCIe 4.0 x16: 25 GB/s pinned copies each way (32 GB/s link)",
                        "host: 64 GiB RAM, 60 GiB available, 16 cores running fused AdamW at 1.5 G params/s",
                        *_PCIE4_NVME,
                        "a CUDA training process holds 3 GiB of RSS before its model (CUDA context, libraries)"]},
    "gpu40-pcie4": {
        "cuda": True, "device_name": "40 GiB GPU, PCIe 4.0 x16 (A100 40GB PCIe class)",
        "gpu_total": "40GiB", "host_total": "128GiB", "host_available": "120GiB", "nvme_free": "1.5TiB",
        "nvme_read_bw": "6.0GB/s", "nvme_write_bw": "4.5GB/s", "h2d_bw": "25GB/s", "d2h_bw": "25GB/s",
        "mem_bw": "1300GB/s", "cpu_adam_rate": 2.5e9, "device_adam_rate": 40e9,
        "matmul_flops": {"128": 90e12, "256": 130e12, "512": 155e12, "1024": 170e12, "2048": 210e12,
                         "4096": 230e12, "8192": 230e12},
        "op_overhead_s": 10e-6, "runtime_rss": "3GiB", "threads": 32,
        "assumptions": ["GPU: 40 GiB, bf16 matmul reaching 230 TFLOP/s at size 4096 (peak 312), 90 at 128 tokens, "
                        "memory-bound ops at 1.3 TB/s read + write, AdamW 40 G params/s",
                        "PCIe 4.0 x16: 25 GB/s pinned copies each way (32 GB/s link)",
                        "host: 128 GiB RAM, 120 GiB available, 32 cores running fused AdamW at 2.5 G params/s",
                        *_PCIE4_NVME,
                        "a CUDA training process holds 3 GiB of RSS before its model (CUDA context, libraries)"]},
    "gpu80-pcie5": {
        "cuda": True, "device_name": "80 GiB GPU, PCIe 5.0 x16 (H100 PCIe class)",
        "gpu_total": "80GiB", "host_total": "256GiB", "host_available": "240GiB", "nvme_free": "3TiB",
        "nvme_read_bw": "11GB/s", "nvme_write_bw": "9GB/s", "h2d_bw": "50GB/s", "d2h_bw": "50GB/s",
        "mem_bw": "1700GB/s", "cpu_adam_rate": 2.5e9, "device_adam_rate": 55e9,
        "matmul_flops": {"128": 150e12, "256": 220e12, "512": 270e12, "1024": 300e12, "2048": 450e12,
                         "4096": 500e12, "8192": 500e12},
        "op_overhead_s": 10e-6, "runtime_rss": "3GiB", "threads": 32,
        "assumptions": ["GPU: 80 GiB, bf16 matmul reaching 500 TFLOP/s at size 4096 (peak 756), 150 at 128 tokens, "
                        "memory-bound ops at 1.7 TB/s read + write, AdamW 55 G params/s",
                        "PCIe 5.0 x16: 50 GB/s pinned copies each way (64 GB/s link)",
                        "host: 256 GiB RAM, 240 GiB available, 32 cores running fused AdamW at 2.5 G params/s",
                        *_PCIE5_NVME,
                        "a CUDA training process holds 3 GiB of RSS before its model (CUDA context, libraries)"]},
}
"""Name -> profile in the file format (hardware_file.py)."""
