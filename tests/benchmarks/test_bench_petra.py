"""benchmarks/bench_petra.py --quick runs end to end: the distributed PETRA runtime (2 CPU processes) and
single-process reversible backprop, timed in one run, written to a CSV with provenance."""
import csv
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_bench_petra_quick_writes_its_csv(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_petra.py"), "--quick", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speed-up of PETRA (2 processes) over reversible backprop" in result.stdout
    rows = list(csv.DictReader(open(tmp_path / "petra_cpu.csv")))
    assert {r["variant"] for r in rows} == {"revbackprop_1thread", "revbackprop_2thread", "petra_distributed"}
    for r in rows:
        assert r["commit"] and r["device"] and r["torch"] and float(r["images_per_s"]) > 0
        assert float(r["speedup_vs_revbackprop_same_cores"]) > 0 and float(r["speedup_vs_revbackprop_best"]) > 0
    assert [r["groups"] for r in rows if r["variant"] == "petra_distributed"] == ["0-4 5-9"]
