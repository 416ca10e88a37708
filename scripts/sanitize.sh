#!/usr/bin/env bash
# The C++ op library and its tests under AddressSanitizer and UndefinedBehaviorSanitizer (GCC:
# -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer, CMake option
# REVKERNELS_SANITIZE). Checks out-of-bounds reads and writes (vector tails, strides, heap and stack),
# use after free, misaligned typed accesses, signed overflow, bad shifts and casts and the like in
# csrc/, under every CPU kernel build this CPU runs:
#   1. builds the sanitized op library (every ISA variant of cpu/vec_kernels.cpp) and the C++ unit
#      tests into $SANITIZE_BUILD (build-asan/), apart from the in-place revkernels/_C*.so;
#   2. runs ctest under each ISA (ATEN_CPU_CAPABILITY=default, avx2, avx512, those the CPU has);
#      test_cpu_vec_ops also calls every kernel build directly;
#   3. runs tests/ops with Python importing the sanitized library as revkernels._C
#      (REVKERNELS_C_LIBRARY, honoured by revkernels/_extension.py) under the widest ISA: that
#      includes tests/ops/test_cpu_isa.py, which checks every op under each ISA in subprocesses;
#   4. runs the op tests that call the CPU kernels again under each narrower ISA: the files in
#      SANITIZE_ISA_TESTS less the tests of the Triton kernels and of the pure-PyTorch fallback.
# A finding aborts the test process with the sanitizer's report (file:line stack) on stderr; the
# script then fails.
#
#   bash scripts/sanitize.sh            # after scripts/setup.sh (uses .venv)
#   MAX_JOBS=4 bash scripts/sanitize.sh # build jobs (default 2)
#   SANITIZE_ISAS="avx2" bash scripts/sanitize.sh   # steps 2-4 under these ISAs only
#   SANITIZE_QUICK=1 bash scripts/sanitize.sh       # steps 2-3 under the widest ISA only (CI)
#
# Time on a 2-core x86-64 machine with AVX-512: 3 minutes to build from scratch (the four builds of
# cpu/vec_kernels.cpp are most of it; -O0, see CMakeLists.txt), then 10 s of ctest per ISA, 1.5
# minutes for tests/ops and under 1 minute for the narrower ISAs together: 6 minutes in all (4.5
# with SANITIZE_QUICK=1), longer where other jobs share the cores. A rebuild after a change compiles
# only what changed.
#
# Python runs with LD_PRELOAD of the libasan the library links (the runtime must be loaded before
# anything else; python itself is not instrumented) and of libstdc++ (without it ASan's
# interception of C++ exceptions fails on torch's first exception: "CHECK failed ...
# real___cxa_throw"). Leak detection is off for Python: CPython and torch keep many allocations
# alive until exit on purpose (interned objects, the op registry, thread pools), which LeakSanitizer
# reports as leaks by the thousand, none of them the ops'. The C++ tests run with it on. A CPU-only
# torch is assumed (a CUDA torch under ASan also needs ASAN_OPTIONS=protect_shadow_gap=0).
set -euo pipefail
cd "$(dirname "$0")/.."
# The checkout's virtual environment; elsewhere (a git worktree has none) PYTHON names the interpreter.
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
python=${PYTHON:-python}
build=${SANITIZE_BUILD:-build-asan}
isa_tests=${SANITIZE_ISA_TESTS:-tests/ops/test_coupling.py tests/ops/test_layer_norm.py tests/ops/test_bias_gelu.py tests/ops/test_batch_norm.py tests/ops/test_sanitizer_findings.py}
isa_select="not triton and not fallback and not library_missing"  # (no C++ kernel runs in those)

# --- 1. build ----------------------------------------------------------------------------------
prefix=$("$python" -c "import torch; print(torch.utils.cmake_prefix_path)")
mkdir -p "$build"
cmake -S . -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" -DPython_EXECUTABLE="$(command -v "$python")" \
  -DREVKERNELS_SANITIZE=ON -DREVKERNELS_OPS_LIBRARY= -DREVKERNELS_CUDA_COMPILE_CHECK=OFF > "$build/configure.log" 2>&1 \
  || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" -j "${MAX_JOBS:-2}"
library=$(cd "$build" && pwd)/librevkernels_ops.so
runtime() {  # the path of the shared library $1 (libasan, libstdc++) that the op library links
  local path
  path=$(ldd "$library" | awk -v name="$1" 'index($1, name) == 1 { print $3; exit }')
  [ -n "$path" ] || { echo "sanitize.sh: $library does not link $1" >&2; exit 1; }
  echo "$path"
}
asan=$(runtime libasan.so)  # (one per assignment: set -e stops at a failed one)
stdcxx=$(runtime libstdc++.so)
preload="$asan $stdcxx"

# The ISAs to run: those named, else every one ATen runs on this CPU (ATEN_CPU_CAPABILITY lowers
# ATen's choice only; a value the CPU lacks leaves the widest it has).
isas=()
for isa in ${SANITIZE_ISAS:-default avx2 avx512}; do
  got=$(ATEN_CPU_CAPABILITY=$isa "$python" -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
  if [ "$got" = "$isa" ]; then isas+=("$isa"); else echo "sanitize.sh: this CPU does not run $isa (ATen picks $got): skipped"; fi
done
[ "${#isas[@]}" -gt 0 ] || { echo "sanitize.sh: none of the ISAs ${SANITIZE_ISAS:-} runs on this CPU" >&2; exit 1; }
widest=${isas[${#isas[@]}-1]}  # (the last: SANITIZE_ISAS lists them narrowest first)
# SANITIZE_QUICK=1: the widest ISA only. The others still run in step 3's test_cpu_isa.py subprocesses
# and in test_cpu_vec_ops, which calls every build directly.
if [ "${SANITIZE_QUICK:-0}" = 1 ]; then isas=("$widest"); fi

export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Python with the sanitized library as revkernels._C; ISA in $1.
sanitized_python() {
  local isa=$1
  shift
  ATEN_CPU_CAPABILITY=$isa REVKERNELS_C_LIBRARY="$library" LD_PRELOAD="$preload" ASAN_OPTIONS=detect_leaks=0 \
    "$python" "$@"
}

# --- 2. C++ unit tests ---------------------------------------------------------------------------
for isa in "${isas[@]}"; do
  echo "== ctest, ATEN_CPU_CAPABILITY=$isa"
  ATEN_CPU_CAPABILITY=$isa ASAN_OPTIONS=detect_leaks=1 ctest --test-dir "$build" --output-on-failure
done

# --- 3, 4. Python op tests -------------------------------------------------------------------------
# pytest ISA TESTS...: first asserts that Python loads the sanitized library. --capture=sys: a
# sanitizer writes its report to file descriptor 2 and aborts, which pytest's default capture (by
# file descriptor) would swallow with the process.
sanitized_pytest() {
  local isa=$1
  shift
  sanitized_python "$isa" -c "import revkernels as rk; f = rk._extension._C.__file__
assert f == '$library', f'revkernels._C was loaded from {f}'
print('revkernels._C:', f, '- kernels:', rk.CPU_KERNEL_BUILD)"
  sanitized_python "$isa" -m pytest -p no:xdist -p no:cacheprovider --capture=sys -q "$@"
}
echo "== tests/ops, ATEN_CPU_CAPABILITY=$widest"
sanitized_pytest "$widest" tests/ops
for isa in "${isas[@]}"; do
  if [ "$isa" != "$widest" ]; then
    echo "== the kernels' op tests, ATEN_CPU_CAPABILITY=$isa"
    # shellcheck disable=SC2086  # a list of paths
    sanitized_pytest "$isa" $isa_tests -k "$isa_select"
  fi
done
echo "sanitize.sh: no findings (ISAs: ${isas[*]})"
