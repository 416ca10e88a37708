"""bench_drift.py runs end to end (--quick) and writes its CSV with provenance."""
import csv
import importlib.util
import math
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_drift_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_drift", ROOT / "benchmarks" / "bench_drift.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--quick", "--modes", "fp32", "bf16_streams", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "drift_cpu.csv")))
    assert {(r["mode"], r["streams"], r["depth"]) for r in rows} == {
        (m, s, d) for m in ("fp32", "bf16_streams") for s in ("float", "exact") for d in ("1", "2")}
    assert all(r["commit"] and r["device"] and r["torch"] and r["status"] == "ok" for r in rows)
    errors = {(r["mode"], r["streams"], r["depth"]): float(r["chained_max"]) for r in rows}
    assert all(math.isfinite(e) for e in errors.values())
    # fp32 rebuilds ~exactly, bf16 streams do not; exact mode's fixed-point streams rebuild exactly in both
    assert errors[("fp32", "float", "2")] < 1e-5 < errors[("bf16_streams", "float", "2")]
    assert errors[("fp32", "exact", "2")] == errors[("bf16_streams", "exact", "2")] == 0.0
