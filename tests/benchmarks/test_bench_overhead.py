"""revkernels.bench.overhead: the minREV-style baseline is correct, every engine gets its rows, the
op table compares each fused op with the ATen composition computing the same values, and the CSVs
carry their columns and provenance. Tiny repetition counts; no timing is asserted."""
import csv
import json
import math
import os
import platform
import statistics
import subprocess
import sys

import pytest
import torch

import revkernels as rk
from revkernels.bench import __main__ as suite
from revkernels.bench import overhead

SMALL = dict(depth=3, dim=32, heads=2, tokens=5, batch=2, threads=1)
PROVENANCE = ("commit", "device", "torch", "triton", "revkernels", "c_extension", "date")


def _reference_grads(model, x):
    """Plain autograd through the same reversible math, written out: y1 = x1 + F(x2), y2 = x2 + G(y1)."""
    x1 = x2 = x
    for block in model.blocks:
        x1 = x1 + block.f(x2)
        x2 = x2 + block.g(x1)
    overhead.loss_of((x1 + x2) * 0.5).backward()


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_plain_stack_grads_equal_plain_autograd(depth):
    cfg = {**SMALL, "depth": depth}
    cpu = torch.device("cpu")
    plain = overhead.make_model("reversible_plain", cfg, cpu)
    reference = overhead.make_model("reversible_plain", cfg, cpu)
    engine = overhead.make_model("revkernels_generic_autograd", cfg, cpu)
    xs = [overhead.make_input(cfg, cpu).requires_grad_() for _ in range(3)]
    overhead.train_step(plain, xs[0], cpu)
    _reference_grads(reference, xs[1])
    overhead.train_step(engine, xs[2], cpu)
    for other, x in ((reference, xs[1]), (engine, xs[2])):
        pairs = list(zip(plain.parameters(), other.parameters(), strict=True)) + [(xs[0], x)]
        for p, q in pairs:
            assert torch.equal(p.detach(), q.detach())  # same seed, same weights
            assert q.grad is not None and q.grad.abs().max() > 0
            assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max()


def test_plain_stack_recomputes_under_the_forwards_autocast():
    """bf16 autocast (CPU here; CUDA in the benchmark): the rebuild recomputes F and G in bf16 as the
    forward did, so the grads match autograd's closely (~1e-7; a recompute in fp32 gives ~6e-3)."""
    cpu = torch.device("cpu")
    grads = []
    for variant in ("reversible_plain", "revkernels_generic_autograd"):
        model = overhead.make_model(variant, SMALL, cpu)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(overhead.make_input(SMALL, cpu))
        overhead.loss_of(y).backward()
        grads.append([p.grad for p in model.parameters()])
    for p, q in zip(*grads, strict=True):
        assert (p - q).abs().max() <= 1e-5 * q.abs().max()


def test_plain_stack_saves_only_the_outputs():
    cfg, cpu = SMALL, torch.device("cpu")
    model, x = overhead.make_model("reversible_plain", cfg, cpu), overhead.make_input(cfg, cpu)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        model(x)
    shape = (cfg["batch"], cfg["tokens"], cfg["dim"])
    assert saved == [shape, shape]


def test_check_plain_grads_passes_and_all_variants_share_weights():
    assert overhead.check_plain_grads(SMALL, torch.device("cpu")) <= 1e-5
    models = [overhead.make_model(v, SMALL, torch.device("cpu")) for v in overhead.variants()]
    first = list(models[0].parameters())
    for model in models[1:]:
        assert all(torch.equal(p, q) for p, q in zip(first, model.parameters(), strict=True))


def test_exact_variants_are_their_float_variants_with_fixed_point_streams():
    cpu = torch.device("cpu")
    for variant, plain in (("revkernels_exact_sequential", "revkernels_sequential"),
                           ("revkernels_generic_exact_sequential", "revkernels_generic_sequential")):
        assert overhead.float_streams_variant(variant) == plain and overhead.engine_of(variant) == "sequential"
        exact, floating = overhead.make_model(variant, SMALL, cpu), overhead.make_model(plain, SMALL, cpu)
        assert exact.seq.exact and not floating.seq.exact
        assert [type(b) for b in exact.seq.blocks] == [type(b) for b in floating.seq.blocks]
    assert overhead.float_streams_variant("revkernels_sequential") is None


def test_variants_follow_the_engine_registry(monkeypatch):
    monkeypatch.setitem(rk.engine.ENGINES, "compiled", rk.engine.run_sequential)
    names = overhead.variants()
    for engine in rk.engine.ENGINES:
        assert f"revkernels_{engine}" in names and f"revkernels_generic_{engine}" in names
    assert overhead.compiles("revkernels_compiled") and overhead.compiles("revkernels_generic_compiled")
    assert not overhead.compiles("revkernels_graphs") and not overhead.compiles("standard")
    assert overhead.compiles("standard_compile")


def test_standard_compile_is_left_to_full_runs_unless_named():
    select = lambda *argv: overhead.selected_variants(overhead.parse_args(list(argv)))  # noqa: E731
    assert select() == overhead.variants() and "standard_compile" in select()
    assert select("--quick") == [v for v in overhead.variants() if v != "standard_compile"]
    assert select("--quick", "--variants", "standard_compile", "standard") == ["standard", "standard_compile"]


def test_compile_time_is_left_to_full_runs_unless_named():
    select = lambda *argv: overhead.selected_compile_variants(overhead.parse_args(list(argv)))  # noqa: E731
    assert select() == list(overhead.COMPILE_VARIANTS) and select("--quick") == []
    assert select("--quick", "--compile-variants", "standard_compile") == ["standard_compile"]
    assert select("--compile-variants") == []
    with pytest.raises(SystemExit):
        overhead.parse_args(["--compile-variants", "revkernels_sequential"])


def test_compile_time_runs_in_a_child_with_an_empty_inductor_cache(monkeypatch):
    seen = {}

    def child(command, env, **kwargs):
        seen["cache"] = env["TORCHINDUCTOR_CACHE_DIR"]
        seen["empty"] = os.path.isdir(seen["cache"]) and not os.listdir(seen["cache"])
        seen["command"] = command
        out = '{"dtype": "float32", "compile_s": 3.25, "first_step_ms": 3300.0, "step_ms": 50.0}'
        return subprocess.CompletedProcess(command, 0, stdout="inductor chatter\n" + out + "\n", stderr="")

    monkeypatch.setattr(overhead.subprocess, "run", child)
    row = overhead.measure_compile("standard_compile", torch.device("cpu"))
    assert seen["empty"] and not os.path.exists(seen["cache"])  # a fresh folder, removed afterwards
    assert seen["command"][-2:] == ["--compile-child", "standard_compile"]
    assert row["compile_s"] == 3.25 and row["dim"] == 384 and row["depth"] == 12 and row["cache"] == "empty"

    monkeypatch.setattr(overhead.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(
        command, 1, stdout="", stderr="Traceback ...\nRuntimeError: no compiler"))
    assert math.isnan(overhead.measure_compile("standard_compile", torch.device("cpu"))["compile_s"])


def test_compile_child_prints_its_times_as_json(monkeypatch, capsys):
    monkeypatch.setitem(rk.engine.ENGINES, "compiled", rk.engine.run_sequential)  # no compile in this test
    monkeypatch.setattr(overhead, "COMPILE_CONFIG", {**SMALL, "threads": 1})
    overhead.main(["--device", "cpu", "--compile-child", "revkernels_compiled"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(row) == {"dtype", "compile_s", "first_step_ms", "step_ms"}
    assert row["first_step_ms"] > 0 and row["step_ms"] > 0


def test_measure_config_reports_compile_time_and_failures(monkeypatch):
    monkeypatch.setitem(rk.engine.ENGINES, "compiled", rk.engine.run_sequential)
    build = overhead.build

    def failing_build(variant, *args):
        if variant == "revkernels_generic_compiled":
            raise RuntimeError("boom")
        return build(variant, *args)

    monkeypatch.setattr(overhead, "build", failing_build)
    names = ["standard", "checkpoint", "reversible_plain", "revkernels_compiled", "revkernels_generic_compiled"]
    threads = torch.get_num_threads()
    rows = overhead.measure_config("small", {**SMALL, "threads": threads + 1}, names, torch.device("cpu"), warmup=1,
                                   rounds=2)
    assert torch.get_num_threads() == threads  # restored
    assert {r["threads"] for r in rows} == {threads + 1}
    by = {r["variant"]: r for r in rows}
    assert list(by) == names
    assert isinstance(by["revkernels_compiled"]["compile_s"], float) and by["standard"]["compile_s"] == ""
    assert math.isnan(by["revkernels_generic_compiled"]["step_ms"])  # failed: nan, the others measured
    for name in names[:-1]:
        assert by[name]["steps"] == 2 and math.isfinite(by[name]["step_ms"]) and by[name]["step_ms"] > 0
    assert by["standard"]["vs_standard"] == 1.0 and by["reversible_plain"]["vs_reversible_plain"] == 1.0


def test_measure_config_times_each_step_after_an_untimed_one_of_its_variant(monkeypatch):
    """Warm-up per variant, then rounds of (untimed step, timed step) per variant in turn."""
    order = []

    def make_model(variant, cfg, device, seed=0):
        model = torch.nn.Linear(2, 2)
        model.variant = variant
        return model

    monkeypatch.setattr(overhead, "make_model", make_model)
    monkeypatch.setattr(overhead, "train_step", lambda model, x, device: order.append(model.variant))
    rows = overhead.measure_config("small", SMALL, ["standard", "checkpoint"], torch.device("cpu"), warmup=2, rounds=3)
    assert order == ["standard"] * 2 + ["checkpoint"] * 2 + ["standard", "standard", "checkpoint", "checkpoint"] * 3
    assert [r["steps"] for r in rows] == [3, 3]


@pytest.mark.parametrize("op", overhead.OPS)
def test_op_table_compares_like_with_like(op):
    """The fused op, its Python entry point and the ATen composition give the same values (and, for
    differentiable ops, the same grads of the summed outputs)."""
    cpu = torch.device("cpu")
    fused, aten, wrapper, inputs = overhead._op_cases(op, overhead.TINY, torch.float32, cpu)
    for a, b, c in zip(fused(), aten(), wrapper(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c, a)
    if ("tiny_grad" in {p[1] for p in overhead.op_points([op])}) != bool(inputs):
        pytest.fail("tiny_grad rows exactly for the ops with differentiable inputs")
    if inputs:
        for t in inputs:
            t.requires_grad_()
        for a, b in zip(overhead._with_grad(fused, inputs)(), overhead._with_grad(aten, inputs)(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_per_call_us_takes_the_samples_in_turn(monkeypatch):
    """Warm-up calls, then one sample of each function per round (an untimed call, then `inner`
    timed calls); each median is of that function's own samples."""
    calls, clock = [], [0.0]
    costs = {"a": 1e-6, "b": 3e-6}  # seconds per call, read by the fake clock

    def fn(name):
        def call():
            calls.append(name)
            clock[0] += costs[name]
        return call

    monkeypatch.setattr(overhead.time, "perf_counter", lambda: clock[0])
    got = overhead.per_call_us([fn("a"), fn("b")], torch.device("cpu"), reps=3, inner=2, warmup=1)
    assert calls == ["a", "b"] + ["a", "a", "a", "b", "b", "b"] * 3
    assert got == pytest.approx([1.0, 3.0])


def test_keep_freed_memory_applies_on_glibc():
    # In a child: the setting lasts for the process.
    code = "from revkernels.bench.overhead import keep_freed_memory; print(keep_freed_memory())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert out.strip() == str(glibc)


def test_run_writes_both_csvs_and_the_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(overhead, "keep_freed_memory", lambda: False)  # keeps this process's malloc as it is
    # the compile-time child is tested below; here its row reaches the CSV
    monkeypatch.setattr(overhead, "measure_compile", lambda variant, device: {
        "config": "vit_s", **overhead.COMPILE_CONFIG, "variant": variant, "cache": "empty", "dtype": "float32",
        "compile_s": 12.5, "first_step_ms": 12600.0, "step_ms": 100.0})
    args = overhead.parse_args(["--device", "cpu", "--configs", "host_bound", "--quick", "--warmup", "1", "--rounds", "1",
                                "--op-reps", "1", "--ops", "coupling_sub", "batch_norm_act_bwd", "--out", str(tmp_path),
                                "--compile-variants", "revkernels_compiled"])
    rows = overhead.run(args)
    steps = list(csv.DictReader(open(tmp_path / "overhead_cpu.csv")))
    assert list(steps[0])[:30] == [
        "config", "depth", "dim", "heads", "tokens", "batch", "threads", "dtype", "variant", "engine", "step_ms",
        "first_step_ms", "compile_s", "steps", "warmup", "vs_standard", "vs_reversible_plain", "vs_checkpoint",
        "vs_standard_compile", "vs_standard_q1", "vs_standard_q3", "vs_reversible_plain_q1", "vs_reversible_plain_q3",
        "vs_checkpoint_q1", "vs_checkpoint_q3", "vs_standard_compile_q1", "vs_standard_compile_q3",
        "vs_float_streams", "commit", "device"]
    exact = {r["variant"]: r for r in steps if r["vs_float_streams"]}
    assert set(exact) == {"revkernels_exact_sequential", "revkernels_generic_exact_sequential"}
    assert all(r["engine"] == "sequential" and math.isfinite(float(r["vs_float_streams"])) for r in exact.values())
    assert [r["variant"] for r in steps] == [v for v in overhead.variants() if v != "standard_compile"]  # --quick
    for engine in rk.engine.ENGINES:
        assert {f"revkernels_{engine}", f"revkernels_generic_{engine}"} <= {r["variant"] for r in steps}
    assert all(math.isfinite(float(r["step_ms"])) for r in steps), "a variant failed"
    assert {(r["depth"], r["dim"], r["heads"], r["tokens"], r["batch"], r["threads"]) for r in steps} == {
        ("12", "64", "4", "8", "2", "1")}
    ops = list(csv.DictReader(open(tmp_path / "overhead_ops_cpu.csv")))
    assert list(ops[0])[:9] == ["op", "case", "dtype", "size", "fused_us", "aten_us", "ratio", "wrapper_us", "threads"]
    assert [(r["op"], r["case"], r["dtype"], r["size"]) for r in ops] == [
        ("coupling_sub", "tiny", "float32", "8x64"), ("coupling_sub", "tiny_grad", "float32", "8x64"),
        ("coupling_sub", "throughput", "float32", "4096x768"), ("coupling_sub", "throughput", "bfloat16", "4096x768"),
        ("batch_norm_act_bwd", "tiny", "float32", "2x64x2x2"),
        ("batch_norm_act_bwd", "throughput", "float32", "16x768x16x16"),
        ("batch_norm_act_bwd", "throughput", "bfloat16", "16x768x16x16")]
    compile_rows = list(csv.DictReader(open(tmp_path / "overhead_compile_cpu.csv")))
    assert [(r["variant"], r["dim"], r["compile_s"]) for r in compile_rows] == [("revkernels_compiled", "384", "12.5")]
    for r in steps + ops + compile_rows:
        assert all(r[k] for k in PROVENANCE)
    assert (tmp_path / "overhead_cpu.png").stat().st_size > 0
    assert len(rows) == len(steps) + len(ops) + len(compile_rows)
    lines = overhead.summary(rows)
    assert any(line.startswith("host_bound: revkernels_sequential") for line in lines)
    assert "ViT-S compile time (empty inductor cache): revkernels_compiled 12.5 s" in lines


def test_ratio_quartiles_come_from_the_rounds(monkeypatch):
    """vs_<base>_q1/_q3: quartiles of the per-round ratios base ms / variant ms (the rounds' own
    pairs, not ratios of sorted times); nan for a baseline that was not measured."""
    clock = {"standard": iter([10.0, 20.0, 10.0, 40.0]),  # standard's timed steps, round by round
             "checkpoint": iter([5.0, 20.0, 2.0, 10.0])}  # checkpoint's: per-round ratios 2, 1, 5, 4
    calls = {"standard": 0, "checkpoint": 0}
    now = [0.0]

    def make_model(variant, cfg, device, seed=0):
        model = torch.nn.Linear(2, 2)
        model.variant = variant
        return model

    def train_step(model, x, device):
        # one warm-up step, then per round an untimed and a timed step of each variant
        calls[model.variant] += 1
        timed = calls[model.variant] > 1 and calls[model.variant] % 2 == 1
        now[0] += next(clock[model.variant]) / 1e3 if timed else 1.0

    monkeypatch.setattr(overhead, "make_model", make_model)
    monkeypatch.setattr(overhead, "train_step", train_step)
    monkeypatch.setattr(overhead.time, "perf_counter", lambda: now[0])
    rows = overhead.measure_config("small", SMALL, ["standard", "checkpoint"], torch.device("cpu"), warmup=1, rounds=4)
    by = {r["variant"]: r for r in rows}
    ck = by["checkpoint"]
    q1, _, q3 = statistics.quantiles([2.0, 1.0, 5.0, 4.0], n=4, method="inclusive")
    assert (ck["vs_standard_q1"], ck["vs_standard_q3"]) == (round(q1, 4), round(q3, 4))
    medians = statistics.median([10.0, 20.0, 10.0, 40.0]), statistics.median([5.0, 20.0, 2.0, 10.0])
    assert ck["vs_standard"] == round(medians[0] / medians[1], 4)
    assert by["standard"]["vs_standard_q1"] == by["standard"]["vs_standard_q3"] == 1.0
    assert math.isnan(ck["vs_reversible_plain_q1"]) and math.isnan(ck["vs_reversible_plain_q3"])


def test_step_table_prints_an_unmeasured_baseline_as_n_a_in_its_column(capsys):
    # (a --quick run has no standard_compile: its column printed "n/ax", unpadded, on every row)
    nan = float("nan")
    row = {"config": "host_bound", "depth": 12, "dim": 64, "heads": 4, "tokens": 8, "batch": 2, "threads": 1,
           "dtype": "float32", "steps": 3, "variant": "standard", "step_ms": 5.0, "first_step_ms": 7.0,
           "compile_s": "", "vs_standard": 1.0, "vs_reversible_plain": 1.5, "vs_checkpoint": 2.0,
           "vs_standard_compile": nan}
    overhead._print_steps([row])
    header, line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "n/ax" not in line and line.endswith(" n/a") and "1.50x" in line
    assert len(line) == len(header)  # right-aligned under "vs std compiled", as the measured ratios are


def test_summary_from_rows():
    def step(variant, ms):
        return {"config": "host_bound", "variant": variant, "step_ms": ms, "vs_standard": 6.0 / ms,
                "vs_reversible_plain": 10.0 / ms}

    rows = [step("standard", 6.0), step("reversible_plain", 10.0), step("revkernels_sequential", 15.0),
            step("revkernels_generic_sequential", 20.0),
            {"op": "coupling_sub", "case": "tiny", "ratio": 0.5}, {"op": "bias_gelu", "case": "tiny", "ratio": 2.0},
            {"op": "bias_gelu", "case": "throughput", "ratio": 9.0}]
    text = "\n".join(suite.summary({"overhead": rows}))
    assert "overhead host_bound: revkernels_sequential 15.00 ms (speed vs reversible_plain 0.67x, vs standard " \
           "0.40x); revkernels_generic_sequential 20.00 ms (speed vs reversible_plain 0.50x, vs standard 0.30x)" in text
    assert "aten/fused per call: geometric mean 1.00x, coupling_sub 0.50x, bias_gelu 2.00x" in text


def test_suite_includes_overhead_on_cpu_only_by_default():
    assert "overhead" in suite.default_parts("cpu") and "overhead" not in suite.default_parts("cuda")
    args = suite._parse(["--device", "cpu", "--quick"])
    assert suite.part_argv("overhead", args) == ["--out", args.out, "--device", "cpu", "--quick"]


def test_parse_args_rejects_unknown_names():
    with pytest.raises(SystemExit):
        overhead.parse_args(["--variants", "revkernels_nope"])
    with pytest.raises(SystemExit):
        overhead.parse_args(["--ops", "nope"])
    with pytest.raises(SystemExit):
        overhead.parse_args(["--rounds", "0"])
