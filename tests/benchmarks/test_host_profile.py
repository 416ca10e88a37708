"""The host-time profile of the overhead benchmark's steps (benchmarks/profile_overhead.py):
event categories, the breakdown's arithmetic, and a CPU run of the report."""
import csv
import types

import pytest
import torch

from revkernels.bench import overhead as ov
from tests.benchmarks import load_script

hp = load_script("profile_overhead")


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@pytest.mark.parametrize("name,expected", [
    ("aten::mm", "gemm_attention"),
    ("aten::addmm", "gemm_attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", "gemm_attention"),
    ("## Call CompiledFxGraph fa6insrvcs4sjeblilhveibkphok", "compiled_graphs"),
    ("TorchDynamo Cache Lookup", "dynamo_entry"),
    ("Torch-Compiled Region: 1/0", "dynamo_entry"),
    ("AOTDispatcher Runtime Wrapper Prologue", "dynamo_entry"),
    ("revkernels step guards", "dynamo_entry"),
    ("autograd::engine::evaluate_function: AddmmBackward0", "autograd_engine"),
    ("torch::autograd::AccumulateGrad", "autograd_engine"),
    ("AddmmBackward0", "autograd_engine"),
    ("ReversibleRun", "python_functions"),
    ("ReversibleRunBackward", "python_functions"),
    ("_ProbeBackward", "python_functions"),
    ("revkernels::coupling_sub", "revkernels_ops"),
    ("aten::add_", "other_aten"),
    ("aten::linear", "other_aten"),
    ("some_record_function", "other"),
])
def test_category(name, expected):
    assert hp.category(name, hp.python_function_names()) == expected


def test_breakdown_adds_up_to_the_wall_time():
    events = [types.SimpleNamespace(key=k, self_cpu_time_total=us) for k, us in
              [("aten::mm", 3000.0), ("aten::mm", 1000.0), ("aten::add_", 500.0), ("AddmmBackward0", 250.0),
               ("revkernels::coupling_add", 125.0)]]
    got = hp.breakdown(events, wall_us=10_000.0, steps=2, function_names=set())
    assert set(got) == set(hp.CATEGORIES)
    assert got["gemm_attention"] == pytest.approx(2.0)
    assert got["other_aten"] == pytest.approx(0.25)
    assert got["autograd_engine"] == pytest.approx(0.125)
    assert got["revkernels_ops"] == pytest.approx(0.0625)
    assert got["python_untraced"] == pytest.approx((10_000 - 4875) / 2 / 1e3)
    assert sum(got.values()) == pytest.approx(5.0)
    # profiled events can add up to more than the measured wall time: nothing untraced then
    assert hp.breakdown(events, wall_us=4000.0, steps=1, function_names=set())["python_untraced"] == 0.0


def test_profile_variant_on_the_host_bound_steps():
    cfg = dict(ov.CONFIGS["host_bound"], depth=2)
    device = torch.device("cpu")
    step_ms, standard, _ = hp.profile_variant("standard", cfg, device, steps=2, warmup=1)
    assert standard["gemm_attention"] > 0 and standard["python_functions"] == 0
    assert sum(standard.values()) >= step_ms * (1 - 1e-9)  # the wall time, or more when events overlap it
    _, sequential, events = hp.profile_variant("revkernels_sequential", cfg, device, steps=2, warmup=1)
    assert sequential["python_functions"] > 0  # the engine's Function (its backward walker)
    assert sequential["revkernels_ops"] > 0
    assert any(e.key == "ReversibleRunBackward" for e in events)


def test_main_writes_the_report(tmp_path, capsys):
    assert hp.main(["--config", "host_bound", "--variants", "standard", "reversible_plain", "--steps", "1",
                    "--rows", "5", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "profile_host_bound_cpu.txt").read_text()
    assert "provenance: commit" in text and "cpu_kernels" in text
    table = [line.split() for line in text.splitlines() if line.startswith(("standard ", "reversible_plain "))]
    assert [row[0] for row in table] == ["standard", "reversible_plain"]
    assert all(len(row) == len(hp.CATEGORIES) + 2 for row in table)
    assert "== reversible_plain: top events" in text
    assert "wrote" in capsys.readouterr().out
    rows = list(csv.DictReader(open(tmp_path / "profile_host_bound_cpu.csv")))
    assert [r["variant"] for r in rows] == ["standard", "reversible_plain"]
    for row in rows:
        assert row["commit"] and row["device"] and row["torch"] and row["cpu_kernels"]
        categories = sum(float(row[f"{c}_ms"]) for c in hp.CATEGORIES)
        assert categories >= float(row["step_ms_profiled"]) * (1 - 1e-3)


def test_main_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        hp.main(["--steps", "0"])
    with pytest.raises(SystemExit):
        hp.main(["--variants", "no_such_variant"])
