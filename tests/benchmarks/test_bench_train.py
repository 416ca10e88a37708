"""revkernels.bench.train: its step timing and its compile handling (the end-to-end smoke run is in
test_bench_scripts.py)."""
import pytest
import torch

from revkernels.bench import train


class _Counting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize("warmup,steps", [(1, 2), (3, 4)])
def test_time_steps_runs_warmup_then_timed_steps(warmup, steps):
    """`warmup` steps in all (the first one timed alone and returned) and then `steps` timed ones."""
    model = _Counting()
    ms, first, peak, transient = train.time_steps(model, torch.randn(2, 4), lambda y: y.square().mean(),
                                                  torch.device("cpu"), torch.float32, steps, warmup)
    assert model.calls == warmup + steps
    assert ms > 0 and first > 0
    assert peak != peak and transient != transient  # no memory figures on CPU (nan)


def test_time_steps_needs_a_warmup_step():
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        train.time_steps(_Counting(), torch.randn(2, 4), lambda y: y.sum(), torch.device("cpu"), torch.float32, 2, 0)


def test_compiling_variants_start_from_reset_dynamo_caches(monkeypatch):
    """A compiling variant compiles its configuration afresh (static shapes), not as a recompile of
    an earlier configuration's graphs; the others leave Dynamo's caches alone."""
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(True))
    monkeypatch.setattr(train, "time_steps", lambda *args, **kwargs: (1.0, 2.0, float("nan"), float("nan")))
    for variant, expected in (("standard", 0), ("standard_compile", 1), ("revkernels_sequential", 1),
                              ("revkernels_compiled", 2)):
        train.measure(variant, 1, 16, 2, 2, 5, torch.device("cpu"), torch.float32, 1, 1)
        assert len(resets) == expected, variant
