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
    # --warmup 1 --steps 2 (quick's own: 6 and 4): three steps per variant, enough for every column
    result = subprocess.run([sys.executable, "-m", "revkernels.bench.petra", "--quick", "--warmup", "1", "--steps", "2",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "speed-up of PETRA (2 processes) over reversible backprop" in result.stdout
    assert "--quick: a smoke test" in result.stdout and "target" not in result.stdout
    rows = list(csv.DictReader(open(tmp_path / "petra_cpu.csv")))
    assert {r["quick"] for r in rows} == {"True"}
    assert {r["variant"] for r in rows} == {"revbackprop_1thread", "revbackprop_2thread", "petra_distributed"}
    for r in rows:
        assert r["commit"] and r["device"] and r["torch"] and float(r["images_per_s"]) > 0
        assert float(r["speedup_vs_revbackprop_same_cores"]) > 0 and float(r["speedup_vs_revbackprop_best"]) > 0
    petra = next(r for r in rows if r["variant"] == "petra_distributed")
    first, second = petra["groups"].split()  # --balance time (default): two contiguous groups of the 10 stages
    assert first.startswith("0-") and second.endswith("-9") and int(second.split("-")[0]) == int(first[2:]) + 1
    assert float(petra["max_group_ms"]) > 0 and float(petra["bound"]) > 0
    assert abs(float(petra["efficiency"]) * float(petra["bound"]) - float(petra["speedup_vs_revbackprop_1thread"])) < 0.01
    # the busiest rank's compute is part of its tick: no efficiency above 100% of the bound
    assert 0 < float(petra["efficiency"]) <= 1 and float(petra["max_group_ms"]) <= float(petra["step_ms"])
    assert len(petra["stage_ms"].split()) == 10 and petra["balance"] == "time"


def test_bench_petra_run_returns_its_rows(monkeypatch, tmp_path):
    """run(args) returns the CSV's rows (what the suite's summary reads); the timing itself mocked."""
    import revkernels.bench.petra as bench

    from revkernels.petra.simulate import split_groups

    monkeypatch.setattr(bench, "_bench_revbackprop", lambda cfg, threads: [0.2 * threads] * cfg["steps"])
    monkeypatch.setattr(bench, "_profile", lambda cfg: [0.01] * 5 + [0.03] * 5)
    # rank 0 waits (ticks of 0.1 s, 0.05 s of compute); rank 1, the busiest, computes 0.08 s of its 0.1 s ticks
    monkeypatch.setattr(bench, "launch", lambda fn, nproc, args, **kw: [
        {"tick_s": [0.1, 0.12, 0.1, 0.1], "compute_s": [0.05] * 4, "groups": split_groups(10, args[0]["groups"])[:1]},
        {"tick_s": [0.1, 0.1, 0.09, 0.11], "compute_s": [0.08, 0.07, 0.08, 0.09],
         "groups": split_groups(10, args[0]["groups"])}])
    rows = bench.run(bench.parse_args(["--quick", "--out", str(tmp_path)]))
    petra = next(r for r in rows if r["variant"] == "petra_distributed")
    assert petra["speedup_vs_revbackprop_best"] == 2.0 and petra["speedup_vs_revbackprop_same_cores"] == 4.0
    # time balance of the profiled stages: 0-6 (5 x 10 + 2 x 30 = 110 ms) | 7-9 (90 ms); the bound from the
    # busiest rank's measured compute: 200 ms / 80 ms
    assert petra["groups"] == "0-6 7-9" and (tmp_path / "petra_cpu.csv").exists()
    assert petra["max_group_ms"] == 80.0 and petra["bound"] == 2.5 and petra["efficiency"] == 0.8
    rows = bench.run(bench.parse_args(["--quick", "--balance", "count", "--out", str(tmp_path)]))
    petra = next(r for r in rows if r["variant"] == "petra_distributed")
    assert petra["groups"] == "0-4 5-9" and petra["max_group_ms"] == 80.0
    with pytest.raises(ValueError, match="--groups must be 2 sizes summing to 10"):
        bench.run(bench.parse_args(["--quick", "--groups", "4", "4", "--out", str(tmp_path)]))
    with pytest.raises(ValueError, match=r"--nproc must be at most 10 \(the stages of revnet18\), got 11"):
        bench.run(bench.parse_args(["--quick", "--nproc", "11", "--out", str(tmp_path)]))
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 0  # an exit status, not the rows


def test_busiest_rank_and_its_compute_share():
    """PETRA's time and the bound's compute come from the rank whose median compute is the longest, both
    medians of that rank's own ticks: where every tick's compute is part of the tick, the compute share
    (the efficiency) is at most 1, whatever the other ranks' ticks."""
    from revkernels.bench.petra import busiest

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        ranks = []
        for _ in range(3):
            ticks = (torch.rand(5, generator=g) + 0.01).tolist()
            ranks.append({"tick_s": ticks, "compute_s": [t * float(torch.rand(1, generator=g)) for t in ticks]})
        tick, compute = busiest(ranks)
        assert compute == max(sorted(r["compute_s"])[2] for r in ranks)
        assert 0 < compute <= tick
    fast = {"tick_s": [0.5] * 3, "compute_s": [0.01] * 3}
    slow = {"tick_s": [0.2] * 3, "compute_s": [0.15] * 3}
    assert busiest([fast, slow]) == busiest([slow, fast]) == (0.2, 0.15)


def test_bench_petra_project_quick_writes_csv_and_png(tmp_path, capsys):
    """``--project --quick`` on CPU: per-stage times and bytes for RevNet-18 and RevNet-34, one row per J with a
    sane projection (J = 1 is reversible backprop itself), CSVs with provenance, a PNG. In this process (the
    command line runs in a fresh one in the test above), one timed repetition without warm-up per stage
    (--warmup 0 --steps 1): what is checked holds for any positive times."""
    import revkernels.bench.petra as bench

    assert bench.main(["--project", "--quick", "--device", "cpu", "--warmup", "0", "--steps", "1",
                       "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "petra_projection_cpu.csv")))
    stages = list(csv.DictReader(open(tmp_path / "petra_projection_stages_cpu.csv")))
    for model in ("revnet18", "revnet34"):
        mine = [r for r in rows if r["model"] == model]
        n = sum(1 for s in stages if s["model"] == model)
        assert [int(r["J"]) for r in mine] == sorted({1, n} | {2 ** k for k in range(1, 6) if 2 ** k < n})
        assert float(mine[0]["speedup_overlap"]) == 1.0 and mine[0]["groups"] == f"0-{n - 1}"
        for r in mine:
            assert r["commit"] and r["device"].startswith("CPU") and float(r["link_gb_s"]) == 25.0
            assert 0 < float(r["speedup_serial"]) <= float(r["speedup_overlap"]) <= int(r["J"]) + 1e-6
            assert float(r["tick_ms_overlap"]) >= float(r["max_compute_ms"]) > 0
        assert mine[-1]["groups"] == " ".join(f"{i}-{i}" for i in range(n))
    assert all(float(s["petra_ms"]) > 0 for s in stages)
    assert all(float(s["rebuild_ms"]) > 0 for s in stages if s["reversible"] == "True")
    assert all(int(s["bwd_send_bytes"]) == 0 for s in stages if s["stage"] == "0")
    assert "revnet34 cifar stem 8x8" in out
    pytest.importorskip("matplotlib")
    assert (tmp_path / "petra_projection_cpu.png").stat().st_size > 0


def test_projection_model_by_hand():
    """The tick model on made-up stages: DP grouping, overlap vs serial transfer, speed-ups."""
    from revkernels.bench.petra import best_grouping, project

    st = [{"petra_ms": t, "fwd_send_bytes": 1e9 if i < 3 else 0, "bwd_send_bytes": 0 if i == 0 else 2e9}
          for i, t in enumerate([10.0, 10.0, 10.0, 30.0])]
    # one stage per worker at 100 GB/s: worker 1 sends 1 GB forward + 2 GB backward, receives 1 + 2 GB -> 30 ms
    tick, sizes = best_grouping(st, 4, 100.0, 0.0, overlap=True)
    assert sizes == [1, 1, 1, 1] and abs(tick - 30.0) < 1e-9
    tick_s, _ = best_grouping(st, 4, 100.0, 0.0, overlap=False)
    assert abs(tick_s - 50.0) < 1e-9  # the head: 30 ms compute + 20 ms sending 2 GB backward (receives 1 GB)
    rows = project(st, 50.0, 100.0, 0.0)
    assert [r["J"] for r in rows] == [1, 2, 4]
    assert rows[0]["speedup_overlap"] == 1.0 and rows[0]["backprop_ms"] == 50.0
    two = rows[1]  # 3 | 1: compute 30 and 30, transfer 30 on both sides -> tick 30 overlapped
    assert two["groups"] == "0-2 3-3" and two["tick_ms_overlap"] == 30.0 and two["speedup_overlap"] == 2.0
