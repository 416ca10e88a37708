"""benchmarks/readme_tables.py: README tables generated from benchmark CSVs."""
import csv
import importlib.util
import os

import pytest

from revkernels.bench import host_profile

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


def test_train_table_has_the_compiled_line_when_measured(tmp_path, readme_tables):
    """revkernels_compiled against standard eager and standard_compile, with both compile times."""
    rows = [_train_row("throughput", "vit_b", 32, "standard", 20.0),
            {**_train_row("throughput", "vit_b", 32, "standard_compile", 16.0), "compile_s": 30.0},
            {**_train_row("throughput", "vit_b", 32, "revkernels_compiled", 25.0), "compile_s": 12.5},
            _train_row("throughput", "vit_b", 128, "standard", 80.0)]
    rows = [{"first_step_ms": 1.0, "compile_s": "", **r} for r in rows]
    _write(tmp_path / "train_cuda.csv", rows)
    text = readme_tables.tables(str(tmp_path))
    assert ("- vit_b batch 32: `revkernels_compiled` 0.80x standard eager, 0.64x standard compiled; compile time "
            "(first step - median step): revkernels_compiled 12.5 s, standard_compile 30.0 s") in text
    assert "vit_b batch 128:" not in text  # no compiled row measured there
    _write(tmp_path / "train_cuda.csv", [_train_row("throughput", "vit_b", 32, "standard", 20.0)])
    assert "Compiled steps" not in readme_tables.tables(str(tmp_path))


def test_rewrite_replaces_only_the_marked_section(tmp_path, readme_tables):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{readme_tables.BEGIN}\nold\n{readme_tables.END}\noutro\n")
    readme_tables.rewrite(str(readme), "new table\n")
    assert readme.read_text() == f"intro\n{readme_tables.BEGIN}\nnew table\n{readme_tables.END}\noutro\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="no results markers"):
        readme_tables.rewrite(str(readme), "x")


def _overhead_rows(config, threads):
    rows = []
    for variant, ms, compile_s in (("standard", 6.0, ""), ("checkpoint", 16.0, ""), ("reversible_plain", 10.0, ""),
                                   ("revkernels_sequential", 15.0, ""), ("revkernels_compiled", 5.0, 12.5)):
        rows.append({"config": config, "depth": 12, "dim": 64, "heads": 4, "tokens": 8, "batch": 2, "threads": threads,
                     "dtype": "float32", "variant": variant, "engine": "", "step_ms": ms, "first_step_ms": 9.0,
                     "compile_s": compile_s, "steps": 30, "warmup": 3, "vs_standard": 0.0,
                     "vs_reversible_plain": 0.0, "vs_checkpoint": 0.0})
    return rows


def _op_row(op, case, dtype, fused, aten, wrapper=""):
    size = "4096x768" if case == "throughput" else "8x64"
    return {"op": op, "case": case, "dtype": dtype, "size": size, "fused_us": fused, "aten_us": aten,
            "ratio": aten / fused, "wrapper_us": wrapper, "threads": 1}


def test_overhead_tables_from_the_csvs(tmp_path, readme_tables):
    assert "No results committed yet" in readme_tables.overhead_section(str(tmp_path))
    _write(tmp_path / "overhead_cpu.csv", _overhead_rows("host_bound", 1) + _overhead_rows("compute_bound", 2))
    _write(tmp_path / "overhead_ops_cpu.csv", [
        _op_row("coupling_sub", "tiny", "float32", 6.0, 1.5, 7.0), _op_row("coupling_sub", "tiny_grad", "float32", 240.0, 30.0),
        _op_row("coupling_sub", "throughput", "float32", 1500.0, 3000.0),
        _op_row("layer_norm_bwd_add", "tiny", "float32", 8.0, 16.0, 11.0),
        _op_row("layer_norm_bwd_add", "throughput", "float32", 7000.0, 14000.0)])
    text = readme_tables.overhead_section(str(tmp_path))
    assert "commit `abc1234`, Test GPU" in text and "No results" not in text
    assert "- `host_bound`: depth 12, dim 64, 4 heads, 8 tokens, batch 2, 1 thread; median of 30 steps" in text
    assert "- `compute_bound`: depth 12, dim 64, 4 heads, 8 tokens, batch 2, 2 threads; median of 30 steps" in text
    assert "| variant | host_bound ms | vs standard | vs reversible_plain | vs checkpoint | compute_bound ms |" in text
    # ratios computed here from step_ms (the CSV's vs_* columns are ignored), against the same config
    assert "| `revkernels_sequential` | 15.00 | 0.40x | 0.67x | 1.07x | 15.00 | 0.40x | 0.67x | 1.07x |" in text
    assert "| `revkernels_compiled` | 5.00 (compile 12.5 s) | 1.20x | 2.00x | 3.20x |" in text
    assert "| op | 8x64 float32, no grad | 8x64 float32, fwd + bwd of the sum | 4096x768 float32, one call | " \
           "Python entry, no grad |" in text
    assert "| `coupling_sub` | 6 / 1.5 us (0.25x) | 240 / 30 us (0.12x) | 1.5 / 3 ms (2.00x) | 7 us |" in text
    assert "| `layer_norm_bwd_add` | 8 / 16 us (2.00x) | n/a | 7 / 14 ms (2.00x) | 11 us |" in text


def test_overhead_section_has_the_cpu_target_table(tmp_path, readme_tables):
    """The issues' CPU step targets from the CPU CSV: ratio of the medians, the quartiles of the
    per-round ratios where the CSV has them (n/a where not), target and status; none for CUDA."""
    rows = _overhead_rows("host_bound", 1)
    for r in rows:
        sequential = r["variant"] == "revkernels_sequential"
        r["vs_reversible_plain_q1"], r["vs_reversible_plain_q3"] = (0.62, 0.71) if sequential else ("", "")
    _write(tmp_path / "overhead_cpu.csv", rows)
    text = readme_tables.overhead_section(str(tmp_path))
    assert "| configuration | variant | against | speed | q1-q3 | target | |" in text
    assert "| host_bound | `revkernels_sequential` | reversible_plain | 0.667x | 0.62-0.71 | >= 1.2 | missed |" in text
    assert "| host_bound | `revkernels_sequential` | standard | 0.400x | n/a | >= 0.65 | missed |" in text
    assert "| host_bound | `revkernels_compiled` | standard | 1.200x | n/a | >= 1.0 | met |" in text
    assert "| host_bound | `revkernels_compiled` | reversible_plain | 2.000x | n/a | >= 2.0 | met |" in text
    os.rename(tmp_path / "overhead_cpu.csv", tmp_path / "overhead_cuda.csv")
    assert "| configuration | variant |" not in readme_tables.overhead_section(str(tmp_path))


def test_overhead_table_has_a_standard_compiled_column_when_measured(tmp_path, readme_tables):
    rows = _overhead_rows("host_bound", 1)
    rows.insert(1, dict(rows[0], variant="standard_compile", step_ms=4.0, compile_s=30.0))
    _write(tmp_path / "overhead_cpu.csv", rows)
    text = readme_tables.overhead_section(str(tmp_path))
    assert "| variant | host_bound ms | vs standard | vs reversible_plain | vs checkpoint | vs standard compiled |" in text
    assert "| `revkernels_compiled` | 5.00 (compile 12.5 s) | 1.20x | 2.00x | 3.20x | 0.80x |" in text
    assert "| `standard_compile` | 4.00 (compile 30.0 s) | 1.50x | 2.50x | 4.00x | 1.00x |" in text


def test_overhead_section_has_the_compile_time_table(tmp_path, readme_tables):
    row = {"config": "vit_s", "depth": 12, "dim": 384, "heads": 6, "tokens": 65, "batch": 2, "threads": 2,
           "variant": "revkernels_compiled", "cache": "empty", "dtype": "float32", "compile_s": 14.83,
           "first_step_ms": 14964.2, "step_ms": 155.24}
    _write(tmp_path / "overhead_compile_cpu.csv", [row, dict(row, variant="standard_compile", compile_s=61.0)])
    text = readme_tables.overhead_section(str(tmp_path))
    assert "Compile time of a 12-block ViT-S (dim 384, 6 heads, 65 tokens, batch 2, 2 threads, float32)" in text
    assert "| `revkernels_compiled` | 14.8 | 14964 | 155.2 |" in text
    assert "| `standard_compile` | 61.0 | 14964 | 155.2 |" in text


def test_main_rewrites_both_marked_sections(tmp_path, readme_tables):
    readme = tmp_path / "README.md"
    o_begin, o_end = readme_tables.OVERHEAD_BEGIN, readme_tables.OVERHEAD_END
    readme.write_text(f"a\n{readme_tables.BEGIN}\nold\n{readme_tables.END}\nb\n{o_begin}\nold\n{o_end}\nc\n")
    _write(tmp_path / "overhead_cpu.csv", _overhead_rows("host_bound", 1))
    assert readme_tables.main(["--results", str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(f"a\n{readme_tables.BEGIN}\n") and text.endswith(f"{o_end}\nc\n")
    assert "| `standard` | 6.00 | 1.00x | 1.67x | 2.67x |" in text.split(o_begin)[1]
    assert "old" not in text


def test_main_refuses_a_results_folder_that_does_not_exist(tmp_path, readme_tables, capsys):
    # (its missing CSVs read as "no results committed": every table was replaced, exit status 0)
    readme = tmp_path / "README.md"
    before = f"{readme_tables.BEGIN}\nkept\n{readme_tables.END}\n"
    readme.write_text(before)
    with pytest.raises(SystemExit) as exit_info:
        readme_tables.main(["--results", str(tmp_path / "missing"), "--readme", str(readme)])
    assert exit_info.value.code == 2 and "--results" in capsys.readouterr().err
    assert readme.read_text() == before


def test_overhead_section_has_the_host_profile_tables(tmp_path, readme_tables):
    categories = [key for key, _ in readme_tables.PROFILE_COLUMNS]
    row = {"config": "host_bound", "variant": "standard", "steps": 20, "step_ms_profiled": 6.5,
           **{f"{key}_ms": 0.25 * (i + 1) for i, key in enumerate(categories)}}
    _write(tmp_path / "profile_host_bound_cpu.csv", [row, dict(row, variant="revkernels_compiled", gemm_attention_ms=0.0)])
    text = readme_tables.overhead_section(str(tmp_path))
    assert "Where a `host_bound` step's host time goes (profiled, 20 steps per variant" in text
    assert "commit `abc1234`, Test GPU" in text
    assert ("| variant | GEMM + attention | compiled graphs | Dynamo entry | autograd engine | Python Functions | "
            "fused ops | other ATen | other | Python, untraced | step (profiled) |") in text
    assert "| `standard` | 0.25 | 0.50 | 0.75 | 1.00 | 1.25 | 1.50 | 1.75 | 2.00 | 2.25 | 6.50 |" in text
    assert "| `revkernels_compiled` | 0.00 | 0.50 |" in text
    assert "compute_bound" not in text  # no CSV for it
    assert tuple(categories) == host_profile.CATEGORIES  # the profile CSV's columns, in its order
