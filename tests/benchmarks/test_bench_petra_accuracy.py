"""benchmarks/bench_petra_accuracy.py --quick runs end to end: backprop, PETRA and delayed gradients on
digits (one seed, a few steps), with the gradient analysis, written to a CSV with provenance."""
import csv
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_petra_accuracy_quick_writes_its_csv(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_petra_accuracy.py"), "--quick", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    for m in ("backprop", "petra", "delayed"):
        assert f"{m:9s} test accuracy" in result.stdout
    assert "PETRA's gradient closer to end-to-end than delayed's" in result.stdout
    rows = list(csv.DictReader(open(tmp_path / "petra_digits_cpu.csv")))
    assert sorted(r["method"] for r in rows) == ["backprop", "delayed", "petra"]
    for r in rows:
        assert r["commit"] and r["device"] and r["torch"]
        assert 0 <= float(r["test_acc"]) <= 1 and -1 <= float(r["mean_cosine"]) <= 1 + 1e-9
        assert int(r["analysis_records"]) > 0 and len(r["stage_mean_cosine"].split()) == 10
    backprop = next(r for r in rows if r["method"] == "backprop")
    assert abs(float(backprop["mean_cosine"]) - 1) < 1e-6 and abs(float(backprop["mean_norm_ratio"]) - 1) < 1e-6
