"""benchmarks/bench_compiler_stance.py: the compiled engine's train steps after the first under the
skip_guard_eval_unsafe stance, timed in the overhead benchmark's loop (no timing is asserted)."""
import csv
import math

import pytest
import torch

from revkernels.bench import overhead
from tests.benchmarks import load_script

stance = load_script("bench_compiler_stance")
SMALL = dict(depth=3, dim=32, heads=2, tokens=5, batch=2, threads=1)


def _unsafe():
    return torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_unsafe_stance_variant_runs_its_later_steps_under_the_stance():
    """revkernels_compiled_unsafe_stance: the compiled engine on RevViTBlocks, its first train step
    (forward and backward) under the default stance, the later ones under skip_guard_eval_unsafe,
    and the stance put back after each; its weights and grads are revkernels_compiled's."""
    cpu = torch.device("cpu")
    models = {v: stance.make_model(v, SMALL, cpu) for v in (stance.UNSAFE_STANCE, "revkernels_compiled")}
    stances = {"forward": [], "backward": []}
    unsafe_model = models[stance.UNSAFE_STANCE]
    unsafe_model.register_forward_hook(lambda *_: stances["forward"].append(_unsafe()))
    next(unsafe_model.parameters()).register_hook(lambda g: stances["backward"].append(_unsafe()))
    x = overhead.make_input(SMALL, cpu)
    for model in models.values():
        model.seq.compile_options = {"backend": "aot_eager"}
        for _ in range(3):
            for p in model.parameters():
                p.grad = None
            stance.train_step(model, x, cpu)
            assert not _unsafe()
    assert stances == {"forward": [False, True, True], "backward": [False, True, True]}
    for p, q in zip(*(m.parameters() for m in models.values()), strict=True):
        assert torch.equal(p, q)
        assert (p.grad - q.grad).abs().max() <= 1e-5 * q.grad.abs().max()


@pytest.mark.usefixtures("fresh_dynamo")
def test_cli_writes_every_variant(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(overhead.CONFIGS, "tiny", SMALL)
    make_model = stance.make_model

    def eager_compiled(variant, cfg, device, seed=0):  # aot_eager: no C++ compile in a test
        model = make_model(variant, cfg, device, seed)
        if "compiled" in variant:
            model.seq.compile_options = {"backend": "aot_eager"}
        return model

    monkeypatch.setattr(stance, "make_model", eager_compiled)
    assert stance.main(["--configs", "tiny", "--warmup", "1", "--rounds", "2", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "compiler_stance_cpu.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["variant"] for r in rows] == list(stance.VARIANTS)
    for row in rows:
        assert math.isfinite(float(row["step_ms"])) and row["commit"] and row["torch"], row
    by = {r["variant"]: r for r in rows}
    assert by[stance.UNSAFE_STANCE]["engine"] == by["revkernels_compiled"]["engine"] == "compiled"
    assert float(by["revkernels_compiled"]["vs_revkernels_compiled"]) == 1.0
    assert math.isclose(float(by[stance.UNSAFE_STANCE]["vs_revkernels_compiled"]),
                        float(by["revkernels_compiled"]["step_ms"]) / float(by[stance.UNSAFE_STANCE]["step_ms"]),
                        rel_tol=1e-2)
    assert stance.UNSAFE_STANCE in capsys.readouterr().out
