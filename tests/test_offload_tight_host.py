"""Regression: an optimizer step under a host budget that fits about one unit's largest job must finish.

The read-ahead of the next unit once waited for pool buffers that the unit being stepped held: a deadlock. With
optimizer states preloaded during backward, the preloads hold buffers until the step: they must leave it room to
start. With each unit stepped during backward, the step thread once waited for buffers that the preload of the
next unit (stepped after it) held, while backward waited for a buffer to fetch that unit: a deadlock (a 48 MiB host
budget on the memory benchmark's model); a step now gives up other units' preloads first. The run happens in a
subprocess with a timeout so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch
    import tightfit
    from tightfit import Placement
    from tightfit.models.gpt import GPT, GPTConfig
    from tightfit.offload import engine_of

    torch.manual_seed(0)
    def model():
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=8, n_head=2, n_embd=64))
    ref, wrapped = model(), model()
    wrapped.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    # Measure one unit's working set with an unbounded engine, then rebuild with a budget just above it.
    probe = model()
    tightfit.wrap(probe, Placement.everywhere("nvme", nvme_dir=sys.argv[1] + "/probe"))
    work = engine_of(probe).pool.largest_job  # the largest buffer set one job is granted at once
    kw = {}
    if sys.argv[4] == "tight-device":  # room for the root and two blocks: each block fetched as backward reaches it
        units = engine_of(probe).units
        block = max(u.compute_bytes for name, u in units.items() if name != "root")
        kw = dict(device_budget=2 * units["root"].compute_bytes + 4 * block,
                  checkpoint_units=[n for n in units if n != "root"])
    placement = Placement.everywhere("nvme", nvme_dir=sys.argv[1] + "/swap",
                                     host_budget=int(work * float(sys.argv[3])), prefetch_depth=3, **kw)
    tightfit.wrap(wrapped, placement)
    opt = tightfit.optim.AdamW(wrapped.parameters(), lr=1e-2)
    preload = sys.argv[2] == "preload"  # optimizer states loaded during backward, held until the step
    early = sys.argv[2] == "early"  # each unit stepped during backward, on the step thread
    for i in range(3):
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(i))
        for m, o in ((ref, ref_opt), (wrapped, opt)):
            loss = m(x, torch.roll(x, -1, 1))
            if preload and o is opt:
                o.preload_during_backward()
            if early and o is opt:
                o.step_during_backward()
            loss.backward()
            o.step()
            o.zero_grad()
            print(i, loss.item(), flush=True)
    print("finished")
""")


@pytest.mark.parametrize("mode,device", [("plain", "free"), pytest.param("preload", "free", marks=pytest.mark.slow),
                                         ("preload", "tight-device"),
                                         pytest.param("early", "free", marks=pytest.mark.slow),
                                         ("early", "tight-device")])
def test_step_with_room_for_one_unit_finishes(tmp_path, mode, device):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), mode, "1.3", device], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split("\n")
    assert "finished" in lines
    losses = [line.split()[1] for line in lines if line[:1].isdigit()]
    assert losses[0::2] == losses[1::2]  # plain and wrapped agree step by step
