# The README's two commands: `make train` and `make test`. Each sets up .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tightfit-installed

.PHONY: train test test-slow test-faults test-gpu gpu-check bench results setup clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(VENV)/bin/tightfit train

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# Fault injection (issue 17): >= 20 kill -9 trials (TIGHTFIT_FAULT_TRIALS, TIGHTFIT_FAULT_SEED), full disks and a
# read-only out-dir on a small tmpfs (as root), planted files and symlinks, two runs on one folder. `make test`
# runs its fast subset.
test-faults: $(STAMP)
	$(PY) -m pytest -q tests/test_faults.py tests/test_run_lock.py -m "slow or not slow" -s

# On a machine with a CUDA GPU: the engine's fidelity and memory tests on the GPU (they fail without one).
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m cuda

# On a machine with a CUDA GPU: the CUDA tests and the GPU benchmarks (stage limits 360 s by default; GPU_CHECK_STAGES
# picks others: big, the 7B under 24 GiB; fsdp; parts), figures to runs/gpu-check/.
# No .venv needed: it uses the machine's own CUDA torch and installs nothing from a registry (scripts/gpu_check.sh).
gpu-check:
	bash scripts/gpu_check.sh

# benchmarks/RESULTS.md's summary and the pictures in docs/img/, regenerated from the benchmarks' JSON.
results: $(STAMP)
	$(PY) benchmarks/summary.py

clean:
	rm -rf $(VENV) runs .pytest_cache
