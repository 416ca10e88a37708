#!/usr/bin/env bash
# The test suite as CI runs it (after scripts/setup.sh): pytest-xdist workers, one per CPU core up to
# four (--dist loadfile keeps each file's tests, and its module-scoped compiled fixtures, on one
# worker), then the tests marked `serial` alone: they assert wall-clock bounds (a PETRA rank's failure
# seen within --timeout + 1 s) or time code, which the other worker's load could push over.
# Arguments go to both pytest runs, e.g. `bash scripts/test.sh tests/petra -x`; TEST_WORKERS sets
# the worker count (1 runs everything in this process, in pytest's own order).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
workers=${TEST_WORKERS:-$("$python" -c "import os; print(min(4, len(os.sched_getaffinity(0))))")}

# pytest exits 5 when a selection collects nothing: fine for one of the two runs (arguments that name
# only serial or only other tests), an error (5) for both.
empty=0
run() { "$python" -m pytest "$@" || { code=$?; [ "$code" -eq 5 ] || exit "$code"; empty=$((empty + 1)); }; }

if [ "$workers" -gt 1 ]; then
  run -n "$workers" --dist loadfile -m "not gpu and not slow and not serial" "$@"
else
  run -m "not gpu and not slow and not serial" "$@"
fi
run -m "serial and not gpu and not slow" "$@"
[ "$empty" -lt 2 ] || exit 5
