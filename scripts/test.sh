#!/usr/bin/env bash
# The test suite as CI runs it (after scripts/setup.sh): pytest-xdist workers, one per CPU core up to
# four (--dist loadfile keeps each file's tests, and its module-scoped compiled fixtures, on one
# worker), then the tests marked `serial` alone: they assert wall-clock bounds (a PETRA rank's failure
# seen within --timeout + 1 s) or time code, which the other workers' load could push over.
# Arguments go to both pytest runs, e.g. `bash scripts/test.sh tests/petra -x`; TEST_WORKERS sets
# the worker count (1: no workers, both runs in this process).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
cores='import os; print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))'
workers=${TEST_WORKERS:-$("$python" -c "$cores")}

# Both runs run; the script fails with the first failing run's code. pytest exits 5 when a selection
# collects nothing: fine for one run (arguments that name only serial or only other tests), 5 for both.
status=0
empty=0
run() {
  "$python" -m pytest "$@"
  local code=$?
  if [ "$code" -eq 5 ]; then
    empty=$((empty + 1))
  elif [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$code
  fi
}

if [ "$workers" -gt 1 ]; then
  run -n "$workers" --dist loadfile -m "not gpu and not slow and not serial" "$@"
else
  run -m "not gpu and not slow and not serial" "$@"
fi
# Without paths among the arguments the serial run collects only the files that mark tests serial
# (collecting the whole suite took ~15 s of CI's time for 6 tests).
serial_files=()
named_path=0
for arg in "$@"; do
  if [ -e "${arg%%::*}" ]; then named_path=1; fi
done
if [ "$named_path" -eq 0 ]; then
  mapfile -t serial_files < <(grep -rl --include="test_*.py" "mark.serial" tests)
fi
run -m "serial and not gpu and not slow" "${serial_files[@]}" "$@"
if [ "$status" -eq 0 ] && [ "$empty" -eq 2 ]; then
  status=5
fi
exit "$status"
