"""scripts/margins.py: each test's body drawn N times, the error/tolerance ratios of its checks
through the two comparison helpers recorded, failed draws counted, the riskiest first."""
import csv
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOY_TESTS = textwrap.dedent('''
    import torch

    from tests.helpers import assert_close_rel, assert_low_precision_rule

    calls = [0]


    def one_plus(err):
        return torch.tensor([1.0 + err], dtype=torch.float64)


    def test_half_the_tolerance():
        assert_close_rel(one_plus(5e-6), one_plus(0.0), 1e-5)


    def test_fails_in_the_third_draw():
        calls[0] += 1
        assert_close_rel(one_plus(2e-5 if calls[0] == 3 else 2.5e-6), one_plus(0.0), 1e-5, "the third")


    def test_a_quarter_of_the_low_precision_bound():
        assert_low_precision_rule(one_plus(1e-3), one_plus(2e-3), one_plus(0.0))


    def test_its_own_check():
        assert 1 + 1 == 2
        assert_close_rel(one_plus(1e-3), one_plus(1e-3), 0)  # an exact check: no ratio


    def test_holds_once_per_process():
        calls.append("once")
        assert calls.count("once") == 1, "counted again"
''')


def test_margins_counts_the_draws_and_sorts_the_riskiest_first(tmp_path):
    (tmp_path / "test_toy.py").write_text(TOY_TESTS)
    out = tmp_path / "margins.csv"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "margins.py"), str(tmp_path / "test_toy.py"),
                             "--draws", "4", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    # The pytest run passes (the failed draw was an extra one); the script's exit code reports it.
    assert result.returncode == 1, result.stdout + result.stderr
    rows = list(csv.DictReader(open(out)))
    by_name = {r["test"].split("::")[-1]: r for r in rows}
    assert [r["test"].split("::")[-1] for r in rows] == [
        "test_fails_in_the_third_draw", "test_half_the_tolerance", "test_a_quarter_of_the_low_precision_bound",
        "test_its_own_check", "test_holds_once_per_process"]
    third = by_name["test_fails_in_the_third_draw"]
    assert (third["draws"], third["failed_draws"], third["max"], third["median"]) == ("4", "1", "2", "0.25")
    assert third["first_failure"].startswith("the third: relative error 2.000e-05 > 1.0e-05")
    half = by_name["test_half_the_tolerance"]
    assert (half["draws"], half["failed_draws"], half["max"], half["p90"], half["median"]) == ("4", "0", "0.5", "0.5", "0.5")
    assert by_name["test_a_quarter_of_the_low_precision_bound"]["max"] == "0.25"
    own = by_name["test_its_own_check"]
    assert (own["draws"], own["max"], own["median"]) == ("4", "", "")
    once = by_name["test_holds_once_per_process"]
    assert (once["draws"], once["failed_draws"], once["error"]) == ("1", "0", "a re-run failed another check: counted again")
    assert "1/4" in result.stdout and f"wrote {out}" in result.stdout


def test_margins_rejects_no_draws():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "margins.py"), "--draws", "0"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--draws must be at least 1, got 0" in result.stderr
