"""`python -m revkernels.bench`: the benchmark suite runs the chosen parts, writes each part's CSV and
PNG under --out, and ends with a summary of headline ratios computed from the parts' rows."""
import csv
import importlib
import pathlib
import subprocess
import sys

import pytest
import torch

from revkernels.bench import __main__ as suite
from tests.benchmarks import load_script

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_suite_quick_kernels_and_memory(tmp_path):
    # --memory-depths 8: the deepest quick depth alone, its two peak-memory children instead of four
    # (each a fresh interpreter importing torch: most of this test's time)
    result = subprocess.run([sys.executable, "-m", "revkernels.bench", "--quick", "--device", "cpu", "--parts", "kernels",
                             "memory", "--memory-depths", "8", "--out", str(tmp_path)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert out.index("=== memory") < out.index("=== kernels") < out.index("=== summary")  # the suite's order
    assert "=== train" not in out and "=== petra" not in out
    summary = out[out.index("=== summary"):]
    assert "memory   depth 8: saved for backward autograd/sequential" in summary
    assert "kernels  best fused (cpp) speed vs eager at 256x768" in summary and "coupling_sub" in summary
    assert "revkernels.bench" in result.stderr  # the outer progress bar
    for name, column in (("train_step_cpu.csv", "engine"), ("kernels_cpu.csv", "impl")):
        rows = list(csv.DictReader(open(tmp_path / name)))
        assert rows and all(r["commit"] and r["device"] and r["torch"] for r in rows)
        assert (tmp_path / name.replace(".csv", ".png")).stat().st_size > 0
    memory = {r["engine"]: r for r in csv.DictReader(open(tmp_path / "train_step_cpu.csv"))}
    assert set(memory) == {"autograd", "sequential"} and {r["depth"] for r in memory.values()} == {"8"}
    # the quick configuration shows the point in the step's peak, not only in the saved bytes (activations
    # outweigh the parameters' grads there: width 64, 2048 rows; ~3x measured)
    assert (memory["autograd"]["width"], memory["autograd"]["rows"]) == ("64", "2048")
    assert float(memory["autograd"]["peak_mib"]) >= 2 * float(memory["sequential"]["peak_mib"]), memory


def test_suite_rejects_an_unknown_part(capsys):
    with pytest.raises(SystemExit) as exit:
        suite.main(["--parts", "kernels", "speed"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert "argument --parts: invalid choice: 'speed'" in err and "memory" in err


PARSERS = {"suite": lambda argv: suite._parse(argv), "attention": load_script("bench_attention").parse_args}
for _part in ("kernels", "memory", "overhead", "petra", "train"):
    PARSERS[_part] = importlib.import_module(f"revkernels.bench.{_part}").parse_args


BAD_DEVICE_OR_OUT = [(["--device", "foo"], "--device 'foo': not a device"),
                     (["--device", "cuda"], "--device cuda: CUDA is not available"),
                     (["--device", "meta"], "--device meta: the benchmarks run on cpu or cuda"),  # (timed no compute)
                     (["--out", "FILE"], "exists and is not a folder")]


@pytest.mark.parametrize("part, argv, message", [
    (part, argv, message) for part in PARSERS for argv, message in BAD_DEVICE_OR_OUT
    if not (part == "attention" and argv[0] == "--device")])  # (the attention part has no --device: CPU only)
def test_every_part_refuses_a_bad_device_or_out_before_measuring(part, argv, message, tmp_path, capsys):
    # (a traceback from torch.device, an assert of torch's CUDA, or a FileExistsError after the measuring)
    if argv[0] == "--device" and argv[1] == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    (tmp_path / "FILE").write_text("a file")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        PARSERS[part](argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("part, argv, message", [
    ("train", ["--variants", "bogus"], "--variants: unknown bogus"),
    ("train", ["--revnets", "foo"], "--revnets: 'foo' is not name:stem:batch"),
    ("train", ["--revnets", "revnet99:cifar:2"], "--revnets: 'revnet99:cifar:2'"),
    ("train", ["--revnets", "revnet18:cifar:0"], "--revnets: 'revnet18:cifar:0'"),
    ("train", ["--batches", "0"], "--batches must be at least 1"),
    ("petra", ["--nproc", "0"], "--nproc must be at least 1"),
    ("petra", ["--batch", "0"], "--batch must be at least 1"),
    ("petra", ["--accum", "0"], "--accum must be at least 1"),
    ("petra", ["--groups", "3", "3", "3"], "--groups must be 2 positive sizes"),
    ("suite", ["--memory-depths", "4", "0"], "--memory-depths must be positive"),
])
def test_parts_name_the_argument_they_refuse(part, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        PARSERS[part](argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_suite_passes_each_part_its_mode():
    def args(*argv):
        return suite._parse(list(argv))

    assert suite.part_argv("memory", args("--device", "cpu", "--out", "o")) == ["--out", "o", "--device", "cpu"]
    depths = suite.part_argv("memory", args("--device", "cpu", "--quick", "--memory-depths", "4", "8"))
    assert depths[-4:] == ["--depths", "4", "8", "--quick"] and PARSERS["memory"](depths).depths == [4, 8]
    assert "--depths" not in suite.part_argv("train", args("--device", "cpu", "--memory-depths", "4"))
    assert suite.part_argv("train", args("--device", "cpu"))[-1] == "--quick"  # CPU: train and petra quick
    assert "--device" not in suite.part_argv("petra", args("--device", "cpu"))  # petra is CPU-only
    assert suite.part_argv("kernels", args("--device", "cpu", "--quick"))[-1] == "--quick"
    cuda = args("--device", "cpu")
    cuda.device = "cuda"
    train = suite.part_argv("train", cuda, elapsed_s=150)
    assert "--quick" not in train and train[train.index("--budget-s") + 1] == str(suite.CUDA_BUDGET_S - 150)
    assert suite.part_argv("kernels", cuda) == ["--out", cuda.out, "--device", "cuda"]  # full CUDA defaults
    for part in suite.PARTS:  # every part accepts what the suite gives it
        module = __import__(f"revkernels.bench.{part}", fromlist=["parse_args"])
        module.parse_args(suite.part_argv(part, args("--device", "cpu", "--quick")))


def test_suite_summary_from_rows():
    nan = float("nan")
    results = {
        "memory": [{"engine": e, "depth": d, "step_ms": 10.0 * d * (1.2 if e == "sequential" else 1), "saved_mib": s,
                    "peak_mib": p} for d, e, s, p in ((2, "autograd", 20.0, 30.0), (2, "sequential", 1.0, 20.0),
                                                      (8, "autograd", 80.0, 100.0), (8, "sequential", 1.0, 25.0))],
        "kernels": [{"op": "bias_gelu", "rows": r, "width": 4, "impl": i, "ms": ms} for r in (8, 16)
                    for i, ms in (("eager", 2.0), ("compile", 1.5), ("triton", 1.0), ("cuda", 0.8))],
        "train": [{"kind": "throughput", "model": "vit_b", "batch": 32, "variant": v, "ms": ms, "peak_mib": nan,
                   "transient_mib": nan}
                  for v, ms in (("standard", 16.0), ("reversible_plain", 40.0), ("revkernels_sequential", 50.0),
                                ("revkernels_graphs", 20.0))]
        + [{"kind": "revnet", "model": "revnet18_cifar", "batch": 256, "variant": v, "ms": ms, "peak_mib": 1.0,
            "transient_mib": t} for v, ms, t in (("autograd", 10.0, 800.0), ("graphs", 12.5, 200.0))]
        + [{"kind": "depth_sweep", "model": "sweep", "depth": 48, "batch": 32, "variant": v, "ms": 1.0, "peak_mib": p,
            "transient_mib": p} for v, p in (("standard", 9000.0), ("revkernels_sequential", 3000.0))],
        "petra": [{"variant": "petra_distributed", "processes": 2, "quick": False, "speedup_vs_revbackprop_best": 1.7,
                   "speedup_vs_revbackprop_same_cores": 1.9}],
        "extra": RuntimeError("boom"),
    }
    text = "\n".join(suite.summary(results))
    assert "depth 8: saved for backward autograd/sequential 80.00x, step peak autograd/sequential 4.00x, " \
           "step time sequential/autograd 1.20x" in text
    assert "best fused (triton/cuda) speed vs eager at 16x4:" in text and "bias_gelu 2.50x (vs compile 1.88x)" in text
    assert "vit_b batch 32: revkernels_graphs (fastest engine) speed vs standard 0.80x, vs reversible_plain 2.00x" in text
    assert "revnet18_cifar batch 256: graphs engine speed vs autograd 0.80x, transient memory autograd/graphs 4.00x" in text
    assert "depth 48: step peak memory standard/revkernels_sequential 3.00x" in text
    assert "1.70x over the fastest, 1.90x over the same cores\n" in text and "target" not in text
    assert "extra    FAILED: RuntimeError: boom" in text
    # A --quick PETRA run says that its shapes are a smoke test's.
    quick = dict(results["petra"][0], quick=True, speedup_vs_revbackprop_same_cores=0.7)
    assert "0.70x over the same cores (--quick: a smoke test, shapes too small for the processes' messages to pay " \
        "off)" in "\n".join(suite.summary({"petra": [quick]}))


@pytest.mark.parametrize("rows", [[], [{"kind": "throughput", "model": "m", "batch": 1, "variant": "standard",
                                        "ms": float("nan")}]])
def test_suite_summary_survives_missing_measurements(rows):
    assert suite.summary({"train": rows}) in (["train    no rows"], ["train    no complete measurement"])


def test_train_budget_stops_after_the_first_configuration(tmp_path, capsys):
    """--budget-s (what the suite gives train on CUDA): the first configuration always runs, later
    ones start only within the budget, and what was skipped is printed."""
    from revkernels.bench import train

    rows = train.run(train.parse_args(["--device", "cpu", "--quick", "--revnets", "--depth-sweep", "1",
                                       "--variants", "standard", "--budget-s", "0", "--out", str(tmp_path)]))
    assert {(r["kind"], r["depth"]) for r in rows} == {("depth_sweep", 1)}
    assert "time budget of 0 s spent; not measured: 2, tiny 2" in capsys.readouterr().out


def test_write_csv_writes_a_field_of_both_the_rows_and_the_meta_once(tmp_path):
    # (petra --project's rows carried "batch" and so did its meta: two "batch" columns)
    from revkernels.bench.report import write_csv

    path = write_csv(str(tmp_path / "out.csv"), [{"batch": 4, "ms": 1.5}], {"batch": 4, "commit": "abc"})
    header = open(path).readline().strip().split(",")
    assert header == ["batch", "ms", "commit"]
    assert list(csv.DictReader(open(path))) == [{"batch": "4", "ms": "1.5", "commit": "abc"}]
