"""benchmarks/readme_tables.py: README tables generated from benchmark CSVs."""
import csv
import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "readme_tables.py")
META = {"commit": "abc1234", "device": "Test GPU", "torch": "2.x", "triton": "3.x", "revkernels": "0.1.0",
        "c_extension": "True", "date": "2026-11-30"}


@pytest.fixture(scope="module")
def readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) + list(META))
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **META})


def _kernel_row(op, impl, ms, gbs):
    return {"op": op, "rows": 4, "width": 8, "dtype": "bfloat16", "impl": impl, "ms": ms, "call_ms": ms,
            "timing": "cudagraph", "gb_per_s": gbs, "call_gb_per_s": gbs, "tflop_per_s": "", "pct_of_copy": "",
            "copy_gb_per_s": 4000}


def _train_row(kind, model, batch, variant, ms):
    return {"kind": kind, "model": model, "depth": 12, "batch": batch, "variant": variant, "ms": ms,
            "images_per_s": batch / ms * 1e3, "peak_mib": 100.0, "transient_mib": 10.0 if variant == "autograd" else 2.5}


def test_tables_compute_ratios_and_targets_from_the_csvs(tmp_path, readme_tables):
    _write(tmp_path / "kernels_cuda.csv", [
        _kernel_row("sub_layer_norm", "eager", 0.4, 2000), _kernel_row("sub_layer_norm", "compile", 0.3, 3000),
        _kernel_row("sub_layer_norm", "triton", 0.2, 3600), _kernel_row("layer_norm_bwd_add", "eager", 0.6, 1000),
        _kernel_row("layer_norm_bwd_add", "compile", 0.4, 1500), _kernel_row("layer_norm_bwd_add", "triton", 0.5, 2000)])
    _write(tmp_path / "train_cuda.csv", [
        _train_row("throughput", "vit_b", 32, "standard", 20.0), _train_row("throughput", "vit_b", 32, "standard_graphs", 15.0),
        _train_row("throughput", "vit_b", 32, "revkernels_graphs", 10.0),
        _train_row("revnet", "revnet18_cifar", 256, "autograd", 12.0),
        _train_row("revnet", "revnet18_cifar", 256, "graphs", 16.0)])
    text = readme_tables.tables(str(tmp_path))
    assert "commit `abc1234`, Test GPU" in text
    assert "| `sub_layer_norm` |" in text and "90% (triton; >= 85%: met) | 2.00x | 1.50x |" in text
    assert "50% (triton; >= 70%: missed) | 1.20x | 0.80x |" in text
    assert "| vit_b | 32 | 20.0 | 15.0 | 10.0 | 2.00x | 1.50x | n/a | n/a |" in text
    assert "0.75x (graphs) | 4.00x less (graphs) |" in text


def test_rewrite_replaces_only_the_marked_section(tmp_path, readme_tables):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{readme_tables.BEGIN}\nold\n{readme_tables.END}\noutro\n")
    readme_tables.rewrite(str(readme), "new table\n")
    assert readme.read_text() == f"intro\n{readme_tables.BEGIN}\nnew table\n{readme_tables.END}\noutro\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no results markers"):
        readme_tables.rewrite(str(readme), "x")
