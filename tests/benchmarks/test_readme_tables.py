"""benchmarks/readme_tables.py: the results tables of the README, the docs and benchmarks/results/README.md,
generated from the benchmark CSVs; the committed documents hold what the committed CSVs give."""
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


def test_tables_compute_ratios_from_the_csvs(tmp_path, readme_tables):
    _write(tmp_path / "kernels_cuda.csv", [
        _kernel_row("sub_layer_norm", "eager", 0.4, 2000), _kernel_row("sub_layer_norm", "compile", 0.3, 3000),
        _kernel_row("sub_layer_norm", "triton", 0.2, 3600), _kernel_row("layer_norm_bwd_add", "eager", 0.6, 1000),
        _kernel_row("layer_norm_bwd_add", "compile", 0.4, 1500), _kernel_row("layer_norm_bwd_add", "triton", 0.5, 2000)])
    _write(tmp_path / "train_cuda.csv", [
        _train_row("throughput", "vit_b", 32, "standard", 20.0), _train_row("throughput", "vit_b", 32, "standard_graphs", 15.0),
        _train_row("throughput", "vit_b", 32, "revkernels_graphs", 10.0),
        _train_row("revnet", "revnet18_cifar", 256, "autograd", 12.0),
        _train_row("revnet", "revnet18_cifar", 256, "graphs", 16.0)])
    text = readme_tables.table("kernels-cuda", str(tmp_path)) + readme_tables.table("train-cuda", str(tmp_path))
    assert "commit `abc1234`, Test GPU" in text
    assert "| `sub_layer_norm` |" in text and "| 90% (triton) | 2.00x | 1.50x |" in text
    assert "| 50% (triton) | 1.20x | 0.80x |" in text
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
    text = readme_tables.table("train-cuda", str(tmp_path))
    assert ("- vit_b batch 32: `revkernels_compiled` 0.80x standard eager, 0.64x standard compiled; compile time "
            "(first step - median step): revkernels_compiled 12.5 s, standard_compile 30.0 s") in text
    assert "vit_b batch 128:" not in text  # no compiled row measured there
    _write(tmp_path / "train_cuda.csv", [_train_row("throughput", "vit_b", 32, "standard", 20.0)])
    assert "Compiled steps" not in readme_tables.table("train-cuda", str(tmp_path))


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
    assert readme_tables.table("overhead-cpu", str(tmp_path)) == "No results committed for `overhead-cpu` yet.\n"
    _write(tmp_path / "overhead_cpu.csv", _overhead_rows("host_bound", 1) + _overhead_rows("compute_bound", 2))
    _write(tmp_path / "overhead_ops_cpu.csv", [
        _op_row("coupling_sub", "tiny", "float32", 6.0, 1.5, 7.0), _op_row("coupling_sub", "tiny_grad", "float32", 240.0, 30.0),
        _op_row("coupling_sub", "throughput", "float32", 1500.0, 3000.0),
        _op_row("layer_norm_bwd_add", "tiny", "float32", 8.0, 16.0, 11.0),
        _op_row("layer_norm_bwd_add", "throughput", "float32", 7000.0, 14000.0)])
    text = readme_tables.table("overhead-cpu", str(tmp_path))
    assert "commit `abc1234`, Test GPU" in text and "No results" not in text
    assert "target" not in text  # results against baselines, not the project's targets
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


def _overhead_rows_with_compile():
    rows = _overhead_rows("host_bound", 1)
    rows.insert(1, dict(rows[0], variant="standard_compile", step_ms=4.0, compile_s=30.0))
    return rows


def _gpu_train_rows():
    return [_train_row("throughput", "vit_b", 32, "standard", 20.0),
            _train_row("throughput", "vit_b", 32, "revkernels_graphs", 16.0),
            _train_row("throughput", "vit_b", 128, "standard", 80.0),
            _train_row("revnet", "revnet18_cifar", 256, "autograd", 12.0)]


@pytest.mark.parametrize("table,csv_name,rows,present,absent", [
    ("overhead-cpu", "overhead_cpu.csv", _overhead_rows_with_compile, [  # a standard compiled column when measured
        "| variant | host_bound ms | vs standard | vs reversible_plain | vs checkpoint | vs standard compiled |",
        "| `revkernels_compiled` | 5.00 (compile 12.5 s) | 1.20x | 2.00x | 3.20x | 0.80x |",
        "| `standard_compile` | 4.00 (compile 30.0 s) | 1.50x | 2.50x | 4.00x | 1.00x |"], []),
    ("gpu-train", "train_cuda.csv", _gpu_train_rows, [  # one row per variant, the transformer models only
        "| variant | vit_b batch 32: ms | speed | peak MiB | vit_b batch 128: ms | speed | peak MiB |",
        "| `standard` | 20.0 | 1.00x | 100 | 80.0 | 1.00x | 100 |",
        "| `revkernels_graphs` | 16.0 | 1.25x | 100 |  |  |  |"], ["revnet18"]),
], ids=["overhead_standard_compiled_column", "gpu_train_one_row_per_variant"])
def test_table_has_the_rows(tmp_path, readme_tables, table, csv_name, rows, present, absent):
    _write(tmp_path / csv_name, rows())
    text = readme_tables.table(table, str(tmp_path))
    for line in present:
        assert line in text
    for part in absent:
        assert part not in text


def test_overhead_section_has_the_compile_time_table(tmp_path, readme_tables):
    row = {"config": "vit_s", "depth": 12, "dim": 384, "heads": 6, "tokens": 65, "batch": 2, "threads": 2,
           "variant": "revkernels_compiled", "cache": "empty", "dtype": "float32", "compile_s": 14.83,
           "first_step_ms": 14964.2, "step_ms": 155.24}
    _write(tmp_path / "overhead_compile_cpu.csv", [row, dict(row, variant="standard_compile", compile_s=61.0)])
    text = readme_tables.table("overhead-cpu", str(tmp_path))
    assert "Compile time of a 12-block ViT-S (dim 384, 6 heads, 65 tokens, batch 2, 2 threads, float32)" in text
    assert "| `revkernels_compiled` | 14.8 | 14964 | 155.2 |" in text
    assert "| `standard_compile` | 61.0 | 14964 | 155.2 |" in text


def _document(readme_tables, *names):
    return "".join(f"text {name}\n{readme_tables.BEGIN.format(name)}\nold\n{readme_tables.END}\n" for name in names)


def test_render_rewrites_each_marked_section_and_nothing_else(tmp_path, readme_tables):
    _write(tmp_path / "overhead_cpu.csv", _overhead_rows("host_bound", 1))
    content = "intro\n" + _document(readme_tables, "overhead-cpu", "memory") + "outro\n"
    text = readme_tables.render(content, str(tmp_path))
    begin, end = readme_tables.BEGIN.format("overhead-cpu"), readme_tables.END
    assert text.startswith(f"intro\ntext overhead-cpu\n{begin}\nTrain step (forward + backward)") and text.endswith("outro\n")
    assert "| `standard` | 6.00 | 1.00x | 1.67x | 2.67x |" in text and "old" not in text
    assert f"{readme_tables.BEGIN.format('memory')}\nNo results committed for `memory` yet.\n{end}\n" in text
    assert readme_tables.render(text, str(tmp_path)) == text
    with pytest.raises(SystemExit, match="doc.md: unknown generated table 'nonesuch'"):
        readme_tables.render(_document(readme_tables, "nonesuch"), str(tmp_path), "doc.md")


def test_main_rewrites_the_documents_and_check_reports_stale_ones(tmp_path, readme_tables, capsys):
    results, root = tmp_path / "results", tmp_path / "root"
    results.mkdir()
    (root / "docs").mkdir(parents=True)
    _write(results / "overhead_cpu.csv", _overhead_rows("host_bound", 1))
    for name in ("README.md", "docs/page.md"):
        (root / name).write_text(_document(readme_tables, "overhead-cpu"))
    (root / "docs" / "plain.md").write_text("no tables\n")
    args = ["--results", str(results), "--root", str(root)]
    assert readme_tables.main(args + ["--check"]) == 1
    assert "README.md, docs/page.md" in capsys.readouterr().err
    assert readme_tables.main(args) == 0
    assert "| `standard` | 6.00 | 1.00x | 1.67x | 2.67x |" in (root / "docs" / "page.md").read_text()
    assert (root / "docs" / "plain.md").read_text() == "no tables\n"
    assert readme_tables.main(args + ["--check"]) == 0
    assert readme_tables.main(args + ["--print", "overhead-cpu"]) == 0
    assert "| `standard` | 6.00 |" in capsys.readouterr().out


def test_main_refuses_a_results_folder_that_does_not_exist(tmp_path, readme_tables, capsys):
    # (its missing CSVs read as "no results committed": every table was replaced, exit status 0)
    (tmp_path / "README.md").write_text(_document(readme_tables, "memory"))
    before = (tmp_path / "README.md").read_text()
    with pytest.raises(SystemExit) as exit_info:
        readme_tables.main(["--results", str(tmp_path / "missing"), "--root", str(tmp_path)])
    assert exit_info.value.code == 2 and "--results" in capsys.readouterr().err
    assert (tmp_path / "README.md").read_text() == before


def test_memory_table_has_the_ratios_against_autograd(tmp_path, readme_tables):
    rows = [{"engine": engine, "depth": depth, "width": 256, "rows": 1024, "dtype": "float32", "step_ms": ms,
             "saved_mib": saved, "peak_mib": peak, "cpu_kernels": "AVX2"}
            for engine, depth, ms, saved, peak in (("autograd", 4, 100.0, 80.0, 100.0), ("sequential", 4, 125.0, 2.0, 50.0))]
    _write(tmp_path / "train_step_cpu.csv", rows)
    text = readme_tables.table("memory", str(tmp_path))
    assert "1024 rows x width 256, float32 (commit `abc1234`, Test GPU, torch 2.x, triton 3.x, 2026-11-30" in text
    assert "| 4 | `sequential` | 125 | 2.0 | 50 | 1.25x | 40.00x | 2.00x |" in text
    assert "| 4 | `autograd` | 100 | 80.0 | 100 | 1.00x | 1.00x | 1.00x |" in text


def test_budget_table_lists_the_eager_then_the_compiled_rows_with_their_plans(tmp_path, readme_tables):
    row = {"group": "eager", "budget": "", "plan": "", "planned_mib": "", "config": "dim 192, depth 6"}
    _write(tmp_path / "budget_cpu.csv", [
        dict(row, method="revkernels budget=0.5", budget=0.5, plan="RRSSKK", saved_mib=34.3375, step_ms=132.77),
        dict(row, method="standard", saved_mib=73.29, step_ms=112.3),
        dict(row, group="compiled", method="standard compiled budget=0.5", saved_mib=20.0, step_ms=99.0)])
    text = readme_tables.table("budget", str(tmp_path))
    assert "stack (dim 192, depth 6)" in text and "| method | plan | saved, MiB | step ms |" in text
    assert "| revkernels budget=0.5 | RRSSKK | 34.34 | 132.8 |" in text and "| standard |  | 73.29 | 112.3 |" in text
    eager, compiled = text.split("| under torch.compile")
    assert "compiled" not in eager and "| standard compiled budget=0.5 |  | 20.00 | 99.0 |" in compiled


def test_drift_text_and_attention_tables(tmp_path, readme_tables):
    drift = {"dim": 64, "heads": 4, "tokens": 17, "batch": 4, "seeds": 5, "local_max": 0.0, "streams": "float"}
    _write(tmp_path / "drift_cpu.csv", [dict(drift, mode="fp32", depth=1, chained_max=6.7e-8, chained_median=6.3e-8),
                                        dict(drift, mode="bf16_streams", depth=64, chained_max=0.05, chained_median=0.046),
                                        dict(drift, mode="fp32", streams="exact", depth=1, chained_max=0.0,
                                             chained_median=0.0)])
    text = readme_tables.table("drift", str(tmp_path))
    assert "| precision | streams | depth 1 | depth 64 |" in text
    assert "| fp32 | float | 6.7e-08 (6.3e-08) |  |" in text
    assert "| bf16 streams and weights | float |  | 5.0e-02 (4.6e-02) |" in text
    assert "| fp32 | exact (int64) | 0.0e+00 (0.0e+00) |  |" in text
    lm = {"depth": 2, "dim": 64, "heads": 4, "tokens": 64, "batch": 8, "steps": 30, "dropout": 0.1, "tokens_per_s": 29317.0,
          "saved_mib": 1.137, "val_loss": 3.20971}
    _write(tmp_path / "text_cpu.csv", [dict(lm, model="sequential", max_abs_loss_diff_vs_autograd=4.77e-7),
                                       dict(lm, model="standard", max_abs_loss_diff_vs_autograd="")])
    text = readme_tables.table("text", str(tmp_path))
    assert "| 2 | reversible, `sequential` | 29317 | 1.14 | 3.2097 | 4.8e-07 |" in text
    assert "| 2 | non-reversible, same layers | 29317 | 1.14 | 3.2097 |  |" in text
    _write(tmp_path / "attention_cpu.csv", [{"batch": 2, "heads": 4, "tokens": 8, "head_dim": 16, "dtype": "float32",
                                             "threads": 2, "flash_us": 46.26, "math_us": 39.76, "flash_over_math": 1.1635,
                                             "revkernels_takes": "math"}])
    assert "| 8 | 2 | 46 | 40 | 1.16x | math |" in readme_tables.table("attention", str(tmp_path))


def test_petra_tables(tmp_path, readme_tables):
    run = {"model": "revnet18", "stem": "cifar", "image_size": 16, "batch": 32, "balance": "time", "steps": 20}
    _write(tmp_path / "petra_cpu.csv", [
        dict(run, variant="revbackprop_1thread", processes=1, threads=1, groups="", step_ms=400.0,
             speedup_vs_revbackprop_1thread=1.0, speedup_vs_revbackprop_best=0.5, bound=""),
        dict(run, variant="petra_distributed", processes=2, threads=1, groups="0-5 6-9", step_ms=250.0,
             speedup_vs_revbackprop_1thread=1.6, speedup_vs_revbackprop_best=0.8, bound=1.727)])
    text = readme_tables.table("petra", str(tmp_path))
    assert "| `revbackprop_1thread` | 1 x 1 | all | 400.0 | 1.00x | 0.50x |  |" in text
    assert "| `petra_distributed` | 2 x 1 | 0-5 6-9 | 250.0 | 1.60x | 0.80x | 1.73x |" in text
    digits = {"model": "revnet18", "stem": "cifar", "dataset": "digits", "image_size": 8, "epochs": 6, "batch_size": 32,
              "accum": 4, "base_lr": 0.01}
    _write(tmp_path / "petra_digits_cpu.csv", [dict(digits, method=m, seed=s, test_acc=a, mean_cosine=c) for m, s, a, c in (
        ("backprop", 0, 0.99, 1.0), ("backprop", 1, 0.97, 1.0), ("petra", 0, 0.98, 0.8), ("petra", 1, 0.98, 0.9))])
    text = readme_tables.table("petra-accuracy", str(tmp_path))
    assert "2 seeds" in text and "| `backprop` | 98.00 +- 1.41 | 1.000 |" in text and "| `petra` | 98.00 +- 0.00 | 0.850 |" in text


def test_provenance_table_names_each_csv_and_what_wrote_it(tmp_path, readme_tables):
    _write(tmp_path / "train_step_cpu.csv", [{"engine": "autograd"}])
    (tmp_path / "train_step_cpu.png").write_bytes(b"png")
    _write(tmp_path / "overhead_ops_cpu.csv", [{"op": "coupling_sub"}])
    text = readme_tables.table("provenance", str(tmp_path))
    assert ("| `train_step_cpu.csv` (plot: `.png` beside it) | the memory part: `python -m revkernels.bench --parts "
            "memory` | `abc1234` | Test GPU | 2.x | 3.x | n/a | 2026-11-30 |") in text
    assert "| `overhead_ops_cpu.csv` | the overhead part: `python -m revkernels.bench --parts overhead` |" in text


def test_the_committed_documents_hold_the_tables_of_the_committed_csvs(readme_tables, capsys):
    """README.md, docs/*.md and benchmarks/results/README.md: every generated section is what the
    CSVs under benchmarks/results give (after a new result: python benchmarks/readme_tables.py)."""
    documents = [os.path.relpath(path, readme_tables.ROOT) for path in readme_tables.documents()]
    assert {"README.md", "docs/benchmarks.md", "benchmarks/results/README.md"} <= set(documents)
    assert readme_tables.main(["--check"]) == 0, capsys.readouterr().err
    for name in ("memory", "gpu-train"):
        assert readme_tables.BEGIN.format(name) in open(os.path.join(readme_tables.ROOT, "README.md")).read()
