"""The CPU step targets of the fast-eager-path and compiled-runs issues, checked against the
overhead part's step rows (`revkernels.bench.overhead`, ``overhead_cpu.csv``).

Standard library only: `benchmarks/readme_tables.py` loads this file by path to write the README's
target table without importing torch.
"""
import math

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
