#!/usr/bin/env bash
# The first run of loragen's CUDA path on a GPU, in one command; everything it learns lands in one folder.
#
#   scripts/first_gpu_run.sh [--out DIR] [--wheels DIR] [--steps LIST] [--quick] [--bench "OPTIONS"]
#
#   --out DIR     where the results go (default: $OUT/first-gpu-run when $OUT is set, else
#                 ./first-gpu-run-<UTC time>)
#   --wheels DIR  wheels to install offline first (default: .gpu-wheels; made by
#                 scripts/fetch_gpu_wheels.sh); packages missing there come from the index, if reachable
#   --steps LIST  comma-separated subset, run in this order:
#                 system,install,selfcheck,tests,bench,torchbench,profile,sanitize
#                 (default: all)
#   --quick       the benchmark with few rounds (bench_cuda.py --quick: all parts in about 3 minutes)
#   --bench OPTS  options for benchmarks/bench_cuda.py instead (e.g. "--only model --batches 8")
#
# Run it from the repository root, in the Python environment that holds the CUDA build of torch
# ($PYTHON, default python3). The install step puts loragen in that environment (editable, no
# dependencies resolved online) and installs what is missing from the wheel folder. Every step runs
# even when an earlier one failed; summary.md lists each step's exit status. SANITIZE_TIMEOUT (seconds
# per compute-sanitizer tool, default 300) bounds the slowest step. The output folder holds at most
# twelve files:
#
#   summary.md      steps, exit statuses, the self-check outcomes, the test tally, the benchmark tables
#   system.txt      date, kernel, nvidia-smi (and -q), Python, torch, CUDA, NVRTC, cuda-bindings, pip list
#   install.txt     what was missing and how it was installed
#   selfcheck.json  every kernel variant's self-check on this GPU: "ok" or the reason it falls back
#   tests.txt       pytest -rA of tests/cuda/test_cuda_gpu.py and test_cuda_graphed_model.py (+ the
#                   self-check, launch and host-path tests)
#   bench.txt       benchmarks/bench_cuda.py's tables
#   bench.json      the same numbers as JSON
#   torchbench.txt  bench_cuda.py's small-layer and model parts on the torch path (LORAGEN_CUDA_KERNELS=torch)
#   torchbench.json the same numbers as JSON
#   ncu.csv         Nsight Compute: each LoRA kernel on the 4096^2 layer: time, DRAM throughput, registers,
#                   occupancy, waves
#   sanitize.txt    compute-sanitizer memcheck and racecheck over a subset of test_cuda_gpu.py
#   run.log         everything printed, in order
set -u

PYTHON=${PYTHON:-python3}
WHEELS=.gpu-wheels
STEPS=system,install,selfcheck,tests,bench,torchbench,profile,sanitize
QUICK=0
BENCH_OPTS=
if [ -n "${OUT:-}" ]; then RESULTS="$OUT/first-gpu-run"; else RESULTS="first-gpu-run-$(date -u +%Y%m%dT%H%M%SZ)"; fi
while [ $# -gt 0 ]; do
    case "$1" in
        --out) RESULTS=$2; shift 2 ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --bench) BENCH_OPTS=$2; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0"; exit 0 ;;  # the header above
        *) echo "first_gpu_run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ ! -f pyproject.toml ] || [ ! -d loragen/cuda ]; then
    echo "first_gpu_run.sh: run it from loragen's repository root" >&2
    exit 2
fi
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
export LORAGEN_CACHE_DIR=${LORAGEN_CACHE_DIR:-$PWD/.gpu-kernel-cache}  # kept between runs on one machine
export LORAGEN_GPU_REPORT="$RESULTS"
exec > >(tee -a "$RESULTS/run.log") 2>&1

declare -a DONE=()
step() {  # step NAME COMMAND...: run it, record its status
    local name=$1
    shift
    echo "=== $name ($(date -u +%H:%M:%S))"
    "$@"
    local status=$?
    DONE+=("| $name | $status |")
    echo "=== $name: exit $status"
}
wanted() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

system() {
    {
        echo "# date: $(date -u)"
        echo "# uname: $(uname -a)"
        echo "# git: $(git rev-parse HEAD 2>/dev/null || echo 'not a git checkout')"
        echo "# nvidia-smi"
        nvidia-smi || echo "(nvidia-smi failed)"
        echo "# python and libraries"
        "$PYTHON" - <<'EOF'
import importlib.metadata as md
import sys

print("python", sys.version.replace("\n", " "), sys.executable)
for name in ("torch", "cuda-bindings", "cuda-python", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12",
             "nvidia-cuda-runtime", "peft", "transformers", "libcst", "jinja2", "loragen"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} (not installed)")
try:
    import torch
    print("torch.version.cuda", torch.version.cuda, "| cuda available", torch.cuda.is_available())
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name} sm_{p.major}{p.minor} {p.multi_processor_count} SMs {p.total_memory >> 20} MiB")
except Exception as exc:
    print("torch:", exc)
try:
    from cuda.bindings import driver, nvrtc
    print("driver version", driver.cuDriverGetVersion()[1], "| nvrtc", nvrtc.nvrtcVersion()[1:])
except Exception as exc:
    print("cuda.bindings:", exc)
EOF
        echo "# nvidia-smi -q"
        nvidia-smi -q 2>/dev/null | head -400
        echo "# pip list"
        "$PYTHON" -m pip list 2>/dev/null
    } > "$RESULTS/system.txt" 2>&1
    head -40 "$RESULTS/system.txt"
}

install() {
    {
        local status=0
        # distribution -> a Python check that it works: what loragen, its tests and its benchmark need
        local checks=(
            "jinja2|import jinja2"
            "libcst|import libcst"
            "safetensors|import safetensors"
            "numpy|import numpy"
            "tqdm|import tqdm"
            "pytest|import pytest"
            "peft|import peft"
            "transformers|import transformers"
            "cuda-bindings|from cuda.bindings import driver, nvrtc"
            "nvidia-cuda-nvrtc|from cuda.bindings import nvrtc; assert nvrtc.nvrtcVersion()[0] == 0"
        )
        for entry in "${checks[@]}"; do
            dist=${entry%%|*}
            if "$PYTHON" -c "${entry#*|}" 2>/dev/null; then
                echo "present: $dist"
                continue
            fi
            if ls "$WHEELS"/*.whl >/dev/null 2>&1 \
                && "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" "$dist"; then
                echo "installed from $WHEELS: $dist"
            elif "$PYTHON" -m pip install -q "$dist"; then
                echo "installed from the index: $dist"
            else
                echo "MISSING: $dist (not in $WHEELS, index unreachable)"
                status=1
            fi
        done
        if "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e .; then
            echo "loragen installed (editable) from $PWD"
        else
            echo "loragen could not be installed"
            status=1
        fi
        return $status
    } 2>&1 | tee "$RESULTS/install.txt"
    return "${PIPESTATUS[0]}"
}

selfcheck() {
    "$PYTHON" - "$RESULTS/selfcheck.json" <<'EOF'
import json
import sys
import warnings

import torch

import loragen.cuda
from loragen import switches

if not loragen.cuda.is_available():
    json.dump({"error": "no CUDA device or cuda-python missing"}, open(sys.argv[1], "w"), indent=2)
    print("selfcheck: no CUDA device (or cuda-python missing)")
    sys.exit(1)
from loragen.cuda.launch import DriverLauncher
from loragen.cuda.selfcheck import CheckedLauncher

checker = CheckedLauncher(DriverLauncher())
with warnings.catch_warnings(), switches.cuda_kernels.using("check"):
    warnings.simplefilter("ignore")  # the reasons are in the outcomes
    outcomes = checker.check_all(torch.device("cuda", torch.cuda.current_device()))
json.dump(outcomes, open(sys.argv[1], "w"), indent=2)
for variant, outcome in outcomes.items():
    print(f"{variant}: {outcome}")
sys.exit(0 if all(outcome == "ok" for outcome in outcomes.values()) else 1)
EOF
}

tests() {
    "$PYTHON" -m pytest -rA -p no:cacheprovider tests/cuda/test_cuda_gpu.py tests/cuda/test_cuda_selfcheck.py tests/cuda/test_cuda_launch.py \
        tests/cuda/test_cuda_host_path.py tests/cuda/test_cuda_bench.py tests/cuda/test_cuda_graphed_model.py \
        2>&1 | tee "$RESULTS/tests.txt"
    return "${PIPESTATUS[0]}"
}

# compute-sanitizer over a subset of the GPU tests (about a minute): memcheck, then racecheck. Kernels run
# unchecked (trust) so the sanitizer sees them; API errors are not reported (PyTorch probes the driver).
SANITIZE_TESTS="mask_is_bit_identical or captured_training_step or torch_path_matches or (matches_float64_reference and 0.1-37x200x72-16)"
sanitize() {
    local tool status=0 sanitizer
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    if [ -z "$sanitizer" ]; then
        echo "compute-sanitizer not found" | tee "$RESULTS/sanitize.txt"
        return 1
    fi
    : > "$RESULTS/sanitize.txt"
    for tool in memcheck racecheck; do
        echo "--- $tool" | tee -a "$RESULTS/sanitize.txt"
        LORAGEN_CUDA_KERNELS=trust timeout "${SANITIZE_TIMEOUT:-300}" "$sanitizer" --tool "$tool" --report-api-errors no \
            --error-exitcode 99 --target-processes all \
            "$PYTHON" -m pytest -q -x -p no:cacheprovider tests/cuda/test_cuda_gpu.py -k "$SANITIZE_TESTS" \
            2>&1 | tail -40 | tee -a "$RESULTS/sanitize.txt"
        local code=${PIPESTATUS[0]}
        echo "--- $tool: exit $code" | tee -a "$RESULTS/sanitize.txt"
        if [ "$code" != 0 ]; then status=$code; fi
    done
    return $status
}

bench() {
    local extra=()
    if [ "$QUICK" = 1 ]; then extra=(--quick); fi
    if [ -n "$BENCH_OPTS" ]; then read -r -a extra <<< "$BENCH_OPTS"; fi
    "$PYTHON" benchmarks/bench_cuda.py --json "$RESULTS/bench.json" "${extra[@]}" 2>&1 | tee "$RESULTS/bench.txt"
    return "${PIPESTATUS[0]}"
}

# The parts of the benchmark that time a step (the small layer, the model), on the torch path: what users
# get with LORAGEN_CUDA_KERNELS=torch or after a failed self-check.
torchbench() {
    local rounds=()
    if [ "$QUICK" = 1 ]; then rounds=(--quick); fi
    LORAGEN_CUDA_KERNELS=torch "$PYTHON" benchmarks/bench_cuda.py --only small --only model --no-graph \
        --json "$RESULTS/torchbench.json" "${rounds[@]}" 2>&1 | tee "$RESULTS/torchbench.txt"
    return "${PIPESTATUS[0]}"
}

# Nsight Compute over the first launches of each LoRA kernel in the benchmark's kernel part (the 4096^2
# layer, 4096 tokens, r=16, bf16). The kernels run unchecked so the self-check's small launches stay out.
NCU_METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum
NCU_METRICS+=,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__waves_per_multiprocessor
NCU_METRICS+=,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active
NCU_METRICS+=,sm__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
profile() {
    local profiler
    profiler=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    if [ -z "$profiler" ]; then
        echo "ncu not found" | tee "$RESULTS/ncu.csv"
        return 1
    fi
    LORAGEN_CUDA_KERNELS=trust timeout 240 "$profiler" --target-processes all --csv --kernel-name-base function \
        --kernel-name "regex:^lora_" --launch-count 14 --metrics "$NCU_METRICS" \
        "$PYTHON" benchmarks/bench_cuda.py --only kernels --rounds 1 > "$RESULTS/ncu.csv" 2> "$RESULTS/ncu.err"
    local code=$?
    grep -E '^"ID"|lora_' "$RESULTS/ncu.csv" | head -200 > "$RESULTS/ncu.tmp" && mv "$RESULTS/ncu.tmp" "$RESULTS/ncu.csv"
    tail -5 "$RESULTS/ncu.err"
    rm -f "$RESULTS/ncu.err"
    return $code
}

for name in system install selfcheck tests bench torchbench profile sanitize; do
    if wanted "$name"; then step "$name" "$name"; fi
done

{
    echo "# loragen: first GPU run"
    echo
    echo "$(date -u), $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    echo
    echo "| step | exit status |"
    echo "|---|---|"
    printf '%s\n' "${DONE[@]}"
    if [ -f "$RESULTS/selfcheck.json" ]; then
        echo
        echo "## self-check (selfcheck.json)"
        echo '```'
        cat "$RESULTS/selfcheck.json"
        echo
        echo '```'
    fi
    if [ -f "$RESULTS/tests.txt" ]; then
        echo
        echo "## tests (tests.txt)"
        echo '```'
        grep -E "^(FAILED|ERROR)|passed|failed" "$RESULTS/tests.txt" | tail -60
        echo '```'
    fi
    if [ -f "$RESULTS/sanitize.txt" ]; then
        echo
        echo "## compute-sanitizer (sanitize.txt)"
        echo '```'
        grep -E "^---|ERROR SUMMARY|passed|failed" "$RESULTS/sanitize.txt" | tail -20
        echo '```'
    fi
    if [ -f "$RESULTS/torchbench.txt" ]; then
        echo
        echo "## torch path (torchbench.txt)"
        echo
        tail -20 "$RESULTS/torchbench.txt"
    fi
    if [ -f "$RESULTS/ncu.csv" ]; then
        echo
        echo "## Nsight Compute (ncu.csv)"
        echo '```'
        cat "$RESULTS/ncu.csv"
        echo '```'
    fi
    if [ -f "$RESULTS/bench.txt" ]; then
        echo
        echo "## benchmark (bench.txt, bench.json)"
        echo
        cat "$RESULTS/bench.txt"
    fi
} > "$RESULTS/summary.md"
echo "results: $RESULTS"
