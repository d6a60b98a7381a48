#!/usr/bin/env bash
# `make gpu-check`: on a machine with a CUDA GPU, in one call (its default stages' limits sum to 360 s, so a session
# of 15 device minutes has room to run it twice, or it and `GPU_CHECK_STAGES="big fsdp"`), run the CUDA tests,
# measure the machine's floors, run the default `tightfit train` and the 1.1B Llama's host side, and leave four
# files in runs/gpu-check/: figures.json and figures.md (every figure), gpu-check.log (every stage's output) and
# parts.tar.gz (what the stages wrote: JUnit XML, each benchmark's JSON, the train run's metrics, env.json).
#
# It downloads nothing: the GPU machines this project is lent reach no package registry and carry their own CUDA
# torch. So it takes the first Python among $PYTHON, .venv/bin/python, python3, python whose torch sees a GPU, and
#   - uses it as is if it is this project's .venv (made by `make setup`, tightfit installed);
#   - else makes a virtual environment on top of it (runs/gpu-venv, --system-site-packages, so its torch is the
#     machine's; where that Python is itself a virtual environment, a .pth file adds its site-packages) and installs
#     tightfit there with `pip install --no-index --no-deps --no-build-isolation -e .` (nothing fetched: the build
#     uses the setuptools already there); where pip cannot, a .pth file naming this checkout does the same job;
#   - where no virtual environment can be made, runs everything with PYTHONPATH=. (tightfit from this checkout).
# Stages, each under a time limit (seconds; the default ones, tests floors train llama, sum to 360; what each took
# on an H200 on 2026-11-26 and 27):
#   tests  (155)  pytest -m cuda tests/test_offload_cuda.py (the H200 deadlock's scenario among them; 123 s for 31
#                 tests on 2026-11-27; the 32nd, a fresh process's CUDA floor, 16 s alone: at 150 s the stage stopped
#                 in it on a slower host)
#   floors (30)   benchmarks/bench_gpu_floors.py: CPU AdamW on every thread, at the engine's step-thread counts and
#                 at the probe's size, H2D/D2H alone and both at once, the disk under the swap folder (24 s), and
#                 the host's contention (the widening add and AdamW beside each other and the copies: a few s more)
#   train  (80)   tightfit train, the default run (the README's `make train`) on the GPU: the probe first (32 s on
#                 a machine it has not measured), then 1500 steps (~30 s)
#   fsdp   (190)  opt-in since the default list was cut to 360 s: benchmarks/bench_offload_fsdp.py: tightfit vs FSDP2 + CPUOffloadPolicy under an 8 GiB cap,
#                 `--strategy zero3` in a world of one (FSDP2 over tightfit's split of the units, issue 43), and
#                 tightfit with its budget at FSDP2's peak where it reserved more (~40 s a side, 129 s on 2026-11-27);
#                 GPU_CHECK_FSDP_CASTS=1 adds a fourth side, the plan with the CPU's step casting the masters where
#                 the plan had the GPU cast them (decision 8), and 40 s to the stage's limit
#   llama  (95)   benchmarks/bench_gpu_llama.py: TinyLlama-1.1B's shape under a 24 GiB cap: plain PyTorch on the
#                 whole GPU, and every state on host (32k tokens a step, clipped; ~40 s a side; the host side took
#                 8.3 s a step on a slower host, in micro-batch-major order); GPU_CHECK_LLAMA_PLAN=1 adds tightfit's
#                 plan under the cap (40 s more), GPU_CHECK_LLAMA_NVME=1 every state on NVMe (not timed on a GPU yet)
#   parts  (150)  opt-in, not in the default list: benchmarks/bench_step_parts.py, where a launch-bound step's
#                 time goes (the probe's host figures in fp32 and under autocast, the default model's and the 1.1B
#                 Llama's steps by phase, the kernels they launch and the share of the step the GPU is busy)
#   big    (300)  opt-in, not in the default list: benchmarks/bench_gpu_big.py, a Llama-2-7B under a 24 GiB cap
#                 trained by `tightfit train` (meta-device build, states placed by the plan for this machine's GPU,
#                 RAM and the swap folder's disk; bf16, clipping, 32k tokens a step; up to 200 s), then the 1.1B
#                 Llama with every state on the host at 32k and 128k tokens a step against plain PyTorch (45 s each;
#                 on 2026-11-29 the 7B took 142 s for 4 steps in micro-batch-major order, ~88 s of it set-up, the
#                 probe cached; the host sides not run yet). Each part's output: bench_gpu_big_<part>.log in parts,
#                 stamped, with every thread's stack where a part ran out of its time
# GPU_CHECK_STAGES="tests fsdp" runs some of them (a stage run again replaces only its own results, so stages run
# one call at a time end in the same report); GPU_CHECK_OUT changes the folder. Exit status 0 when every stage ran
# and passed. GPU_CHECK_SMOKE=1 checks this script itself on a machine without a GPU: any torch will do, the tests
# are only collected and the benchmarks run their tiny `--device cpu` smoke configurations (figures meaningless).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${GPU_CHECK_OUT:-runs/gpu-check}
venv=${GPU_CHECK_VENV:-runs/gpu-venv}
stages=${GPU_CHECK_STAGES:-tests floors train llama}
parts="$out/parts"  # the stages' files, packed into parts.tar.gz at the end
mkdir -p "$out" "$parts"
[ -f "$out/parts.tar.gz" ] && tar -xzf "$out/parts.tar.gz" -C "$parts" 2>/dev/null  # stages run before stay
log="$out/gpu-check.log"
: >>"$log"
report() { "${py:-python3}" scripts/gpu_check_report.py "$@" --out "$out" --parts "$parts"; }
pack() { tar -czf "$out/parts.tar.gz" -C "$parts" . && rm -rf "$parts"; }

# 1. A Python whose torch sees a CUDA GPU.
smoke=${GPU_CHECK_SMOKE:-0}
cuda_ok() {
    "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() or $smoke else 1)" >/dev/null 2>&1
}
base=""
tried=()
for cand in ${PYTHON:-} .venv/bin/python python3 python; do
    command -v "$cand" >/dev/null 2>&1 || continue
    tried+=("$cand")
    if cuda_ok "$cand"; then base=$(command -v "$cand"); break; fi
done
if [ -z "$base" ]; then
    why="no CUDA GPU: no Python here has a torch that sees one (tried: ${tried[*]:-none})"
    echo "gpu-check: $why" >&2
    rm -f "$parts/stages.tsv" "$parts/env.json"
    report write --no-gpu "$why"
    pack
    exit 1
fi

# 2. tightfit importable next to that torch, without downloading anything.
py="$base"
install="the project's .venv ($base)"
if [ "$base" != "$(command -v .venv/bin/python 2>/dev/null)" ]; then
    if ! cuda_ok "$venv/bin/python"; then
        rm -rf "$venv"
        # No pip or setuptools of its own: those of $base's site serve (a venv's bundled setuptools may be too old
        # to build an editable install without the wheel package).
        "$base" -m venv --system-site-packages --without-pip "$venv" >/dev/null 2>&1
        if [ -x "$venv/bin/python" ] && ! cuda_ok "$venv/bin/python"; then
            # $base is itself a virtual environment: --system-site-packages reached its base Python, not its
            # packages. Point the new environment at them.
            site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
            "$base" -c "import site; print('\n'.join(site.getsitepackages()))" >"$site/_gpu_check_base.pth"
        fi
    fi
    if cuda_ok "$venv/bin/python"; then
        py="$venv/bin/python"
        site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        rm -f "$site/_tightfit_checkout.pth"
        if "$py" -c "import setuptools" >/dev/null 2>&1 &&
            "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-build-isolation -e . \
                >>"$log" 2>&1; then
            install="pip install --no-deps --no-build-isolation -e . into $venv (on $base)"
        else
            # What an editable install amounts to, without the package's metadata and console script.
            echo "$PWD" >"$site/_tightfit_checkout.pth"
            install="a .pth file naming this checkout in $venv (on $base); pip could not install offline"
            install+=" (see $log)"
            echo "gpu-check: $install" >&2
        fi
    else
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
        install="PYTHONPATH=. with $base (no virtual environment could be made on it)"
    fi
fi
"$py" scripts/gpu_check_report.py env --out "$out" --parts "$parts" --install "$install"

# 3. The stages, each under its time limit; each one's output also goes to gpu-check.log.
run_stage() {  # name limit_s command...
    local name=$1 limit=$2 t0 rc
    shift 2
    echo "gpu-check: stage $name (limit ${limit}s): $*" | tee -a "$log"
    t0=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    sed -i "/^$name\t/d" "$parts/stages.tsv" 2>/dev/null
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$limit" "$(date -u +%FT%TZ)" \
        >>"$parts/stages.tsv"
}
export PYTHONUNBUFFERED=1
swap=$(mktemp -d "${TMPDIR:-/tmp}/tightfit-gpu-check-XXXXXX")  # the NVMe sides' swap folder, removed at the end
trap 'rm -rf "$swap"' EXIT
fsdp_limit=190
[ "${GPU_CHECK_FSDP_CASTS:-0}" = 1 ] && fsdp_limit=230
if [ "$smoke" = 1 ]; then
    echo "gpu-check: GPU_CHECK_SMOKE=1: tests collected only, benchmarks in their CPU smoke configurations" >&2
    collect=(--collect-only)
    floors_shape=(--device cpu --numel 65536 --mib 4 --reps 1 --disk-mib 8)
    train_shape=(--steps 3 --n-layer 1 --n-embd 32 --n-head 2 --seq-len 32 --eval-interval 3 --eval-batches 1)
    fsdp_shape=(--device cpu --layers 2 --embd 64 --batch 2 --seq 32 --steps 3 --warmup 1)
    llama_shape=(--device cpu --layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 256 --seq 32
        --batch 2 --steps 3 --warmup 1 --sides plain,tightfit,tightfit-host,tightfit-nvme --host-accum 2)
else
    collect=()
    floors_shape=()
    train_shape=()
    fsdp_shape=(--layers 24 --embd 2048 --batch 2 --seq 1024 --cap-gib 8 --steps 5 --warmup 2)
    [ "${GPU_CHECK_FSDP_CASTS:-0}" = 1 ] && fsdp_shape+=(--compare-casts)
    llama_sides=plain-uncapped,tightfit-host
    llama_limit=95
    [ "${GPU_CHECK_LLAMA_PLAN:-0}" = 1 ] && llama_sides+=,tightfit && llama_limit=$((llama_limit + 40))
    [ "${GPU_CHECK_LLAMA_NVME:-0}" = 1 ] && llama_sides+=,tightfit-nvme && llama_limit=$((llama_limit + 60))
    llama_shape=(--cap-gib 24 --steps 4 --warmup 1 --sides "$llama_sides" --host-accum 8 --clip 1.0)
fi
for stage in $stages; do
    case $stage in
    tests)
        rm -f "$parts/cuda-tests.xml"
        # A hung test fails alone where pytest-timeout is installed; else the stage's limit stops them all.
        per_test=()
        "$py" -c "import pytest_timeout" >/dev/null 2>&1 && per_test=(--timeout=60)
        run_stage tests 155 "$py" -m pytest -v --durations=10 -m cuda -p no:cacheprovider tests/test_offload_cuda.py \
            --junitxml="$parts/cuda-tests.xml" "${per_test[@]}" "${collect[@]}" ;;
    floors)
        rm -f "$parts/bench_gpu_floors.json"
        run_stage floors 30 "$py" benchmarks/bench_gpu_floors.py --nvme "$swap/floors" "${floors_shape[@]}" \
            --json-out "$parts/bench_gpu_floors.json" ;;
    train)
        rm -rf "$parts/train"
        run_stage train 80 "$py" -m tightfit.cli train --out-dir "$swap/train" "${train_shape[@]}"
        mkdir -p "$parts/train"
        cp "$swap/train/metrics.jsonl" "$parts/train/" 2>/dev/null ;;
    fsdp)
        rm -f "$parts/bench_offload_fsdp.json"
        run_stage fsdp "$fsdp_limit" "$py" benchmarks/bench_offload_fsdp.py "${fsdp_shape[@]}" \
            --json-out "$parts/bench_offload_fsdp.json" ;;
    llama)
        rm -f "$parts/bench_gpu_llama.json"
        run_stage llama "${llama_limit:-95}" "$py" benchmarks/bench_gpu_llama.py "${llama_shape[@]}" --nvme "$swap/llama" \
            --json-out "$parts/bench_gpu_llama.json" ;;
    big)  # opt-in (GPU_CHECK_STAGES=big): the 7B under 24 GiB, and the 1.1B host sides at 32k and 128k tokens
        rm -f "$parts/bench_gpu_big.json"
        big_shape=()
        [ "$smoke" = 1 ] && big_shape=(--smoke --timeout-7b 120 --timeout-host 60)
        run_stage big 300 "$py" benchmarks/bench_gpu_big.py --nvme "$swap/big" "${big_shape[@]}" \
            --json-out "$parts/bench_gpu_big.json" ;;
    parts)  # opt-in (GPU_CHECK_STAGES=parts): where a step's host and GPU time go, default model and Llama
        rm -f "$parts/bench_step_parts.json"
        parts_shape=(--device cuda --reps 30 --llama-layers 22)
        [ "$smoke" = 1 ] && parts_shape=(--device cpu --reps 3)
        run_stage parts 150 "$py" benchmarks/bench_step_parts.py "${parts_shape[@]}" \
            --json-out "$parts/bench_step_parts.json" ;;
    *)
        echo "gpu-check: unknown stage '$stage' (GPU_CHECK_STAGES takes tests, floors, train, fsdp, llama, parts," \
            "big)" >&2
        exit 2 ;;
    esac
done
report write
rc=$?
pack
exit $rc
