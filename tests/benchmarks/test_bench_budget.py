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
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_budget.py"), "--quick", "--compiled",
                    "--out", str(tmp_path)], check=True, env=env, cwd=ROOT, timeout=600)
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
    compiled = [rows[f"revkernels compiled budget={b:g}"] for b in (0, 0.1, 0.25, 0.5, 0.75, 1)]
    theirs = [rows[f"standard compiled budget={b:g}"] for b in (0, 0.1, 0.25, 0.5, 0.75, 1)]
    assert {r["measured_by"] for r in compiled + theirs} == {"allocator"}
    assert {r["measured_by"] for r in ours} == {"storages"}
    assert compiled[0]["plan"] == "RRRR" and compiled[-1]["plan"] == "KKKK"
    # the plans under torch.compile: checkpointed blocks (C) too, the cheapest time a byte buys there
    assert all(set(r["plan"]) <= set("RCSK") for r in compiled) and any("C" in r["plan"] for r in compiled)
    # the allocator sees the compiled code keep more at a larger budget (a dispatch-mode count saw
    # none of it; rows compiled from one code object ran the first row's graph: every row the same)
    for group in (compiled, theirs):
        assert float(group[-1]["saved_mib"]) > float(group[0]["saved_mib"]) + 0.05


def test_allocated_bytes_agree_with_the_storages_retained(tmp_path):
    # two measures of what a forward leaves for its backward: the storages (a dispatch mode and a
    # saved-tensor hook) and the allocator's count, which also holds the autograd graph's objects
    import torch

    import revkernels as rk
    from revkernels.bench.report import allocated_bytes, retained_bytes

    torch.manual_seed(0)
    seq = rk.nn.ReversibleSequential(*[rk.nn.RevViTBlock(64, 2) for _ in range(3)], engine="autograd")
    x = torch.randn(8, 33, 64, requires_grad=True)
    seq(x, x)  # (lazy initialisation)
    out, storages = retained_bytes(lambda: seq(x, x), [*seq.parameters(), x])
    del out
    out, allocated = allocated_bytes(lambda: seq(x, x), "cpu")
    del out
    assert storages > 2**20
    assert storages <= allocated <= storages + 256 * 1024
