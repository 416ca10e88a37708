"""The benchmark scripts run end to end (CPU smoke runs of the same code the GPU check runs)."""
import csv
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script,csv_name,kinds", [
    ("bench_kernels.py", "kernels_cpu.csv", {"eager", "cpp"}),
    ("bench_train.py", "train_cpu.csv", {"standard", "checkpoint", "reversible_plain", "revkernels_sequential",
                                         "revkernels_pareprop"}),
])
def test_script_writes_its_csv_and_plot(tmp_path, script, csv_name, kinds):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--device", "cpu", "--quick",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / csv_name)))
    column = "impl" if "kernels" in csv_name else "variant"
    assert {r[column] for r in rows} >= kinds
    assert all(r["commit"] and r["device"] and r["torch"] for r in rows)
    assert (tmp_path / csv_name.replace(".csv", ".png")).stat().st_size > 0
