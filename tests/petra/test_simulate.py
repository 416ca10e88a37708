"""PETRA's exact simulator: staleness 2(J-j), buffers, J = 1 equals backprop, gradient averaging
against a hand-written schedule, the optimizer recipe, the baselines, a loss smoke check."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from revkernels.models import ReversibleStage, revnet18
from revkernels.petra import METHODS, Trainer, partition
from tests.helpers import assert_close_rel

WIDTH = 4


class Split(nn.Module):
    """Stem: features -> two streams."""

    reversible = False
    kind = "stem"

    def __init__(self, d_in, width=WIDTH):
        super().__init__()
        self.lin = nn.Linear(d_in, 2 * width)

    def forward(self, x):
        return tuple(torch.tanh(self.lin(x)).chunk(2, dim=1))


class Mix(nn.Module):
    """A non-reversible middle stage with a BatchNorm."""

    reversible = False
    kind = "down"

    def __init__(self, width=WIDTH):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x1, x2):
        return torch.tanh(self.a(x2)), x1 + self.bn(self.b(x2))


class TwoStreamHead(nn.Module):
    reversible = False
    kind = "head"

    def __init__(self, classes, width=WIDTH):
        super().__init__()
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x1, x2):
        return self.fc(torch.cat([x1, x2], dim=1))


def _rev(width=WIDTH):
    return ReversibleStage(nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh()))


def _noisy_rev(width=WIDTH):
    return ReversibleStage(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.3)))


def synthetic_stages(layout, d_in=8, classes=3):
    """Stage list from a layout string such as "S r r D r H" (S and H required at the ends; "d": a
    reversible stage with dropout)."""
    letters = layout.split()
    assert letters[0] == "S" and letters[-1] == "H"
    make = {"r": _rev, "D": Mix, "d": _noisy_rev}
    return nn.ModuleList([Split(d_in)] + [make[c]() for c in letters[1:-1]] + [TwoStreamHead(classes)])


def _batches(n, batch=4, d_in=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]


def _in_flight(trainer, stage, tick):
    """Batches whose forward at `stage` ran at or before `tick` and whose backward runs after it."""
    return [b for (b, s), t in sorted(trainer.schedule.items()) if s == stage and t["forward"] <= tick < t.get("backward", float("inf"))]


def _check_schedule(trainer, num_batches):
    J = trainer.num_stages
    for b in range(num_batches):
        for i in range(J):
            j = i + 1  # PETRA.md's 1-based stage index
            t = trainer.schedule[(b, i)]
            assert t["forward"] == b + i, f"batch {b} stage {j}: forward at tick {t['forward']}"
            assert t["backward"] - t["forward"] == 2 * (J - j), f"batch {b} stage {j}: staleness {t}"
    # Per tick, each stage runs at most one forward and one backward, the forward first.
    seen = {}
    for tick, stage, what, _ in trainer.events:
        key = (tick, stage)
        assert what not in seen.setdefault(key, []), f"two {what}s at {key}"
        if what == "forward":
            assert "backward" not in seen[key], f"backward before forward at {key}"
        seen[key].append(what)


# --- staleness and buffers ------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["S H", "S r H", "S r D r r H", "S D r D r r r H"])
def test_staleness_and_buffers_synthetic(layout):
    torch.manual_seed(0)
    trainer = Trainer(synthetic_stages(layout), "petra", accum_k=2, base_lr=0.5)
    J = trainer.num_stages
    n = 2 * J + 3
    for step, (x, y) in enumerate(_batches(n)):
        out = trainer.train_step(x, y)
        tick = out["tick"]
        # The head computes the loss of batch t - (J - 1) at tick t.
        assert out["batch"] == (tick - (J - 1) if tick >= J - 1 else None)
        for s in trainer.stages:
            if s.reversible or s.is_last:
                assert s.buffered_inputs == 0 and s.buffer_tensors == 0 and s.buffer_bytes == 0
            else:
                # Exactly the inputs in flight (forward done, backward pending), oldest first.
                assert s.buffered_batches == _in_flight(trainer, s.index, tick)
                if step >= 2 * (J - 1):  # steady state: 2(J - j) inputs, j = index + 1
                    assert s.buffered_inputs == 2 * (J - s.index - 1)
    flushed = trainer.flush()
    assert [r["batch"] for r in flushed if r["batch"] is not None] == list(range(n - J + 1, n))
    assert not trainer.pending() and all(s.buffered_inputs == 0 for s in trainer.stages)
    _check_schedule(trainer, n)
    assert trainer.tick == n + 2 * (J - 1)


def test_staleness_and_buffers_revnet18():
    torch.manual_seed(0)
    model = revnet18(num_classes=10, stem="cifar")
    trainer = Trainer(model, "petra", base_lr=0.1)
    J = trainer.num_stages
    assert J == 10 and [s.kind for s in trainer.stages] == [s.kind for s in model.stages]
    assert all(s.module is m for s, m in zip(trainer.stages, model.stages))
    batch, size, fp32 = 2, 8, 4
    # Bytes of one stored input: the image for the stem, both streams for each down stage.
    entry = {0: batch * 3 * size * size * fp32, 3: 2 * batch * 64 * 8 * 8 * fp32,
             5: 2 * batch * 128 * 4 * 4 * fp32, 7: 2 * batch * 256 * 2 * 2 * fp32}
    assert sorted(entry) == [s.index for s in trainer.stages if not s.reversible and not s.is_last]
    g = torch.Generator().manual_seed(1)
    n = 3
    losses = []

    def check_buffers(tick):
        for s in trainer.stages:
            if s.reversible or s.is_last:
                assert s.buffer_tensors == 0 and s.buffer_bytes == 0, f"stage {s.index} ({s.kind}) holds buffers"
            else:
                inflight = _in_flight(trainer, s.index, tick)
                assert s.buffered_batches == inflight
                assert s.buffer_tensors == len(inflight) * (1 if s.index == 0 else 2)
                assert s.buffer_bytes == len(inflight) * entry[s.index]

    for _ in range(n):
        out = trainer.train_step(torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g))
        check_buffers(out["tick"])
    while trainer.pending():
        out = trainer.advance()
        check_buffers(out["tick"])
        losses.append(out["loss"])
    assert trainer.advance() is None and trainer.flush() == []
    _check_schedule(trainer, n)
    assert all(torch.isfinite(torch.tensor(v)) for v in losses if v is not None)
    stats = trainer.buffer_stats()
    assert stats[0]["peak_bytes"] == 3 * entry[0]  # the stem held all three images at tick 2
    assert all(st["peak_bytes"] == 0 for st in stats if st["reversible"])
    # BatchNorm running statistics: one update per batch (the forward), none from rebuilds/recomputes.
    tracked = [int(b) for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]
    assert tracked and set(tracked) == {n}


# --- J = 1 is backprop; the baselines agree -------------------------------------------------------

def _small_cnn(classes=5):
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(24, classes))


def _params_and_buffers(module):
    return [(n, t.detach().clone()) for n, t in [*module.named_parameters(), *module.named_buffers()]]


def _assert_same_state(a, b, tol=1e-5):
    for (name, x), (_, y) in zip(_params_and_buffers(a), _params_and_buffers(b)):
        if x.is_floating_point():
            assert_close_rel(x, y, tol, name)
        else:
            assert torch.equal(x, y), name


@pytest.mark.parametrize("accum_k", [1, 2])
def test_single_stage_petra_equals_backprop(accum_k):
    torch.manual_seed(0)
    base = _small_cnn()
    kwargs = dict(accum_k=accum_k, base_lr=1.0, warmup_steps=2, milestones=(3,), weight_decay=5e-4)
    petra, backprop = copy.deepcopy(base), copy.deepcopy(base)
    tp, tb = Trainer(petra, "petra", **kwargs), Trainer(backprop, "backprop", **kwargs)
    assert tp.num_stages == 1 and tp.stages[0].is_first and tp.stages[0].is_last
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
        lp, lb = tp.train_step(x, y), tb.train_step(x, y)
        assert lp["loss"] == pytest.approx(lb["loss"], rel=1e-5) and lp["stepped"] == lb["stepped"]
    assert tp.flush() == []
    assert tp.optimizers[0].steps == tb.optimizers[0].steps == 8 // accum_k
    _assert_same_state(petra, backprop)
    assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(_params_and_buffers(base), _params_and_buffers(petra)))


def test_backprop_and_revbackprop_agree():
    torch.manual_seed(0)
    base = synthetic_stages("S r r D r H")
    models = {m: copy.deepcopy(base) for m in ("backprop", "revbackprop")}
    trainers = {m: Trainer(models[m], m, accum_k=2, base_lr=2.0, weight_decay=1e-3) for m in models}
    for x, y in _batches(6):
        losses = [trainers[m].train_step(x, y)["loss"] for m in models]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    _assert_same_state(models["backprop"], models["revbackprop"])
    # Baselines: every stage's forward and backward of batch b at step b.
    assert all(t == {"forward": b, "backward": b} for (b, _), t in trainers["backprop"].schedule.items())


# --- gradient averaging and current parameters, against a hand-written schedule ----------------------

class TanhStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 4, bias=False)

    def forward(self, x):
        return (torch.tanh(self.lin(x)),)


def test_accumulation_averages_grads_like_the_hand_written_schedule():
    """J = 2, k = 2, four batches. Stage 1 (j = 1) runs its backward 2 ticks after its forward with
    its parameters *at that tick*; the head steps after batches 1 and 3, stage 1 after 1 and 3."""
    torch.manual_seed(0)
    stages = nn.ModuleList([TanhStage(), nn.Linear(4, 3, bias=False)])
    W0, W1 = stages[0].lin.weight.detach().clone(), stages[1].weight.detach().clone()
    batch, k, base_lr, wd = 4, 2, 25.6, 1e-2
    trainer = Trainer(stages, "petra", accum_k=k, base_lr=base_lr, weight_decay=wd)
    data = _batches(4, batch=batch, d_in=5, classes=3, seed=3)
    for x, y in data:
        trainer.train_step(x, y)
    trainer.flush()

    lr = base_lr * batch * k / 256
    W0 = W0.requires_grad_()
    W1 = W1.requires_grad_()
    opt0 = torch.optim.SGD([W0], lr=lr, momentum=0.9, nesterov=True, weight_decay=wd)
    opt1 = torch.optim.SGD([W1], lr=lr, momentum=0.9, nesterov=True, weight_decay=wd)
    xs, ys = [d[0] for d in data], [d[1] for d in data]

    def fwd0(b):
        with torch.no_grad():
            return torch.tanh(xs[b] @ W0.T)

    def head(h, b):  # forward, loss, backward at the head's current parameters
        h = h.clone().requires_grad_()
        dW1, dh = torch.autograd.grad(F.cross_entropy(h @ W1.T, ys[b]), [W1, h])
        return dW1, dh

    def bwd0(b, dh):  # recompute at the stored input with stage 1's current parameters
        return torch.autograd.grad(torch.tanh(xs[b] @ W0.T), W0, dh)[0]

    def step(opt, W, grads):
        W.grad = sum(grads) / k
        opt.step()
        opt.zero_grad(set_to_none=True)

    h0 = fwd0(0)                                                        # tick 0
    h1 = fwd0(1); gh0, dh0 = head(h0, 0)                                # tick 1
    h2 = fwd0(2); g00 = bwd0(0, dh0); gh1, dh1 = head(h1, 1)            # tick 2
    step(opt1, W1, [gh0, gh1])
    h3 = fwd0(3); g01 = bwd0(1, dh1); step(opt0, W0, [g00, g01])        # tick 3 (forward first)
    gh2, dh2 = head(h2, 2)
    g02 = bwd0(2, dh2); gh3, dh3 = head(h3, 3); step(opt1, W1, [gh2, gh3])  # tick 4
    g03 = bwd0(3, dh3); step(opt0, W0, [g02, g03])                      # tick 5

    assert trainer.tick == 6
    assert [o.steps for o in trainer.optimizers] == [2, 2]
    assert_close_rel(stages[0].lin.weight.detach(), W0.detach(), 1e-5, "stage 1 weight")
    assert_close_rel(stages[1].weight.detach(), W1.detach(), 1e-5, "head weight")
    assert all(p.grad is None for p in stages.parameters())


# --- optimizer recipe -------------------------------------------------------------------------------

def test_param_groups_exclude_batchnorm_and_biases_from_weight_decay():
    with torch.device("meta"):
        model = revnet18(num_classes=10, stem="cifar", conv_bias=True)
    trainer = Trainer(model, "petra", accum_k=4, weight_decay=5e-4, batch_size=64)
    names = {id(p): n for n, p in model.named_parameters()}
    all_ids = []
    for stage, opt in zip(trainer.stages, trainer.optimizers):
        groups = {g["name"]: g for g in opt.optimizer.param_groups}
        assert groups["decay"]["weight_decay"] == 5e-4 and groups["no_decay"]["weight_decay"] == 0.0
        assert opt.optimizer.defaults["momentum"] == 0.9 and opt.optimizer.defaults["nesterov"]
        bn_ids = {id(p) for m in stage.module.modules() if isinstance(m, nn.BatchNorm2d) for p in m.parameters()}
        for p in groups["no_decay"]["params"]:
            assert id(p) in bn_ids or names[id(p)].endswith(".bias"), names[id(p)]
        for p in groups["decay"]["params"]:
            assert id(p) not in bn_ids and names[id(p)].endswith(".weight") and p.dim() > 1, names[id(p)]
        ids = [id(p) for g in groups.values() for p in g["params"]]
        assert sorted(ids) == sorted(id(p) for p in stage.module.parameters())
        all_ids += ids
    assert sorted(all_ids) == sorted(names)
    # The baselines: one optimizer over all parameters, same split.
    base = Trainer(model, "backprop", weight_decay=5e-4)
    groups = {g["name"]: g for g in base.optimizers[0].optimizer.param_groups}
    per_stage = [{id(p) for p in {g["name"]: g for g in o.optimizer.param_groups}["no_decay"]["params"]}
                 for o in trainer.optimizers]
    assert {id(p) for p in groups["no_decay"]["params"]} == set().union(*per_stage)


def test_momentum_zero_is_plain_sgd():
    """momentum=0 steps as torch.optim.SGD without momentum (Nesterov needs momentum > 0), bit for bit."""
    from revkernels.petra.simulate import param_groups

    torch.manual_seed(0)
    model = _small_cnn()
    ref, init = copy.deepcopy(model), _params_and_buffers(model)
    trainer = Trainer(model, "petra", base_lr=0.5, weight_decay=1e-2, momentum=0.0, batch_size=8)
    assert not trainer.optimizers[0].optimizer.defaults["nesterov"]
    sgd = torch.optim.SGD(param_groups([ref], 1e-2), lr=trainer.peak_lr, momentum=0.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
        trainer.train_step(x, y)
        sgd.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        sgd.step()
    got, want = _params_and_buffers(model), _params_and_buffers(ref)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, want))
    assert not all(torch.equal(a, b) for (_, a), (_, b) in zip(got, init))


def test_lr_schedule_linear_scaling_warmup_and_steps():
    trainer = Trainer(_small_cnn(), "petra", accum_k=4, base_lr=0.1, warmup_steps=5, milestones=(10, 20), batch_size=64)
    assert trainer.peak_lr == pytest.approx(0.1 * 64 * 4 / 256)
    lrs = [trainer.lr_at(s) for s in range(25)]
    assert lrs[:5] == pytest.approx([0.02, 0.04, 0.06, 0.08, 0.1])
    assert lrs[5:10] == pytest.approx([0.1] * 5)
    assert lrs[10:20] == pytest.approx([0.01] * 10) and lrs[20:] == pytest.approx([0.001] * 5)
    # The batch size is taken from the first batch when not given; the lr set before each step.
    trainer = Trainer(synthetic_stages("S r H"), "petra", accum_k=2, base_lr=0.256, warmup_steps=3)
    assert trainer.peak_lr is None
    seen = []
    for x, y in _batches(12, batch=4):
        out = trainer.train_step(x, y)
        if 2 in out["stepped"]:
            seen.append(trainer.optimizers[2].optimizer.param_groups[0]["lr"])
    assert trainer.peak_lr == pytest.approx(0.256 * 4 * 2 / 256)
    assert seen == pytest.approx([trainer.lr_at(s) for s in range(len(seen))]) and len(seen) == 5


def test_bad_arguments():
    stages = synthetic_stages("S r H")
    with pytest.raises(ValueError, match="method must be one of"):
        Trainer(stages, "pipedream")
    for kwargs, name in [({"accum_k": 0}, "accum_k"), ({"base_lr": -1.0}, "base_lr"), ({"warmup_steps": -1}, "warmup_steps"),
                         ({"milestones": (5, 2)}, "milestones"), ({"weight_decay": -1e-4}, "weight_decay"),
                         ({"batch_size": 0}, "batch_size")]:
        with pytest.raises(ValueError, match=name):
            Trainer(stages, "petra", **kwargs)
    trainer = Trainer(stages, "petra")
    with pytest.raises(ValueError, match="labels"):
        trainer.train_step(torch.randn(4, 8), torch.zeros(3, dtype=torch.long))
    # checked when fed: a pipelined run reaches the labels ticks later, when the error named no batch
    for labels in (torch.rand(4), torch.randint(0, 3, (4,), dtype=torch.int32)):
        with pytest.raises(TypeError, match="labels must be int64 class indices"):
            trainer.train_step(torch.randn(4, 8), labels)
    with pytest.raises(ValueError, match=r"first batch is empty.*pass batch_size=\.\.\. to the Trainer"):
        trainer.train_step(torch.randn(0, 8), torch.zeros(0, dtype=torch.long))
    assert trainer.batches_in == 0 and trainer.batch_size is None
    with pytest.raises(ValueError, match="at least one stage"):
        partition([])
    with pytest.raises(ValueError, match="must not be reversible"):
        partition([Split(8), _rev()])
    with pytest.raises(TypeError, match="not a revkernels.nn.ReversibleBlock"):
        partition([type("Fake", (nn.Linear,), {"reversible": True})(2, 2), TwoStreamHead(2)])
    assert METHODS == ("petra", "delayed", "backprop", "revbackprop")


@pytest.mark.parametrize("method", ["petra", "delayed"])
def test_a_tick_that_raises_stops_the_trainer_until_a_checkpoint_is_loaded(method):
    # A label out of the head's range is fed without error and fails ticks later, at the head, after
    # the tick's earlier workers ran their steps: going on from there would feed the pipeline twice
    # (the next call raised again and pushed duplicate FIFO entries).
    torch.manual_seed(0)
    good = _batches(8, seed=1)
    trainer = Trainer(synthetic_stages("S r r H"), method, accum_k=1, base_lr=0.2, warmup_steps=2)
    for x, y in good[:3]:
        trainer.train_step(x, y)
    checkpoint = trainer.state_dict()
    bad_labels = good[3][1].clone()
    bad_labels[1] = 7  # three classes
    with pytest.raises(IndexError, match="out of bounds"):
        trainer.train_step(good[3][0], bad_labels)
        for x, y in good[4:]:
            trainer.train_step(x, y)
    for call in (lambda: trainer.train_step(*good[4]), trainer.advance, trainer.flush, trainer.state_dict):
        with pytest.raises(RuntimeError, match=r"tick \d+ \(IndexError: .*out of bounds.*\) raised .*load_state_dict"):
            call()
    # Restored from the checkpoint, it trains as a trainer that never saw the bad batch.
    trainer.load_state_dict(checkpoint)
    reference = Trainer(synthetic_stages("S r r H"), method, accum_k=1, base_lr=0.2, warmup_steps=2)
    reference.load_state_dict(checkpoint)
    for x, y in good[3:]:
        got, want = trainer.train_step(x, y), reference.train_step(x, y)
        assert got["loss"] == want["loss"] and got["stepped"] == want["stepped"]
    got, want = trainer.flush(), reference.flush()
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    for (_, a), (_, b) in zip(trainer.state_dict()["modules"][1].items(), reference.state_dict()["modules"][1].items()):
        assert torch.equal(a, b)


# --- smoke: PETRA learns ------------------------------------------------------------------------------

def test_petra_loss_decreases_on_separable_data():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    classes, d_in = 3, 8
    centers = torch.randn(classes, d_in, generator=g)

    def batch(n=32):
        y = torch.randint(0, classes, (n,), generator=g)
        return centers[y] + 0.5 * torch.randn(n, d_in, generator=g), y

    # Four stages (stem staleness 6 ticks); peak lr 0.05 with Nesterov momentum.
    trainer = Trainer(synthetic_stages("S r r H", d_in, classes), "petra", accum_k=1, base_lr=0.4,
                      warmup_steps=3, weight_decay=5e-4)
    losses = [r["loss"] for r in [trainer.train_step(*batch()) for _ in range(30)] + trainer.flush()
              if r["loss"] is not None]
    assert len(losses) == 30 and all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.5 * first, f"loss {first:.3f} -> {last:.3f}"


# --- one batch through the pipeline: PETRA's gradient is backprop's ---------------------------------

def _grads_close(actual, expected, exact, tol):
    """Per-tensor relative error of each grad against `expected`: max |a - e| / max |e| <= tol.

    `exact` holds the same grads in float64: a tensor whose exact gradient is zero (a bias followed
    by a training-mode BatchNorm, which removes any per-channel shift) has no scale of its own; its
    fp32 grads are rounding noise, checked against the model's largest gradient instead."""
    scale = max(e.abs().max().item() for _, e in exact)
    for (name, a), (_, e), (_, e64) in zip(actual, expected, exact):
        assert a is not None and e is not None, f"{name}: no grad"
        if e64.abs().max().item() <= 1e-12 * scale:
            err = a.abs().max().item() / scale
            assert err <= tol, f"{name}: exact gradient 0, got {err:.3e} of the model's grad scale > {tol:.1e}"
        else:
            assert_close_rel(a, e, tol, name)


@pytest.mark.parametrize("which", ["synthetic", "revnet18"])
def test_one_batch_through_the_pipeline_gives_the_backprop_gradient(which):
    """A single batch: no stage steps before that batch's backward reached it, so each stage's
    rebuilt input (reversible) or recomputed forward (stem, down) sees the forward's parameters and
    PETRA's accumulated grads equal end-to-end backprop's (k = 2 leaves them in .grad, unapplied)."""
    torch.manual_seed(0)
    if which == "synthetic":
        base, x, y = synthetic_stages("S D r D r r r H"), *_batches(1, batch=6)[0]
    else:
        base = revnet18(num_classes=10, stem="cifar")
        g = torch.Generator().manual_seed(2)
        x, y = torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 10, (2,), generator=g)
    models = {m: copy.deepcopy(base) for m in ("petra", "backprop", "revbackprop")}
    losses = {}
    for method, model in models.items():
        trainer = Trainer(model, method, accum_k=2)
        out = trainer.train_step(x, y)
        losses[method] = [r["loss"] for r in [out, *trainer.flush()] if r["loss"] is not None]
    assert losses["petra"] == pytest.approx(losses["backprop"], rel=1e-5) and len(losses["petra"]) == 1
    grads = {m: [(n, p.grad) for n, p in model.named_parameters()] for m, model in models.items()}
    exact = copy.deepcopy(base).double()
    Trainer(exact, "backprop", accum_k=2).train_step(x.double(), y)
    exact = [(n, p.grad) for n, p in exact.named_parameters()]
    _grads_close(grads["petra"], grads["backprop"], exact, 1e-5)
    _grads_close(grads["revbackprop"], grads["backprop"], exact, 1e-5)
    for (n, a), (_, b) in zip(models["petra"].named_buffers(), models["backprop"].named_buffers()):
        assert torch.equal(a, b), f"{n}: BatchNorm statistics differ"


def test_a_caller_may_refill_its_batch_tensors_after_train_step():
    # The pipeline holds a batch for ticks after train_step returns (the stem's recompute, the
    # head's labels): a caller refilling one buffer each step gets what fresh tensors give.
    def run(reuse):
        torch.manual_seed(0)
        model = synthetic_stages("S r D r H")
        trainer = Trainer(model, "petra", base_lr=0.5, weight_decay=0.0)
        images, labels = torch.empty(4, 8), torch.empty(4, dtype=torch.long)
        losses = []
        for x, y in _batches(6):
            if reuse:
                images.copy_(x)
                labels.copy_(y)
                x, y = images, labels
            losses.append(trainer.train_step(x, y)["loss"])
        losses += [out["loss"] for out in trainer.flush()]
        return model, losses

    (fresh, fresh_losses), (reused, reused_losses) = run(False), run(True)
    assert reused_losses == fresh_losses
    for (name, a), b in zip(fresh.named_parameters(), reused.parameters()):
        assert torch.equal(a, b), name
