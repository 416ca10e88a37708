"""The compiled step's host-time layers (benchmarks/profile_step_layers.py): each layer computes what
the step computes, and a CPU run writes its CSV."""
import csv

import pytest
import torch

from revkernels.bench import overhead as ov
from tests.benchmarks import load_script

sl = load_script("profile_step_layers")

TINY = dict(depth=3, dim=16, heads=2, tokens=4, batch=2, threads=1)


@pytest.fixture(scope="module")
def recorded():
    torch.manual_seed(0)
    device = torch.device("cpu")
    model, x = ov.make_model("revkernels_compiled", TINY, device), ov.make_input(TINY, device)
    for _ in range(2):
        ov.train_step(model, x, device)
    return sl.record_step_calls(model, x, device)


def _flat(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def test_the_recorded_calls_are_the_steps_of_every_block(recorded):
    assert [(name, position) for name, position, *_ in recorded] == \
        [("block_forward", i) for i in range(3)] + [("block_backward", i) for i in reversed(range(3))]


def test_every_layer_computes_what_the_step_computes(recorded, monkeypatch):
    """The layers nest: inductor's callable and the CompiledFxGraph around it return the same graph
    outputs; the entry's code, with or without the guard check, returns what the engine's call
    does, and each of these runs the recorded graph once (no recompile, no eager run); so do the
    two layers under the skip_guard_eval_unsafe stance."""
    from torch._inductor.output_code import CompiledFxGraph

    ran = []
    graph_call = CompiledFxGraph.__call__
    monkeypatch.setattr(CompiledFxGraph, "__call__", lambda self, inputs: ran.append(self) or graph_call(self, inputs))
    for name, position, step, args, graph, inputs in recorded:
        calls = sl.layer_calls(step, args, graph, inputs)
        outputs = {}
        for layer, call in calls.items():
            ran.clear()
            with torch.no_grad(), sl.layer_stance(layer):
                unsafe = torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe
                assert unsafe == (layer in sl.UNSAFE_STANCE_LAYERS), (layer, unsafe)
                outputs[layer] = _flat(call())
            assert ran == ([] if layer == "inductor" else [graph]), (name, position, layer)
        assert set(calls) == set(sl.LAYERS + sl.UNSAFE_STANCE_LAYERS)
        for a, b in (("inductor", "compiled_graph"), ("run_step", "entry_code"), ("run_step", "guards"),
                     ("run_step", "diff_guards"), ("run_step", "run_step_unsafe_stance")):
            assert len(outputs[a]) == len(outputs[b]) > 0, (name, position, a, b)
            for i, (u, v) in enumerate(zip(outputs[a], outputs[b])):
                assert torch.equal(u, v), (name, position, a, b, i)


def test_cli_writes_the_layer_times(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(ov.CONFIGS, "tiny", TINY)
    assert sl.main(["--config", "tiny", "--rounds", "2", "--batch", "2", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "step_layers_tiny_cpu.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], r["block"]) for r in rows] == [("block_forward", "0"), ("block_forward", "2"),
                                                       ("block_backward", "0"), ("block_backward", "2")]
    for row in rows:
        assert all(float(row[f"{layer}_us"]) > 0 for layer in sl.LAYERS + sl.UNSAFE_STANCE_LAYERS), row
        assert row["commit"] and row["torch"] == torch.__version__ and row["variant"] == "revkernels_compiled"
    assert "block_backward blocks[2]: run_step" in capsys.readouterr().out


def test_cli_rejects_a_variant_that_does_not_compile(tmp_path):
    with pytest.raises(SystemExit):
        sl.main(["--variant", "revkernels_sequential", "--out", str(tmp_path)])
