"""The engine-floor comparison (benchmarks/profile_engine_floor.py): the floor Function's grads
against plain autograd, the part's own grad check, and a CPU run of its CSV."""
import csv

import pytest
import torch

from revkernels.bench import overhead as ov
from tests.benchmarks import load_script
from tests.helpers import assert_close_rel

ef = load_script("profile_engine_floor")

TINY = dict(depth=3, dim=16, heads=2, tokens=4, batch=2, threads=1)


def _plain_grads(blocks, x):
    """Parameter and input grads of the benchmark's loss, by plain autograd through the blocks."""
    leaf = x.detach().clone().requires_grad_()
    x1 = x2 = leaf
    for block in blocks:
        x1 = x1 + block.f(x2)
        x2 = x2 + block.g(x1)
    params = [p for block in blocks for p in block.parameters()]
    return torch.autograd.grad(ov.loss_of((x1 + x2) * 0.5), [leaf, *params])


@pytest.mark.parametrize("variant", ["floor", "floor_block_steps"])
def test_floor_run_has_plain_autograds_grads(variant):
    torch.manual_seed(0)
    model = ef.make_variant(variant, TINY, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():  # (LayerNorm's ones and zeros are not a test of anything)
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(TINY["batch"], TINY["tokens"], TINY["dim"])
    expected = _plain_grads(list(model.blocks), x)
    leaf = x.clone().requires_grad_()
    ov.loss_of(model(leaf)).backward()
    got = [leaf.grad] + [p.grad for block in model.blocks for p in block.parameters()]
    assert len(got) == len(expected) > 1
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert_close_rel(a, e, 1e-5, f"grad {i}")


def test_check_grads_catches_grads_handed_to_the_wrong_parameters():
    device = torch.device("cpu")
    model = ef.make_variant("floor", TINY, device)
    model.param_lists[0], model.param_lists[1] = model.param_lists[1], model.param_lists[0]
    with pytest.raises(RuntimeError, match="floor: grad of parameter"):
        ef.check_grads({"floor": model}, ov.make_input(TINY, device), device)


def test_cli_writes_every_variant(tmp_path, monkeypatch):
    monkeypatch.setitem(ov.CONFIGS, "tiny", TINY)
    assert ef.main(["--config", "tiny", "--rounds", "3", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "engine_floor_tiny_cpu.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["variant"] for r in rows] == list(ef.VARIANTS)
    for row in rows:
        assert float(row["step_ms"]) > 0 and float(row["vs_reversible_plain"]) > 0, row
        assert row["commit"] and row["torch"] == torch.__version__
    assert float(rows[0]["vs_reversible_plain"]) == 1.0
