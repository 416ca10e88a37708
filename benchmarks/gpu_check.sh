#!/usr/bin/env bash
# The GPU check, on a machine with a CUDA GPU and torch/triton/nvcc installed (no package index
# needed): build with the CUDA kernels, run the GPU tests, run the benchmarks, copy logs/CSV/PNG to
# $OUT (at most 8 files) and print a short table last. Every stage has a time limit, so one that
# hangs or runs long still leaves the others' results.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh                      # everything the 510 s budget allows
#   STAGES="build tests kernels train_quick" OUT=/tmp/out bash benchmarks/gpu_check.sh
#   STAGES="prebuilt train" OUT=/tmp/out bash benchmarks/gpu_check.sh  # reuse a carried revkernels/_C*.so
#
# Peer libraries (RevLib, memcnn) are benchmarked where importable; on a machine without a package
# index, put their wheels in .whl/ (pip download --no-deps revlib memcnn -d .whl) and carry it.
#
# Stages: build (pip install -e ., CUDA kernels forced; if that fails the log is kept and the
# package is built without them so the Triton paths still run), prebuilt (use the _C*.so already in
# revkernels/), cpu (the build's CPU kernels: coupling_sub under each ATEN_CPU_CAPABILITY, then the
# engines' and coupling tests on CPU and GPU), tests (pytest -m gpu, $TEST_ARGS appended), kernels (bench_kernels.py), train
# (bench_train.py, $TRAIN_ARGS appended), train_quick (bench_train.py --quick on the GPU),
# overhead (bench_overhead.py on the GPU: host-bound and compute-bound steps of every engine, bf16
# autocast, and the per-call cost of each fused op on its Triton and CUDA C++ paths against ATen),
# petra_project (python -m revkernels.bench.petra --project: 3 files), profile (profile_overhead.py
# on the GPU's host-bound steps: where each variant's host time goes; 2 files).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results/gpu}
STAGES=${STAGES:-build cpu tests kernels train}
mkdir -p "$OUT"
log="$OUT/gpu_check.log"
: >> "$log"
status=0
step() { echo "== $* ($(date +%T))" | tee -a "$log"; }
wants() { [[ " $STAGES " == *" $1 "* ]]; }
# DEADLINE_S: the whole script's time budget (default 510 s: the whole check stays under 9
# minutes); each stage's limit is cut to what is left of it (minus 20 s for the summary), so the
# results of finished stages always come back. The train benchmark writes its CSV after every
# row, target points first, so a cut run keeps what it measured.
DEADLINE_S=${DEADLINE_S:-510}
script_start=$(date +%s)
limit() {
  local s=$1; shift
  if [ -n "${DEADLINE_S:-}" ]; then
    local left=$(( DEADLINE_S - ($(date +%s) - script_start) - 20 ))
    [ "$left" -lt "$s" ] && s=$left
    [ "$s" -le 0 ] && { echo "SKIPPED (no time left): $*" | tee -a "$log"; return 124; }
  fi
  timeout -k 10 "$s" "$@"; local rc=$?
  [ $rc -eq 124 ] && echo "TIMED OUT after $s s: $*" | tee -a "$log"
  return $rc
}

step "environment"
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1; git rev-parse --short HEAD 2>/dev/null; } 2>&1 | tee -a "$log"

if wants build; then
  step "build (CUDA kernels forced)"
  start=$(date +%s)
  if ! REVKERNELS_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
       limit 400 $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    status=1
    grep -E "error|Error" "$OUT/build.log" | head -30 | tee -a "$log"
    step "CUDA build FAILED (build.log); building without the CUDA C++ kernels"
    REVKERNELS_BUILD_CUDA=0 MAX_JOBS=${MAX_JOBS:-16} $PY -m pip install --no-build-isolation --no-deps -e . >> "$log" 2>&1 \
      || { echo "BUILD FAILED"; exit 1; }
  else
    rm -f "$OUT/build.log"
  fi
  echo "build took $(( $(date +%s) - start )) s" | tee -a "$log"
  # The built extension comes back with the results so a later call can skip the build (stage prebuilt).
  so=$(ls revkernels/_C*.so 2>/dev/null | head -1)
  [ -n "$so" ] && strip --strip-debug -o "$OUT/$(basename "$so")" "$so" 2>/dev/null
fi
if wants prebuilt; then
  step "prebuilt extension"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  $PY -c "import revkernels, torch; print('revkernels._C loaded:', hasattr(torch.ops.revkernels, 'cuda_coupling_sub'))" 2>&1 | tee -a "$log"
fi

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  step "peer wheels (.whl/*.whl, e.g. revlib and memcnn for bench_train)"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/revkernels_peers \
    .whl/*.whl >> "$log" 2>&1 && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/revkernels_peers"
fi

if wants cpu; then
  step "CPU kernels of this build (the H200's CUDA build segfaulted in coupling_sub on CPU tensors on 2026-12-04)"
  # Each ISA build alone, then the CPU tests of the engines; faulthandler names the Python frame of a crash.
  for isa in default avx2 avx512; do
    ATEN_CPU_CAPABILITY=$isa limit 30 $PY -X faulthandler -c "import torch, revkernels as rk
y, f = torch.randn(4, 16), torch.randn(4, 16)
assert torch.equal(torch.ops.revkernels.coupling_sub(y, f), y - f)
print('$isa', rk.CPU_KERNEL_BUILD, 'coupling_sub ok')" >> "$log" 2>&1 || { status=1; echo "CPU kernels FAILED under ATEN_CPU_CAPABILITY=$isa" | tee -a "$log"; }
  done
  limit ${CPU_LIMIT:-90} $PY -X faulthandler -m pytest -q -p no:cacheprovider -x tests/engine/test_pareprop.py \
    tests/engine/test_sequential.py tests/ops/test_coupling.py > "$OUT/cpu_tests.log" 2>&1 || status=1
  tail -3 "$OUT/cpu_tests.log" | tee -a "$log"
fi

if wants tests; then
  step "GPU tests (-m gpu ${TEST_ARGS:-})"
  workers=$($PY -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
  # shellcheck disable=SC2086
  limit ${TEST_LIMIT:-240} $PY -m pytest -m gpu -q -rfE -p no:cacheprovider $workers ${TEST_ARGS:-} \
    > "$OUT/gpu_tests.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -40 | tee -a "$log"
fi

if wants kernels; then
  step "kernel benchmark"
  limit ${KERNELS_LIMIT:-240} $PY benchmarks/bench_kernels.py --out "$OUT" 2>&1 | tee -a "$log" > "$OUT/bench_kernels.txt" || status=1
fi

if wants train_quick; then
  step "train-step benchmark, quick shapes on the GPU"
  limit 120 $PY benchmarks/bench_train.py --quick --out "$OUT/quick" >> "$log" 2>&1 || status=1
  rm -rf "$OUT/quick"
fi

if wants overhead; then
  step "host-overhead benchmark on the GPU (Triton backend, then CUDA C++ backend)"
  REVKERNELS_CUDA_BACKEND=triton limit ${OVERHEAD_LIMIT:-150} $PY benchmarks/bench_overhead.py --quick --device cuda --out "$OUT" \
    >> "$log" 2>&1 || status=1
  mkdir -p "$OUT/cuda_cpp"
  REVKERNELS_CUDA_BACKEND=cuda limit ${OVERHEAD_LIMIT:-150} $PY benchmarks/bench_overhead.py --quick --device cuda \
    --configs host_bound --out "$OUT/cuda_cpp" >> "$log" 2>&1 || status=1
fi

if wants profile; then
  step "host-time profile of the host-bound steps on the GPU"
  limit ${PROFILE_LIMIT:-120} $PY benchmarks/profile_overhead.py --config host_bound --device cuda --steps 10 \
    --variants standard reversible_plain checkpoint revkernels_sequential revkernels_generic_sequential \
    revkernels_graphs revkernels_compiled --out "$OUT" >> "$log" 2>&1 || status=1
fi

if wants petra_project; then
  step "PETRA projected speed-up (per-stage times on this GPU + link model)"
  limit ${PETRA_LIMIT:-150} $PY -m revkernels.bench.petra --project --out "$OUT" >> "$log" 2>&1 || status=1
fi

if wants train; then
  step "train-step benchmark ${TRAIN_ARGS:-}"
  # shellcheck disable=SC2086
  limit ${TRAIN_LIMIT:-330} $PY benchmarks/bench_train.py --out "$OUT" ${TRAIN_ARGS:-} 2>&1 | tee -a "$log" > "$OUT/bench_train.txt" || status=1
fi

step "summary"
for f in "$OUT/bench_kernels.txt" "$OUT/bench_train.txt"; do
  [ -f "$f" ] && sed -n '/^op \|^ model\|^model/,$p' "$f" && rm -f "$f"
done
grep -E "passed|failed|error" "$OUT/gpu_tests.log" 2>/dev/null | tail -1
echo "gpu_check exit status: $status"
exit "$status"
