#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA GPU and torch/triton/nvcc installed (no package index
# needed): build with the CUDA kernels, run the GPU tests, run the benchmarks, copy logs/CSV/PNG to
# $OUT (at most 8 files) and print a short table last.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh                    # everything (about 12 min on an H200)
#   STAGES="build tests kernels" OUT=/tmp/out bash benchmarks/gpu_check.sh   # first call (< 9 min)
#   STAGES="build train" OUT=/tmp/out bash benchmarks/gpu_check.sh           # second call (< 9 min;
#                                                                  the build is incremental by then)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
STAGES=${STAGES:-build tests kernels train}
mkdir -p "$OUT"
log="$OUT/gpu_check.log"
: >> "$log"
status=0
step() { echo "== $* ($(date +%T))" | tee -a "$log"; }
wants() { [[ " $STAGES " == *" $1 "* ]]; }

step "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1; git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee -a "$log"

if wants build; then
  step "build (CUDA kernels forced)"
  start=$(date +%s)
  if ! REVKERNELS_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
       pip install --no-build-isolation --no-deps -e . >> "$log" 2>&1; then
    tail -40 "$log"; echo "BUILD FAILED"; exit 1
  fi
  echo "build took $(( $(date +%s) - start )) s" | tee -a "$log"
fi

if wants tests; then
  step "GPU tests (-m gpu)"
  python -m pytest -m gpu -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  status=$?
  tail -25 "$OUT/gpu_tests.log" | tee -a "$log"
fi

if wants kernels; then
  step "kernel benchmark"
  python benchmarks/bench_kernels.py --out "$OUT" > "$OUT/bench_kernels.txt" 2>> "$log" || status=1
fi

if wants train; then
  step "train-step benchmark"
  python benchmarks/bench_train.py --out "$OUT" > "$OUT/bench_train.txt" 2>> "$log" || status=1
fi

step "summary"
for f in "$OUT/bench_kernels.txt" "$OUT/bench_train.txt"; do
  [ -f "$f" ] && sed -n '/^op \|^ model\|^model/,$p' "$f"
done
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -1
echo "gpu_check exit status: $status"
exit "$status"
