#!/usr/bin/env python
"""Margin check: how close do the tests' random draws come to their tolerances?

Every test draws fresh random inputs (tests/conftest.py seeds each test anew), so one CI run sees
one draw of each comparison; a test at a tenth of its tolerance in one run can still fail one run in
a few hundred. This script runs a pytest selection with each test's body drawn ``--draws`` times
(the extra draws continue the test's random stream, so they see new inputs) and records, per draw,
the largest error/tolerance ratio of its checks through `tests.helpers.assert_close_rel` (error over
the tolerance) and `tests.helpers.assert_low_precision_rule` (error over twice PyTorch's). It writes
a CSV, one row per test sorted by the largest ratio (draws, median, 90th percentile, max, failed
draws, the first failure's message), and prints the riskiest.

    python scripts/margins.py tests/engine/test_sequential.py --draws 50
    python scripts/margins.py tests/models tests/nn --draws 20 -n 2 --out /tmp/margins.csv

Arguments it does not know go to pytest (paths, ``-k``, ``-n`` for xdist workers). Run on demand
(minutes: every test runs --draws times), not in CI. Read the table knowing what it cannot see:
checks that compare with their own code (``rel_err`` and an ``assert``, ``torch.equal``) give no
ratio (blank columns); tests that seed themselves draw the same inputs every time (median = max);
pytest's own call is the first draw and decides the test's outcome; the test is drawn again only
while it passes, and a re-run that raises anything but a failed check of the two helpers (a compile
count that holds once per process, Dynamo's recompile limit) ends its draws and is reported in the
`error` column, not as a failed draw. A ratio above 1 is a failed draw: fix its cause
(conditioning, dtype, inputs), never the tolerance.

The same file is the pytest plugin (``-p margins``, with scripts/ on the path) that the script
loads into every pytest process it starts, workers included.
"""
import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRAWS_ENV = "REVKERNELS_MARGIN_DRAWS"
RECORDS_ENV = "REVKERNELS_MARGIN_RECORDS"

# ---- the plugin (inside the pytest processes) ----

_worst = [0.0]  # the largest ratio of the draw in progress


def _note(ratio):
    _worst[0] = max(_worst[0], ratio)


def pytest_configure(config):
    """Wraps the two comparison helpers before the test modules import them."""
    if RECORDS_ENV not in os.environ:
        return
    import tests.helpers as helpers

    rel_err = helpers.rel_err
    check_close, check_low_precision = helpers.assert_close_rel, helpers.assert_low_precision_rule

    def assert_close_rel(actual, expected, tol=1e-5, what="tensor"):
        err = rel_err(actual, expected)
        if tol > 0 or err > 0:  # (an exact check, tol 0, that holds has no ratio)
            _note(err / tol if tol > 0 else float("inf"))
        check_close(actual, expected, tol, what)

    def assert_low_precision_rule(actual, same_dtype_torch, exact, what="tensor"):
        ours, torch_err = rel_err(actual, exact), rel_err(same_dtype_torch, exact)
        _note(ours / (2 * torch_err) if torch_err > 0 else (0.0 if ours == 0 else float("inf")))
        check_low_precision(actual, same_dtype_torch, exact, what)

    helpers.assert_close_rel = assert_close_rel
    helpers.assert_low_precision_rule = assert_low_precision_rule


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """After pytest's own call (the first draw, whose outcome is the test's), runs the body --draws - 1
    more times, while it passes or fails only the two helpers' checks."""
    if RECORDS_ENV not in os.environ:
        yield
        return
    _worst[0] = 0.0
    outcome = yield
    ratios, failures, errors = [_worst[0]], [], []
    if outcome.excinfo is not None:
        if issubclass(outcome.excinfo[0], AssertionError):
            failures.append((str(outcome.excinfo[1]) or "AssertionError").splitlines()[0])
    else:
        for _ in range(int(os.environ[DRAWS_ENV]) - 1):
            _worst[0] = 0.0
            try:
                item.runtest()
            except AssertionError as e:
                message = str(e).splitlines()[0] if str(e) else "AssertionError"
                if _worst[0] <= 1:  # not a tolerance: a check that does not hold on a re-run (a compile count)
                    errors.append(f"a re-run failed another check: {message}"[:300])
                    break
                failures.append(message)
            except Exception as e:  # noqa: BLE001 - a draw that cannot run again (a recompile limit)
                errors.append(traceback.format_exception_only(type(e), e)[-1].strip()[:300])
                break
            ratios.append(_worst[0])
    with open(os.environ[RECORDS_ENV], "a") as f:  # one line per write: workers may append at once
        f.write(json.dumps({"test": item.nodeid, "ratios": ratios, "failures": failures, "errors": errors}) + "\n")


# ---- the script ----

def summarise(records):
    """CSV rows, riskiest first, from the plugin's records."""
    rows = []
    for r in records:
        ratios = sorted(r["ratios"])
        seen = ratios and max(ratios) > 0  # else no check went through the two helpers
        rows.append({"test": r["test"], "draws": len(ratios),
                     "median": f"{statistics.median(ratios):.3g}" if seen else "",
                     "p90": f"{ratios[int(0.9 * (len(ratios) - 1))]:.3g}" if seen else "",
                     "max": f"{ratios[-1]:.3g}" if seen else "", "failed_draws": len(r["failures"]),
                     "first_failure": r["failures"][0] if r["failures"] else "",
                     "error": r["errors"][0] if r["errors"] else ""})
    return sorted(rows, key=lambda row: (-row["failed_draws"], -float(row["max"] or -1)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=20, help="draws of each test (default 20)")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "margins.csv"),
                        help="CSV path (default: margins.csv in the temp folder)")
    parser.add_argument("--top", type=int, default=20, help="rows to print (default 20)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.draws < 1:
        parser.error(f"--draws must be at least 1, got {args.draws}")
    records_path = args.out + ".jsonl"
    if os.path.exists(records_path):
        os.remove(records_path)
    env = dict(os.environ, **{DRAWS_ENV: str(args.draws), RECORDS_ENV: records_path},
               PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "scripts"), ROOT, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pytest", "-p", "margins", "-q", "-p", "no:cacheprovider",
               "-m", "not gpu and not slow", *pytest_args]
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    records = [json.loads(line) for line in open(records_path)] if os.path.exists(records_path) else []
    if not records:
        print(f"margins: no test ran (pytest exit code {code})", file=sys.stderr)
        return code or 1
    rows = summarise(records)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.remove(records_path)
    print(f"\n{'max':>7} {'p90':>7} {'median':>7} {'failed':>6}/{'draws':<5} test")
    for row in rows[:args.top]:
        print(f"{row['max'] or '-':>7} {row['p90'] or '-':>7} {row['median'] or '-':>7} "
              f"{row['failed_draws']:>6}/{row['draws']:<5} {row['test']}")
    print(f"wrote {args.out} ({len(rows)} tests, up to {args.draws} draws each)")
    return 1 if any(row["failed_draws"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
