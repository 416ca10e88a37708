"""The project's CPU step targets (the fast-eager-path and compiled-runs issues) checked against an
overhead run's step rows.

    python benchmarks/overhead_targets.py                              # benchmarks/results/overhead_cpu.csv
    python benchmarks/overhead_targets.py revkernels-bench/overhead_cpu.csv

Reads the CSV the overhead part writes (`python -m revkernels.bench.overhead`, or the `overhead` part
of `python -m revkernels.bench`) and prints each target whose variant and baseline it measured: the
speed (baseline ms / variant ms, medians), the quartiles of the per-round ratios, the target and
whether it is met. Development targets, kept out of the benchmark's own output, which compares
against baselines only. Standard library only.
"""
import argparse
import csv
import math
import os
import sys

RESULTS_CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "overhead_cpu.csv")

# (configuration, variant, baseline, least speed = baseline ms / variant ms), each a ratio of the
# medians of one run
TARGETS = (
    ("host_bound", "revkernels_sequential", "reversible_plain", 1.2),
    ("host_bound", "revkernels_sequential", "standard", 0.65),
    ("host_bound", "revkernels_sequential", "checkpoint", 1.5),
    ("host_bound", "revkernels_generic_sequential", "reversible_plain", 1.1),
    ("host_bound", "revkernels_compiled", "standard", 1.0),
    ("host_bound", "revkernels_compiled", "reversible_plain", 2.0),
    ("compute_bound", "revkernels_sequential", "reversible_plain", 1.05),
    ("compute_bound", "revkernels_sequential", "standard", 0.74),
    ("compute_bound", "revkernels_compiled", "standard", 0.85),
    ("compute_bound", "revkernels_compiled", "standard_compile", 0.75),
)


def target_rows(rows):
    """The targets of `TARGETS` that `rows` (the overhead part's step rows, or its CSV's) measured
    (variant and baseline both present): dicts with config, variant, baseline, speed (the ratio of
    their step_ms medians), q1 and q3 (the variant's quartiles of the per-round ratios against the
    baseline), target and status ("met", "missed", or "failed" where either has no time)."""
    by = {(r.get("config"), r.get("variant")): r for r in rows}
    out = []
    for config, variant, baseline, target in TARGETS:
        r, base = by.get((config, variant)), by.get((config, baseline))
        if r is None or base is None:
            continue
        base_ms, ms = _as_float(base.get("step_ms")), _as_float(r.get("step_ms"))
        speed = base_ms / ms if math.isfinite(base_ms) and math.isfinite(ms) and ms > 0 else float("nan")
        q1, q3 = (_as_float(r.get(f"vs_{baseline}{suffix}")) for suffix in ("_q1", "_q3"))
        status = "failed" if not math.isfinite(speed) else "met" if speed >= target else "missed"
        out.append({"config": config, "variant": variant, "baseline": baseline, "speed": speed, "q1": q1, "q3": q3,
                    "target": target, "status": status})
    return out


def format_ratio(value, spec=".3f"):
    """`value` as "1.234x", or "n/a" when it is not a finite number."""
    return f"{value:{spec}}x" if isinstance(value, float) and math.isfinite(value) else "n/a"


def format_spread(q1, q3):
    """"q1-q3" of two quartiles, or "n/a" when either is missing."""
    return f"{q1:.2f}-{q3:.2f}" if math.isfinite(q1) and math.isfinite(q3) else "n/a"


def _as_float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def report(rows):
    """The target table's lines for `rows` (none when no target was measured)."""
    return [f"{t['config']:<14} {t['variant']:<30} vs {t['baseline']:<17} {format_ratio(t['speed']):>7} "
            f"(q1-q3 {format_spread(t['q1'], t['q3'])})  target >= {t['target']}: {t['status']}"
            for t in target_rows(rows)]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python benchmarks/overhead_targets.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="?", default=RESULTS_CSV, help=f"the overhead part's step CSV (default: {RESULTS_CSV})")
    args = parser.parse_args(argv)
    with open(args.csv, newline="") as handle:
        lines = report(list(csv.DictReader(handle)))
    if not lines:
        print(f"{args.csv}: no target's variant and baseline measured")
        return 1
    print(f"CPU step targets against {args.csv} (speed = baseline ms / variant ms, medians; q1-q3: quartiles of "
          "the per-round ratios)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
