"""bench_text.py runs end to end (tiny sizes) and writes its CSVs with provenance; sequential's loss
curve equals autograd's to rounding and saves less."""
import csv
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bench_text_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_text", ROOT / "benchmarks" / "bench_text.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--steps", "3", "--depths", "1", "3", "--dim", "16", "--heads", "2", "--tokens", "16", "--batch", "2",
                 "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(tmp_path / "text_cpu.csv")))
    assert {(r["depth"], r["model"]) for r in rows} == {(d, m) for d in ("1", "3") for m in module.MODELS}
    assert all(r["commit"] and r["device"] and r["torch"] and float(r["tokens_per_s"]) > 0 for r in rows)
    by = {(r["depth"], r["model"]): r for r in rows}
    for depth in ("1", "3"):
        assert float(by[(depth, "sequential")]["max_abs_loss_diff_vs_autograd"]) < 1e-5
        assert float(by[(depth, "sequential")]["saved_mib"]) < float(by[(depth, "autograd")]["saved_mib"])
    assert by[("1", "sequential")]["saved_mib"] == by[("3", "sequential")]["saved_mib"]
    losses = list(csv.DictReader(open(tmp_path / "text_cpu_loss.csv")))
    assert len(losses) == 2 * len(module.MODELS) * 3
