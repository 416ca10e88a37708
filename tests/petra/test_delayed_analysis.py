"""The delayed-gradient baseline (input + parameter buffers, PipeDream-like weight stashing) and the
gradient analysis (each method's applied gradient against the end-to-end one of the same batches)."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from revkernels.petra import Trainer
from tests.helpers import assert_close_rel
from tests.petra.test_simulate import TanhStage, _batches, _check_schedule, _in_flight, _small_cnn, synthetic_stages


def _param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


# --- delayed gradients ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["S r H", "S r D r r H"])
def test_delayed_schedule_and_buffers(layout):
    """PETRA's schedule; every stage j < J (reversible too) holds 2(J - j) inputs and parameter copies."""
    torch.manual_seed(0)
    trainer = Trainer(synthetic_stages(layout), "delayed", accum_k=2, base_lr=0.5)
    J = trainer.num_stages
    n = 2 * J + 3
    for step, (x, y) in enumerate(_batches(n)):
        tick = trainer.train_step(x, y)["tick"]
        for s, st in zip(trainer.stages, trainer.buffer_stats()):
            if s.is_last:
                assert st["bytes"] == st["inputs"] == 0
                continue
            assert s.buffered_batches == _in_flight(trainer, s.index, tick)
            assert st["param_bytes"] == st["inputs"] * _param_bytes(s.module)
            assert st["bytes"] == st["input_bytes"] + st["param_bytes"] and (st["input_bytes"] > 0) == (st["inputs"] > 0)
            if step >= 2 * (J - 1):
                assert st["inputs"] == 2 * (J - s.index - 1)
    trainer.flush()
    assert all(st["bytes"] == 0 for st in trainer.buffer_stats())
    assert trainer.stages[1].reversible and trainer.stages[1].peak_buffer_bytes > 0
    _check_schedule(trainer, n)


def test_delayed_uses_the_stashed_parameters_like_the_hand_written_schedule():
    """J = 2, k = 1: stage 1's backward of batch b (tick b + 2) recomputes at its input with the
    parameters of its forward (tick b) and the gradient is applied to the current ones."""
    torch.manual_seed(0)
    stages = nn.ModuleList([TanhStage(), nn.Linear(4, 3, bias=False)])
    W0, W1 = stages[0].lin.weight.detach().clone(), stages[1].weight.detach().clone()
    batch, base_lr, wd = 4, 25.6, 1e-2
    trainer = Trainer(stages, "delayed", accum_k=1, base_lr=base_lr, weight_decay=wd)
    data = _batches(4, batch=batch, d_in=5, classes=3, seed=3)
    for x, y in data:
        trainer.train_step(x, y)
    trainer.flush()

    lr = base_lr * batch / 256
    W0, W1 = W0.requires_grad_(), W1.requires_grad_()
    opt0 = torch.optim.SGD([W0], lr=lr, momentum=0.9, nesterov=True, weight_decay=wd)
    opt1 = torch.optim.SGD([W1], lr=lr, momentum=0.9, nesterov=True, weight_decay=wd)
    xs, ys = [d[0] for d in data], [d[1] for d in data]
    stash = {}

    def fwd0(b):
        stash[b] = W0.detach().clone()
        with torch.no_grad():
            return torch.tanh(xs[b] @ W0.T)

    def head(h, b):
        h = h.clone().requires_grad_()
        dW1, dh = torch.autograd.grad(F.cross_entropy(h @ W1.T, ys[b]), [W1, h])
        step(opt1, W1, dW1)
        return dh

    def bwd0(b, dh):  # at the stashed parameters, applied to the current ones
        w = stash.pop(b).requires_grad_()
        step(opt0, W0, torch.autograd.grad(torch.tanh(xs[b] @ w.T), w, dh)[0])

    def step(opt, W, g):
        W.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)

    h0 = fwd0(0)                                         # tick 0
    h1 = fwd0(1); dh0 = head(h0, 0)                      # tick 1
    h2 = fwd0(2); bwd0(0, dh0); dh1 = head(h1, 1)        # tick 2
    h3 = fwd0(3); bwd0(1, dh1); dh2 = head(h2, 2)        # tick 3
    bwd0(2, dh2); dh3 = head(h3, 3)                      # tick 4
    bwd0(3, dh3)                                         # tick 5
    assert_close_rel(stages[0].lin.weight.detach(), W0.detach(), 1e-5, "stage 1 weight")
    assert_close_rel(stages[1].weight.detach(), W1.detach(), 1e-5, "head weight")
    # PETRA (current parameters in the backward) ends elsewhere.
    torch.manual_seed(0)
    petra = nn.ModuleList([TanhStage(), nn.Linear(4, 3, bias=False)])
    tp = Trainer(petra, "petra", accum_k=1, base_lr=base_lr, weight_decay=wd)
    for x, y in data:
        tp.train_step(x, y)
    tp.flush()
    assert not torch.allclose(petra[0].lin.weight, stages[0].lin.weight, atol=1e-6)


def test_delayed_single_stage_equals_backprop():
    torch.manual_seed(0)
    base = _small_cnn()
    models = {m: copy.deepcopy(base) for m in ("delayed", "backprop")}
    trainers = {m: Trainer(models[m], m, accum_k=2, base_lr=1.0) for m in models}
    for x, y in _batches(4, batch=6, d_in=3 * 6 * 6, classes=5):
        x = x.view(6, 3, 6, 6)
        losses = [trainers[m].train_step(x, y)["loss"] for m in models]
        assert losses[0] == losses[1]
    for a, b in zip(models["delayed"].state_dict().values(), models["backprop"].state_dict().values()):
        assert torch.equal(a, b)


# --- gradient analysis ------------------------------------------------------------------------------------

def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("method, J1", [("backprop", False), ("petra", True), ("delayed", True),
                                        ("revbackprop", False)])
def test_analysis_is_exact_when_the_method_is_backprop(method, J1):
    """Backprop (any J) and PETRA / delayed with J = 1 apply the end-to-end gradient: cosine 1, ratio 1."""
    torch.manual_seed(0)
    model = _small_cnn() if J1 else synthetic_stages("S r D r H")
    trainer = Trainer(model, method, accum_k=2, base_lr=1.0, analyze_every=1)
    shape = (6, 3, 6, 6) if J1 else (6, 8)
    classes = 5 if J1 else 3
    for x, y in _batches(6, batch=6, d_in=math.prod(shape[1:]), classes=classes):
        trainer.train_step(x.view(shape), y)
    recs = trainer.analysis
    assert len(recs) == 3 * trainer.num_stages and [r["step"] for r in recs][::trainer.num_stages] == [1, 2, 3]
    assert recs[0]["batches"] == [0, 1]
    for r in recs:
        assert r["cosine"] == pytest.approx(1.0, abs=1e-6) and r["norm_ratio"] == pytest.approx(1.0, abs=1e-6), r
    assert trainer._inputs == {}  # nothing kept once every window is done


def test_analysis_petra_and_delayed_finite_and_leaves_no_trace():
    """PETRA / delayed on a small pipeline: values finite, cosine in [-1, 1]; the analysis changes no
    parameter, grad, BatchNorm statistic or RNG state (same run with and without it)."""
    torch.manual_seed(0)
    base = synthetic_stages("S r D r H")
    data = _batches(14, batch=6)
    for method in ("petra", "delayed"):
        runs = {}
        for every in (None, 2):
            model = copy.deepcopy(base)
            trainer = Trainer(model, method, accum_k=1, base_lr=2.0, analyze_every=every)
            torch.manual_seed(5)
            for x, y in data:
                trainer.train_step(x, y)
            trainer.flush()
            runs[every] = (_state(model), torch.rand(3), trainer)
        (s0, r0, _), (s1, r1, t) = runs[None], runs[2]
        assert all(torch.equal(s0[k], s1[k]) for k in s0) and torch.equal(r0, r1)
        recs = t.analysis
        assert {r["stage"] for r in recs} == set(range(t.num_stages))
        assert [r["step"] for r in recs if r["stage"] == 0] == [2, 4, 6, 8, 10, 12, 14]
        for r in recs:
            assert math.isfinite(r["cosine"]) and -1.0 - 1e-9 <= r["cosine"] <= 1.0 + 1e-9
            assert math.isfinite(r["norm_ratio"]) and r["norm_ratio"] > 0
        assert any(r["cosine"] < 1 - 1e-6 for r in recs)  # stale somewhere


def test_analysis_bad_argument():
    with pytest.raises(ValueError, match="analyze_every"):
        Trainer(synthetic_stages("S r H"), "petra", analyze_every=0)
