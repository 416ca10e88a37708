"""The benchmark scripts run end to end (CPU smoke runs of the same code the GPU check runs).

The suite's parts are `revkernels.bench.kernels` / `.train` / `.petra` / `.overhead`;
`benchmarks/bench_{kernels,train,petra,overhead}.py` are thin entry points over them (same flags,
results under benchmarks/results by default). Diagnostics and experiments are scripts of
`benchmarks/` only, which reach the package through its installed import path."""
import csv
import importlib
import importlib.util
import math
import pathlib
import runpy
import subprocess
import sys
import types
import warnings

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script,csv_name,kinds", [
    ("bench_kernels.py", "kernels_cpu.csv", {"eager", "cpp"}),
    ("bench_train.py", "train_cpu.csv", {"standard", "standard_compile", "checkpoint", "reversible_plain",
                                         "revkernels_sequential", "revkernels_pareprop", "revkernels_graphs",
                                         "revkernels_compiled", "peer_revlib", "peer_memcnn", "autograd", "graphs"}),
])
def test_script_writes_its_csv_and_plot(tmp_path, script, csv_name, kinds):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--device", "cpu", "--quick",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / csv_name)))
    column = "impl" if "kernels" in csv_name else "variant"
    assert {r[column] for r in rows} >= kinds
    assert all(r["commit"] and r["device"] and r["torch"] for r in rows)
    assert all(math.isfinite(float(r["ms"])) for r in rows), "a variant failed"
    assert (tmp_path / csv_name.replace(".csv", ".png")).stat().st_size > 0
    if script == "bench_train.py":
        # compile time beside the step time: first step - median step, for the variants that compile only
        for r in rows:
            first, ms = float(r["first_step_ms"]), float(r["ms"])
            assert first > 0
            if r["variant"] in ("standard_compile", "revkernels_compiled"):
                assert math.isclose(float(r["compile_s"]), (first - ms) / 1e3, rel_tol=1e-2, abs_tol=1e-3)
                assert float(r["compile_s"]) > 0.1, r  # a compile takes seconds
            else:
                assert r["compile_s"] == ""
        assert "revkernels_compiled speed vs standard eager and vs standard_compile" in result.stdout
    else:
        # bench_kernels reports the GPU time (ms, the primary figure) and the per-call time (call_ms)
        # with the method used (timing); on CPU both are the same perf_counter median.
        assert {"ms", "call_ms", "timing", "gb_per_s", "call_gb_per_s", "pct_of_copy", "copy_gb_per_s"} <= set(rows[0])
        assert all(r["timing"] == "perf_counter" and r["ms"] == r["call_ms"] for r in rows)
        assert all((r["gb_per_s"] == "") == (r["op"] == "linear_sub") for r in rows)
        assert "of copy" in result.stdout and "target" not in result.stdout  # against baselines only


def _bench_kernels_module():
    import revkernels.bench.kernels

    return revkernels.bench.kernels


@pytest.mark.parametrize("part", ["kernels", "train", "petra", "overhead"])
def test_script_is_a_thin_entry_point(part, monkeypatch, capsys):
    """benchmarks/bench_<part>.py takes the flags of `python -m revkernels.bench.<part>` (it runs the
    package's main), with benchmarks/results as the default --out. Both run in this process, as
    `python <script>` and `python -m` run them (runpy), to spare two interpreter starts per part."""
    def options(run):
        monkeypatch.setattr(sys, "argv", ["prog", "--help"])
        with pytest.raises(SystemExit) as exit, warnings.catch_warnings():
            # runpy notes that the module was imported before it ran as __main__; harmless here.
            warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
            run()
        assert exit.value.code == 0
        out = capsys.readouterr().out
        return out, sorted(set(w.strip("[],") for w in out.split() if w.startswith(("--", "[--"))))

    script = ROOT / "benchmarks" / f"bench_{part}.py"
    script_help, script_options = options(lambda: runpy.run_path(str(script), run_name="__main__"))
    module_help, module_options = options(
        lambda: runpy.run_module(f"revkernels.bench.{part}", run_name="__main__", alter_sys=True))
    assert script_options == module_options and "--out" in script_options
    assert "benchmarks/results" in script_help.replace("\n", "").replace(" ", "")
    assert "revkernels-bench" in module_help
    source = script.read_text()
    assert f"from revkernels.bench.{part} import main" in source and len(source.splitlines()) < 25


def test_attention_script_writes_its_csv_and_plot(tmp_path):
    """bench_attention: a row per point with both timings, their ratio and the kind revkernels takes
    (math up to MATH_MAX_KEYS keys, flash beyond)."""
    from revkernels.nn.attention import MATH_MAX_KEYS

    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), "--reps", "1",
                             "--tokens", str(MATH_MAX_KEYS + 1), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "attention_cpu.csv")))
    assert [int(r["tokens"]) for r in rows] == [8, MATH_MAX_KEYS + 1]
    assert [r["revkernels_takes"] for r in rows] == ["math", "flash"]
    for r in rows:
        assert float(r["flash_us"]) > 0 and float(r["math_us"]) > 0 and r["commit"] and r["torch"]
        assert math.isclose(float(r["flash_over_math"]), float(r["flash_us"]) / float(r["math_us"]), rel_tol=1e-2)
    assert (tmp_path / "attention_cpu.png").stat().st_size > 0
    assert "revkernels takes" in result.stdout


def test_kernels_cuda_timing_and_fallback(monkeypatch):
    """The CUDA timing path without a GPU: do_bench gives call_ms, do_bench_cudagraph ms; a capture
    failure falls back to the per-call time with timing "events"."""
    import triton.testing

    bench = _bench_kernels_module()
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, return_mode: calls.append("events") or 0.2)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph",
                        lambda fn, rep, return_mode: calls.append("graph") or 0.05)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    cuda = types.SimpleNamespace(type="cuda")
    assert bench._time(lambda: None, cuda, 10) == (0.05, 0.2, "cudagraph")
    assert calls == ["events", "graph"]

    def not_capturable(fn, rep, return_mode):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", not_capturable)
    assert bench._time(lambda: None, cuda, 10) == (0.2, 0.2, "events")


def test_kernels_cpu_timing_spends_the_budget_after_a_warm_up(monkeypatch):
    """On CPU `reps` is a time budget in ms, as do_bench's on CUDA, after a 25 ms warm-up, with at
    least 5 timed calls. A fake clock that each call advances by `step` seconds."""
    bench = _bench_kernels_module()
    clock, calls = [0.0], []
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def call(step):
        def fn():
            calls.append(clock[0])
            clock[0] += step
        return fn

    cpu = torch.device("cpu")
    assert bench._call_ms(call(0.002), cpu, 100) == pytest.approx(2.0)
    assert 13 + 49 <= len(calls) <= 13 + 51  # 13 warm-up calls to pass 25 ms, then ~100 ms of 2 ms calls
    calls.clear()
    assert bench._call_ms(call(0.06), cpu, 100) == pytest.approx(60.0)
    assert len(calls) == 1 + bench.CPU_MIN_CALLS  # one warm-up call, then the minimum past the budget


def test_kernels_cuda_summary(capsys):
    """The CUDA summary (both tables and the copy-bandwidth shares) from synthetic rows."""
    bench = _bench_kernels_module()
    rows = []
    for op, nbytes in (("coupling_sub", 3e9), ("layer_norm_bwd_add", 4e9), ("linear_sub", None)):
        for impl, ms, timing in (("eager", 2.0, "cudagraph"), ("compile", 1.5, "events"), ("triton", 1.0, "cudagraph"),
                                 ("cuda", 1.2, "cudagraph")):
            rows.append({"op": op, "rows": 8, "width": 4, "impl": impl, "ms": ms, "call_ms": ms + 0.1,
                         "timing": timing, "gb_per_s": nbytes / (ms * 1e-3) / 1e9 if nbytes else "",
                         "tflop_per_s": 1.0 if not nbytes else ""})
    bench._print_summary(rows, [(8, 4)], ["eager", "compile", "triton", "cuda"], ["triton", "cuda"], True, 3500.0,
                         True)
    out = capsys.readouterr().out
    assert "CUDA-graph replay" in out and "per-call time" in out and "2.00x / 1.50x" in out
    assert "1.5000 ms*" in out  # the compile row that could not be captured
    assert "coupling_sub         3000 GB/s = 85.7% of copy (triton)\n" in out
    assert "layer_norm_bwd_add   4000 GB/s = 114.3% of copy (triton)\n" in out
    assert "linear_sub           1.0 TFLOP/s (triton; a GEMM: compute-bound)" in out and "target" not in out


def test_config_sweep_needs_a_gpu_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("with a GPU the sweep runs for minutes; it is run by hand")
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep_triton_configs.py")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no CUDA device" in result.stderr


HELP_ENTRY_POINTS = [f"revkernels.bench.{part}" for part in
                     ("memory", "kernels", "train", "petra", "overhead", "__main__")] + [
    f"benchmarks/{script}.py" for script in
    ("bench_drift", "bench_text", "profile_train", "readme_tables", "bench_petra_accuracy", "bench_attention",
     "profile_overhead", "profile_engine_floor", "profile_step_layers", "bench_compiler_stance", "overhead_targets")]


def _entry_point(name):
    if name.endswith(".py"):  # a script of benchmarks/, loaded by path (its main is guarded)
        spec = importlib.util.spec_from_file_location(f"script_{pathlib.Path(name).stem}", ROOT / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(name)


@pytest.mark.parametrize("name", HELP_ENTRY_POINTS)
def test_help_description_is_the_docstrings_first_paragraph(name, monkeypatch, capsys):
    """Each bench part's and script's --help opens with its module docstring's whole first paragraph,
    which ends with a full sentence (not its first line, cut mid-sentence)."""
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal width (and splits at hyphens)
    module = _entry_point(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split("\n\n")[1].split())  # usage, blank line, description
    paragraph = " ".join(module.__doc__.strip().split("\n\n")[0].split())
    assert shown == paragraph
    assert shown.endswith("."), shown


def test_the_package_ships_the_suite_and_the_scripts_use_the_installed_package():
    """revkernels.bench holds the suite's parts and what they share, no diagnostics; no script of
    benchmarks/ puts the checkout on sys.path (the package is installed, editable in a checkout)."""
    shipped = {path.stem for path in (ROOT / "revkernels" / "bench").glob("*.py")}
    assert shipped == {"__init__", "__main__", "helptext", "report", "memory", "train_step", "kernels", "train",
                       "overhead", "petra"}
    for script in (ROOT / "benchmarks").glob("*.py"):
        assert "sys.path" not in script.read_text(), script.name


def test_every_mutation_pattern_occurs_once_in_the_library():
    # scripts/mutation_check.py stops before mutating anything when a pattern went stale with an
    # edit of the library: the table is kept in step here, where it costs no mutant run
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module._check_patterns(str(ROOT), module.M)
