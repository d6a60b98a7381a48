#!/usr/bin/env bash
# Create the project's virtual environment and install tightfit into it, with the right torch build.
#
# Why a script: a plain `pip install torch` on a CPU-only machine downloads the newest multi-GB CUDA build.
# Order of preference:
#   1. a GPU machine (nvidia-smi answers): the registry's default torch, which is CUDA-enabled on Linux;
#   2. a torch wheel that pip already offers locally (find-links / a wheel cache): install it, then resolve only
#      its small dependencies from the registry, pinned to that exact version so nothing newer is pulled;
#   3. otherwise the registry's torch.
# Usage: scripts/setup_env.sh [VENV_DIR]
set -euo pipefail
venv="${1:-.venv}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating virtual environment $venv"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
# Some pip configurations print one warning per unreachable mirror folder; keep real errors, drop that noise.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }

# The oldest torch tightfit runs on, as pyproject.toml states it (one place to change it).
torch_req=$(grep -o '"torch>=[0-9.]*"' "$(dirname "$0")/../pyproject.toml" | tr -d '"')
torch_req=${torch_req:-torch}

have_torch() { "$venv/bin/python" -c "import torch" >/dev/null 2>&1; }

if ! have_torch; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: GPU found, installing CUDA-enabled torch"
        "${pip[@]}" install "$torch_req"
    elif "${pip[@]}" install --no-index --no-deps "$torch_req" >/dev/null 2>&1; then
        version=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('torch'))")
        echo "setup: using the locally offered torch wheel $version"
        quiet "${pip[@]}" install "torch==$version"
    else
        echo "setup: installing torch from the package registry"
        "${pip[@]}" install "$torch_req"
    fi
fi

echo "setup: installing tightfit (editable) with the dev extra"
quiet "${pip[@]}" install -e ".[dev]"
"$venv/bin/python" -c "import tightfit, torch; print('setup: tightfit ready, torch', torch.__version__)"
