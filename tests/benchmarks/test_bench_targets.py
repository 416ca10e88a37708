"""benchmarks/overhead_targets.py: the project's CPU step targets checked against the overhead part's
rows (its CSV)."""
import csv
import math

from tests.benchmarks import load_script

targets = load_script("overhead_targets")


def _row(config, variant, ms, **quartiles):
    return {"config": config, "variant": variant, "step_ms": ms, **quartiles}


def test_targets_match_the_issues():
    """The ten CPU step targets of the fast-eager-path and compiled-runs issues, as stated there
    (a changed threshold must change this test too)."""
    stated = {
        "host_bound": {"revkernels_sequential": {"reversible_plain": 1.2, "standard": 0.65, "checkpoint": 1.5},
                       "revkernels_generic_sequential": {"reversible_plain": 1.1},
                       "revkernels_compiled": {"standard": 1.0, "reversible_plain": 2.0}},
        "compute_bound": {"revkernels_sequential": {"reversible_plain": 1.05, "standard": 0.74},
                          "revkernels_compiled": {"standard": 0.85, "standard_compile": 0.75}}}
    flat = [(c, v, b, t) for c, variants in stated.items() for v, bases in variants.items() for b, t in bases.items()]
    assert list(targets.TARGETS) == flat


def test_target_rows_and_their_status():
    """Each target whose variant and baseline the rows measured: the ratio of their step_ms medians,
    the variant's quartile columns and the status, from floats or from the CSV's strings."""
    rows = [_row("host_bound", "reversible_plain", 10.0), _row("host_bound", "standard", 6.0),
            _row("host_bound", "checkpoint", float("nan")),
            _row("host_bound", "revkernels_sequential", 8.0, vs_reversible_plain_q1=1.19, vs_reversible_plain_q3=1.3,
                 vs_standard_q1=0.7, vs_standard_q3=0.8),
            _row("compute_bound", "standard_compile", "76.0"),
            _row("compute_bound", "revkernels_compiled", "100.0", vs_standard_compile_q1="0.74",
                 vs_standard_compile_q3="0.77")]
    found = targets.target_rows(rows)
    got = [(t["config"], t["variant"], t["baseline"], t["speed"], t["target"], t["status"]) for t in found]
    assert got[0] == ("host_bound", "revkernels_sequential", "reversible_plain", 1.25, 1.2, "met")
    assert got[1] == ("host_bound", "revkernels_sequential", "standard", 0.75, 0.65, "met")
    assert got[2][:3] == ("host_bound", "revkernels_sequential", "checkpoint") and got[2][5] == "failed"
    assert got[3] == ("compute_bound", "revkernels_compiled", "standard_compile", 0.76, 0.75, "met")
    assert len(got) == 4  # the other targets lack their variant or baseline
    assert (found[0]["q1"], found[0]["q3"]) == (1.19, 1.3) and (found[3]["q1"], found[3]["q3"]) == (0.74, 0.77)
    assert found[1]["q1"] == 0.7 and math.isnan(found[2]["q1"])
    rows[3]["step_ms"] = 9.0  # 10 / 9 = 1.11x: below 1.2
    assert targets.target_rows(rows)[0]["status"] == "missed"
    rows[3]["step_ms"] = 10.0 / 1.2  # exactly at the target: met
    assert targets.target_rows(rows)[0]["status"] == "met"


def test_formats():
    assert targets.format_ratio(1.23456) == "1.235x" and targets.format_ratio(float("nan")) == "n/a"
    assert targets.format_ratio("") == "n/a"
    assert targets.format_spread(0.7449, 0.78) == "0.74-0.78" and targets.format_spread(float("nan"), 1.0) == "n/a"


def test_cli_reads_the_overhead_csv(tmp_path, capsys):
    rows = [_row("host_bound", "reversible_plain", 10.0),
            _row("host_bound", "revkernels_sequential", 9.0, vs_reversible_plain_q1=1.05, vs_reversible_plain_q3=1.3)]
    path = tmp_path / "overhead_cpu.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[1]))
        writer.writeheader()
        writer.writerows(rows)
    assert targets.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "revkernels_sequential" in out and "1.111x (q1-q3 1.05-1.30)  target >= 1.2: missed" in out
    with open(path, "w", newline="") as handle:  # a baseline alone: no target measured
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerow(rows[0])
    assert targets.main([str(path)]) == 1
    assert "no target" in capsys.readouterr().out
