#!/usr/bin/env bash
# Creates ./.venv (if missing) with CPU torch 2.13.0, the test, benchmark and documentation tools, and revkernels
# built in place (C++ CPU kernels; CUDA kernels too when torch has CUDA and nvcc exists).
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
pip_quiet() { pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

# Pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel this project tests on.
python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
  || pip_quiet torch==2.13.0
pip_quiet setuptools wheel ninja cmake numpy tqdm pytest pytest-xdist hypothesis matplotlib triton scikit-learn
# Peer libraries the train-step benchmark compares against (pure Python; --no-deps: memcnn's declared
# SimpleITK/torchvision are not needed by its couplings, and would pull another torch).
pip_quiet --no-deps revlib==1.7.2 memcnn==1.5.2
# The documentation site (mkdocs.yml; tests/test_docs.py builds it strictly).
pip_quiet mkdocs==1.6.1 mkdocs-material==9.8.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"
# The extension is built in place with build_ext, whose ./build keeps ninja's state: a second run
# recompiles only what changed (pip's editable build compiles everything in a fresh temporary folder
# every time). The editable install then only points .venv at the checkout.
MAX_JOBS=${MAX_JOBS:-2} python setup.py -q build_ext --inplace > build-ext.log 2>&1 || { cat build-ext.log; exit 1; }
# No build isolation: the build backend runs with the torch installed above.
REVKERNELS_SKIP_EXTENSION=1 pip_quiet --no-build-isolation --no-deps -e .
# (a failed compile leaves the optional extension out without failing build_ext: its log tells why)
python -c "import revkernels as rk; assert rk.HAS_C_EXTENSION, 'revkernels._C was not built'; print('revkernels', rk.__version__, 'ready in .venv (C++ kernels built)')" \
  || { tail -n 60 build-ext.log; exit 1; }
