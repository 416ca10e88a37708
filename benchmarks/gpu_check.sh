#!/usr/bin/env bash
# The GPU check, in one call on a machine with a CUDA GPU and torch/triton/nvcc installed (no
# package index needed): build with the CUDA kernels, run the GPU tests, run the benchmarks, copy
# logs/CSV/PNG to $OUT (at most 8 files) and print a short table last.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
log="$OUT/gpu_check.log"
: > "$log"
step() { echo "== $* ($(date +%T))" | tee -a "$log"; }

step "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1; git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee -a "$log"

step "build (CUDA kernels forced)"
start=$(date +%s)
if ! REVKERNELS_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
     pip install --no-build-isolation --no-deps -e . >> "$log" 2>&1; then
  tail -40 "$log"; echo "BUILD FAILED"; exit 1
fi
echo "build took $(( $(date +%s) - start )) s" | tee -a "$log"

step "GPU tests (-m gpu) and the CPU suite's engine tests on this torch"
python -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -25 | tee -a "$log"
gpu_status=${PIPESTATUS[0]}

step "train-step benchmark"
python -m revkernels.bench --out "$OUT" 2>>"$log" | tee "$OUT/bench_summary.txt"

step "summary"
echo "gpu tests exit status: $gpu_status"
cat "$OUT/bench_summary.txt" | sed -n '/^depth/,/^$/p'
ls "$OUT"
exit "$gpu_status"
