#!/usr/bin/env bash
# Builds csrc/ with CMake against the installed torch and runs the C++ unit tests (ctest). Where
# nvcc exists, the build also compiles every csrc/kernels/*.cu file (a compile check; no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."
# The checkout's virtual environment; elsewhere (a git worktree has none) PYTHON names the interpreter.
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
python=${PYTHON:-python}
prefix=$("$python" -c "import torch; print(torch.utils.cmake_prefix_path)")
cmake -S . -B build-cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DPython_EXECUTABLE="$(command -v "$python")" > build-cmake.log 2>&1 \
  || { cat build-cmake.log; exit 1; }
cmake --build build-cmake -j "${MAX_JOBS:-2}"
ctest --test-dir build-cmake --output-on-failure
