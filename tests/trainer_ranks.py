"""One rank of a 2-process Trainer run (tests/test_hf_trainer_ranks.py starts it under torchrun): a stock
`transformers.Trainer` (accelerate wraps the model in DDP) or a `TightfitTrainer` (every state on this rank's own
NVMe folder, the engine averaging the gradients; zero1/zero2/zero3: each rank its own units' states alone). Rank 0
writes Trainer's log history as JSON.

argv: stock|ours|zero1|zero2|zero3 OUT [resume|save]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

import tightfit
from tightfit.integrations.hf_trainer import TightfitTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_hf_trainer import args, dataset, llama  # noqa: E402

kind, out = sys.argv[1], Path(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else ""
torch.set_num_threads(1)
kw = dict(max_grad_norm=0.5, gradient_accumulation_steps=2, per_device_train_batch_size=2, max_steps=6)
if mode:
    kw.update(save_strategy="steps", save_steps=3)
if kind == "stock":
    trainer = transformers.Trainer(model=llama(), args=args(out, **kw), train_dataset=dataset())
else:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(__import__("os").environ["RANK"])
    placement = tightfit.Placement.everywhere("nvme", nvme_dir=str(out / f"swap-{rank}"))
    trainer = TightfitTrainer(model=llama(), args=args(out, **kw), train_dataset=dataset(), placement=placement,
                              sharding=kind if kind.startswith("zero") else None)
trainer.train(resume_from_checkpoint=str(out / "checkpoint-3") if mode == "resume" else None)
if kind.startswith("zero"):  # of the other rank's units, this rank keeps what its strategy says, and all of its own
    from tightfit.offload.step.engine import find_engine

    units = find_engine(trainer.model).units.values()
    elsewhere = [u for u in units if not u.steps_here]
    assert elsewhere and any(u.steps_here for u in units)
    if kind == "zero3":
        assert all(not u.holds_params and not u.entries() for u in elsewhere)
    else:  # the parameters, without master or moments; zero2 without gradients either
        assert all(u.holds_params and u.keeps_grads == (kind == "zero1") for u in elsewhere)
if trainer.args.process_index == 0:
    (out / f"log{'-' + mode if mode else ''}.json").write_text(json.dumps(trainer.state.log_history))
# Leave as tightfit's ranks do ([Note: leaving the process group] in tightfit/parallel/mesh.py): gloo's threads can
# abort the interpreter's teardown of a finished run.
from tightfit.parallel.mesh import leave_process, shutdown  # noqa: E402

shutdown()
leave_process(0)
