"""Scale-out on PyTorch's own distributed engines: DDP, FSDP2, DTensor TP, torch.distributed.pipelining.

Each parallelism is one verb-named function applied from outside the model, composed in one documented order by
`parallelize` (parallelize.py): PP split → `apply_tp` → `apply_ddp`/`apply_zero` → `apply_pp` → optimizer.
`choose_strategy` (auto.py) picks a strategy from hardware and model sizes; `what_if` (whatif.py) answers
`tightfit plan` for hardware that is not there; `run_distributed`/`launch` (run.py) are `tightfit train`'s
multi-process path. See docs/PARALLEL.md.
"""

from tightfit.parallel.auto import StrategyChoice, choose_strategy
from tightfit.parallel.costs import Hardware, ModelProfile, comm_per_step, memory_per_gpu
from tightfit.parallel.data_parallel import apply_ddp, apply_zero, build_optimizer
from tightfit.parallel.mesh import ParallelDims, build_mesh, init_distributed
from tightfit.parallel.parallelize import ParallelModel, make_optimizer, parallelize
from tightfit.parallel.pipeline import apply_pp, balance, build_stage_module
from tightfit.parallel.plan import ParallelPlan, parse_strategy
from tightfit.parallel.state import gather_full_state, load_moments
from tightfit.parallel.tensor_parallel import apply_tp

__all__ = ["Hardware", "ModelProfile", "ParallelDims", "ParallelModel", "ParallelPlan", "StrategyChoice",
           "apply_ddp", "apply_pp", "apply_tp", "apply_zero", "balance", "build_mesh", "build_optimizer",
           "build_stage_module", "choose_strategy", "comm_per_step", "gather_full_state", "init_distributed",
           "load_moments", "make_optimizer", "memory_per_gpu", "parallelize", "parse_strategy"]
