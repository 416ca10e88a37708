"""revkernels.engine.state: the check that a block which says it draws no random numbers draws none."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import revkernels as rk
from revkernels.engine import state
from tests.helpers import assert_close_rel, plain_forward


class _FloatDropout(nn.Module):
    """Dropout through F.dropout with a float attribute: no module type tells that it draws."""

    def __init__(self, width, declared=False):
        super().__init__()
        self.linear, self.p = nn.Linear(width, width), 0.3
        if declared:
            self.draws_random = lambda: self.training and self.p > 0

    def forward(self, x):
        return F.dropout(self.linear(x), self.p, self.training)


class _Noise(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return self.linear(x) + 0.1 * torch.randn_like(x)


def _run(f, engine, x, seed=0):
    seq = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(f, nn.Linear(8, 8)), engine=engine)
    torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y1, y2 = seq(x, x)
        (y1.square().sum() + y2.sum()).backward()
    return seq, [str(w.message) for w in caught if "drew random numbers" in str(w.message)]


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "compiled"])
@pytest.mark.parametrize("make", [_FloatDropout, _Noise], ids=["F.dropout", "randn_like"])
def test_undeclared_randomness_is_named(engine, make):
    torch.manual_seed(0)
    _, messages = _run(make(8), engine, torch.randn(4, 8, requires_grad=True))
    assert len(messages) == 1 and f"ReversibleBlock(f={make.__name__}, g=Linear)" in messages[0]


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_declared_randomness_is_replayed_without_a_warning(engine):
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    seq, messages = _run(_FloatDropout(8, declared=True), engine, x, seed=1)
    assert messages == []
    ours = [p.grad for p in seq.parameters()] + [x.grad]
    for p in [*seq.parameters(), x]:
        p.grad = None
    torch.manual_seed(1)
    e1, e2 = plain_forward(seq, x, x)
    (e1.square().sum() + e2.sum()).backward()
    for a, e in zip(ours, [p.grad for p in seq.parameters()] + [x.grad]):
        assert_close_rel(a, e)


def test_each_block_is_checked_once_per_mode(monkeypatch):
    reads = []

    class CountingRngState(state.RngState):
        def __init__(self, cuda_devices=()):
            reads.append(1)
            super().__init__(cuda_devices)

    monkeypatch.setattr(state, "RngState", CountingRngState)
    seq = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(nn.Linear(8, 8), nn.Linear(8, 8)))
    x = torch.randn(2, 8, requires_grad=True)
    for _ in range(3):
        seq(x, x)[0].sum().backward()
    assert len(reads) == 2  # before and after the first training forward
    seq.eval()
    seq(x, x)
    seq(x, x)
    assert len(reads) == 4  # and the first eval forward


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "compiled"])
def test_a_step_under_fake_tensor_mode_runs_and_the_check_waits_for_real_data(engine):
    # (the check compared generator states with torch.equal: a data-dependent op FakeTensorMode
    # refuses, so memory-saving runs under it raised where engine="autograd" ran)
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    torch.manual_seed(0)
    seq = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(_Noise(8), nn.Linear(8, 8)), engine=engine)
    seq.compile_options = {"backend": "aot_eager"}
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(4, 8, requires_grad=True)
        y1, y2 = seq(x, x)
        (y1.square().sum() + y2.sum()).backward()
    assert isinstance(y1, FakeTensor) and y1.shape == y2.shape == (4, 8) and x.grad.shape == (4, 8)
    seq.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:  # (the first real forward is checked)
        warnings.simplefilter("always")
        seq(*[torch.randn(4, 8, requires_grad=True)] * 2)
    assert len([w for w in caught if "drew random numbers" in str(w.message)]) == 1
