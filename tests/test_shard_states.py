"""ShardStatesAdamW (tightfit/parallel/shard_states.py) on FSDP2's ZeRO-3 shards, 2 gloo ranks: every local shard,
moment and step count equal to `torch.optim.AdamW(fused=True)` on the same shards bit for bit, with each unit's
moments in host memory or in the rank's own swap files, clipped by the global norm, the steps running on their own
thread under the next forward (the strict mode's delays make forwards arrive first: without the pre-hook that
orders FSDP2's all-gather after the unit's step, the weights differ); resumed from a gathered checkpoint halfway, the
same bits again; no swap file left after `close`."""

from __future__ import annotations

import re
import subprocess
import sys

from parallel_launch import ROOT, free_port, rank_env


def test_shard_states_equal_torch_fused_adamw_on_fsdp2_shards():
    cases = ["host", "nvme", "host:resume", "nvme:resume"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "--max-restarts=0", "--monitor-interval=1", str(ROOT / "tests" / "shard_states_worker.py"), *cases]
    proc = subprocess.run(cmd, env=rank_env(TIGHTFIT_STRICT_MOVER="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and " FAIL " not in out, out[-3000:]
    lines = {m.group(1): m for m in re.finditer(r"CASE (\S+) OK exposed=([\d.]+) files=(\d+)", out)}
    assert sorted(lines) == sorted(cases), out[-3000:]
    assert float(lines["host"].group(2)) > 0, "no forward waited for a step: the pre-hook was not exercised"
    assert int(lines["nvme"].group(3)) == 4 and int(lines["host"].group(3)) == 0  # a file per unit: root, 3 blocks
