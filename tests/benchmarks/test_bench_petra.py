"""`python -m revkernels.bench.petra --quick` (also `benchmarks/bench_petra.py`, a thin entry point over it,
and the suite's `petra` part) runs end to end: the distributed PETRA runtime (2 CPU processes) and
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
    result = subprocess.run([sys.executable, "-m", "revkernels.bench.petra", "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speed-up of PETRA (2 processes) over reversible backprop" in result.stdout
    rows = list(csv.DictReader(open(tmp_path / "petra_cpu.csv")))
    assert {r["variant"] for r in rows} == {"revbackprop_1thread", "revbackprop_2thread", "petra_distributed"}
    for r in rows:
        assert r["commit"] and r["device"] and r["torch"] and float(r["images_per_s"]) > 0
        assert float(r["speedup_vs_revbackprop_same_cores"]) > 0 and float(r["speedup_vs_revbackprop_best"]) > 0
    assert [r["groups"] for r in rows if r["variant"] == "petra_distributed"] == ["0-4 5-9"]


def test_bench_petra_run_returns_its_rows(monkeypatch, tmp_path):
    """run(args) returns the CSV's rows (what the suite's summary reads); the timing itself mocked."""
    import revkernels.bench.petra as bench

    monkeypatch.setattr(bench, "_bench_revbackprop", lambda cfg, threads: [0.2 * threads] * cfg["steps"])
    monkeypatch.setattr(bench, "launch", lambda fn, nproc, args, **kw: [{"tick_s": [0.1] * 4, "groups": [[0, 1, 2, 3, 4],
                                                                                                     [5, 6, 7, 8, 9]]}])
    rows = bench.run(bench.parse_args(["--quick", "--out", str(tmp_path)]))
    petra = next(r for r in rows if r["variant"] == "petra_distributed")
    assert petra["speedup_vs_revbackprop_best"] == 2.0 and petra["speedup_vs_revbackprop_same_cores"] == 4.0
    assert petra["groups"] == "0-4 5-9" and (tmp_path / "petra_cpu.csv").exists()
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0  # an exit status, not the rows
