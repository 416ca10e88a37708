"""revkernels.engine.budget: a memory budget keeps the last blocks' activations (no rebuild for
them) and never saves more than it was given beyond the run's outputs; gradients at every budget
are plain autograd's."""
import pytest
import torch
from torch import nn

import revkernels as rk
from revkernels.engine import budget as budget_module
from tests.helpers import assert_close_rel, loss_of, make_seq, perturb_parameters, plain_forward, run_grads

BUDGETS = [0, 0.1, 0.25, 0.5, 0.75, 1.0, 40_000]


def _seq(engine="sequential", depth=6, width=24, **kwargs):
    seq = perturb_parameters(make_seq(depth, width, engine=engine, **kwargs))
    if engine == "compiled":
        seq.compile_options = {"backend": "aot_eager"}
    return seq


# (pareprop and auto run the sequential engine's code on CPU: one budget each)
@pytest.mark.parametrize("engine,budget", [(e, b) for e in ("sequential", "compiled") for b in BUDGETS]
                         + [("pareprop", 0.5), ("auto", 0.5)])
def test_grads_equal_plain_autograd_at_every_budget(engine, budget):
    torch.manual_seed(0)
    seq = _seq(engine, dropout=0.2, drop_path=0.1)
    ref = _seq("autograd", dropout=0.2, drop_path=0.1)
    ref.load_state_dict(seq.state_dict())
    seq.memory_budget = budget
    data = [torch.randn(5, 24) for _ in range(4)]
    got = run_grads(seq, seq, *data, seed=3)
    rng_after = torch.rand(3)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=3)
    assert torch.equal(rng_after, torch.rand(3))  # the plan's measurement drew nothing of the stream
    for a, e in zip(got, expected, strict=True):
        assert_close_rel(a, e)


@pytest.mark.parametrize("budget", [0, 0.3, 1.0])
def test_batch_norm_statistics_are_updated_once(budget):
    torch.manual_seed(0)
    seq = _seq(norm="batch")
    ref = _seq("autograd", norm="batch")
    ref.load_state_dict(seq.state_dict())
    seq.memory_budget = budget
    data = [torch.randn(6, 24) for _ in range(4)]
    run_grads(seq, seq, *data)
    run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
    for (name, a), (_, b) in zip(seq.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7), name


def _saved_bytes(seq, x):
    params = {p.untyped_storage().data_ptr() for p in seq.parameters()}
    seen, total = set(), [0]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y1, y2 = seq(x, x)
    loss_of(y1, y2, 1.0, 1.0).backward()
    return total[0]


@pytest.mark.parametrize("budget", BUDGETS)
def test_saved_bytes_stay_within_the_budget_beyond_the_outputs(budget):
    torch.manual_seed(0)
    seq = _seq(depth=8, width=32)
    seq.memory_budget = budget
    x = torch.randn(16, 32, requires_grad=True)
    plan = seq.memory_plan(x, x)
    outputs = 2 * x.numel() * x.element_size()
    saved = _saved_bytes(seq, x)
    assert saved <= plan.budget_bytes + outputs
    assert plan.kept_bytes <= plan.budget_bytes
    if budget == 1.0:
        assert all(plan.kept) and saved == _saved_bytes(_seq("autograd", depth=8, width=32), x)
    if budget == 0:
        assert not any(plan.kept) and saved <= outputs


def test_budget_buys_rebuilds_in_order_from_the_last_block():
    seq = _seq(depth=6)
    x = torch.randn(4, 24)
    kept = []
    for budget in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        seq.memory_budget = budget
        kept.append(seq.memory_plan(x, x).kept)
    counts = [sum(k) for k in kept]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6
    for k in kept:  # a kept suffix
        assert list(k) == sorted(k)


def test_the_plan_is_measured_once_per_signature(monkeypatch):
    calls = []
    measure = budget_module.activation_bytes

    def counted(*args):
        calls.append(1)
        return measure(*args)

    monkeypatch.setattr(budget_module, "activation_bytes", counted)
    seq = _seq()
    seq.memory_budget = 0.5
    for batch in (4, 4, 4, 6, 4):
        x = torch.randn(batch, 24, requires_grad=True)
        seq(x, x)[0].sum().backward()
    assert len(calls) == 2  # batch 4, then batch 6
    seq.memory_budget = 0.75  # another budget: the same measurement
    seq(x, x)[0].sum().backward()
    assert len(calls) == 2
    seq.eval()  # training flags are part of the signature
    seq(x, x)[0].sum().backward()
    assert len(calls) == 3


def test_memory_plan_reads_as_a_table():
    seq = _seq(depth=3)
    seq.memory_budget = 1.0
    text = str(seq.memory_plan(torch.randn(4, 24), torch.randn(4, 24)))
    assert "skips 3 of 3 rebuilds" in text and text.count("keep") == 4  # the header's "keeps" and 3 rows


@pytest.mark.parametrize("bad,error", [(-0.5, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                       (-1, ValueError), ("half", ValueError), (True, TypeError), ([0.5], TypeError)])
def test_bad_budgets_raise_naming_the_argument(bad, error):
    with pytest.raises(error, match="memory_budget"):
        rk.nn.ReversibleSequential(*make_seq(1, 4).blocks, memory_budget=bad)


def test_auto_reads_the_free_memory_of_a_cuda_device(monkeypatch):
    seq = _seq()
    seq.memory_budget = "auto"
    with pytest.raises(ValueError, match="memory_budget='auto' reads the free memory of a CUDA device"):
        seq(torch.randn(2, 24, requires_grad=True), torch.randn(2, 24))
    params = [nn.Parameter(torch.ones(1000)) for _ in range(2)]  # 8000 bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**6, 10**6))
    # free - grads not held yet (8000) - 2 x parameters (16000) - 10% of the device
    assert budget_module.auto_budget_bytes(params, torch.device("cuda", 0)) == 10**6 - 8000 - 16000 - 10**5
