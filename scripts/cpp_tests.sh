#!/usr/bin/env bash
# Builds csrc/ with CMake against the installed torch and runs the C++ unit tests (ctest). Where
# nvcc exists, the build also compiles every csrc/kernels/*.cu file (a compile check; no GPU needed).
# The tests link the op library setup.py built (revkernels/_C*.so) when there is one; OPS_LIBRARY=
# (empty) makes CMake compile the op library itself.
set -euo pipefail
cd "$(dirname "$0")/.."
# The checkout's virtual environment; elsewhere (a git worktree has none) PYTHON names the interpreter.
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
python=${PYTHON:-python}
prefix=$("$python" -c "import torch; print(torch.utils.cmake_prefix_path)")
# The extension setup.py built in place is the op library the tests link (OPS_LIBRARY= to build it here).
ops_library=${OPS_LIBRARY-$(ls "$PWD"/revkernels/_C*.so 2>/dev/null | head -n 1)}
cmake -S . -B build-cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DPython_EXECUTABLE="$(command -v "$python")" -DREVKERNELS_OPS_LIBRARY="$ops_library" > build-cmake.log 2>&1 \
  || { cat build-cmake.log; exit 1; }
cmake --build build-cmake -j "${MAX_JOBS:-2}"
ctest --test-dir build-cmake --output-on-failure
