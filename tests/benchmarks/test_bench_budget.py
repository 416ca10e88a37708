"""benchmarks/bench_budget.py: the speed-against-memory rows are the methods they name, with
measured saved bytes and, for revkernels, the plan each budget ran (no timing is asserted)."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_run_writes_rows_with_measured_memory(tmp_path):
    pytest.importorskip("matplotlib")
    # (a process of its own, without the suite's TRITON_INTERPRET: the CPU ops as a user runs them)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_budget.py"), "--quick", "--out",
                    str(tmp_path)], check=True, env=env, cwd=ROOT, timeout=600)
    with open(tmp_path / "budget_cpu.csv") as handle:
        rows = {r["method"]: r for r in csv.DictReader(handle)}
    assert (tmp_path / "budget_cpu.png").stat().st_size > 0
    saved = {m: float(r["saved_mib"]) for m, r in rows.items()}
    ours = [rows[f"revkernels budget={b:g}"] for b in (0, 0.1, 0.25, 0.5, 0.75, 1)]
    outputs_mib = 2 * 2 * 9 * 32 * 4 / 2**20  # (--quick: batch 2, 9 tokens, dim 32; two streams)
    for row in ours:  # each block rebuilt (R), kept selectively (S) or kept (K); what it keeps, as planned
        assert len(row["plan"]) == 4 and set(row["plan"]) <= set("RSK")
        assert float(row["saved_mib"]) <= float(row["planned_mib"]) + outputs_mib + 1e-4
    assert ours[0]["plan"] == "RRRR" and ours[-1]["plan"] == "KKKK"
    assert saved["revkernels budget=1"] == saved["standard"]  # budget 1: what plain autograd saves
    assert saved["revkernels budget=0"] < min(v for m, v in saved.items() if m.startswith("checkpoint"))
    # the measurement sees selective checkpointing's cache (no saved-tensor hook does)
    assert saved["selective checkpoint"] > saved["checkpoint every 1"]
    assert all(r["commit"] and r["torch"] and r["device"] for r in rows.values())
