"""ReversibleBlock / ReversibleSequential: the coupling itself, inverse, reverse, checks, bad input."""
import pytest
import torch
from torch import nn

import revkernels as rk
from tests.helpers import (TrackingLinear, assert_close_rel, grads_of, loss_of, make_seq, perturb_parameters, plain_forward,
                           residual_fn)

WIDTH = 12


def _streams(batch=5, width=WIDTH, requires_grad=False):
    return (torch.randn(batch, width, requires_grad=requires_grad),
            torch.randn(batch, width, requires_grad=requires_grad))


def test_block_forward_is_the_coupling():
    f, g = residual_fn(WIDTH), residual_fn(WIDTH)
    block = rk.nn.ReversibleBlock(f, g)
    x1, x2 = _streams()
    y1, y2 = block(x1, x2)
    e1 = x1 + f(x2)
    torch.testing.assert_close(y1, e1, rtol=0, atol=0)
    torch.testing.assert_close(y2, x2 + g(e1), rtol=0, atol=0)


@pytest.mark.parametrize("depth", [1, 4])
def test_inverse_rebuilds_the_input(depth):
    seq = make_seq(depth, WIDTH)
    x1, x2 = _streams()
    with torch.no_grad():
        y1, y2 = seq(x1, x2)
    r1, r2 = seq.inverse(y1, y2)
    assert_close_rel(r1, x1, 1e-5, "x1")
    assert_close_rel(r2, x2, 1e-5, "x2")


def test_reverse_gives_inputs_input_grads_and_accumulates_param_grads():
    seq = make_seq(3, WIDTH)
    x1, x2 = _streams(requires_grad=True)
    w1, w2 = torch.randn(5, WIDTH), torch.randn(5, WIDTH)
    y1, y2 = plain_forward(seq, x1, x2)
    loss_of(y1, y2, w1, w2).backward()
    expected = grads_of(seq.parameters())
    dy1, dy2 = w1, 2 * y2.detach() * w2  # d loss / d (y1, y2)

    existing = [torch.randn_like(p) for p in seq.parameters()]
    for p, e in zip(seq.parameters(), existing):
        p.grad = e.clone()
    r1, r2, dx1, dx2 = seq.reverse(y1.detach(), y2.detach(), dy1, dy2)
    assert_close_rel(r1, x1.detach(), 1e-5, "x1")
    assert_close_rel(r2, x2.detach(), 1e-5, "x2")
    assert_close_rel(dx1, x1.grad, 1e-5, "dx1")
    assert_close_rel(dx2, x2.grad, 1e-5, "dx2")
    assert not any(t.requires_grad for t in (r1, r2, dx1, dx2))
    for i, (p, e, before) in enumerate(zip(seq.parameters(), expected, existing)):
        assert_close_rel(p.grad - before, e, 1e-5, f"param {i} grad added by reverse")


def test_reverse_with_states_replays_the_forwards_dropout():
    # the states forward_step returned: the rebuild draws the forward's masks (reverse draws anew)
    from revkernels.engine.sequential import forward_step

    seq = make_seq(3, WIDTH, dropout=0.4)
    x1, x2 = _streams(requires_grad=True)
    w1, w2 = torch.randn(5, WIDTH), torch.randn(5, WIDTH)
    torch.manual_seed(3)
    y1, y2 = plain_forward(seq, x1, x2)
    loss_of(y1, y2, w1, w2).backward()
    expected = grads_of(seq.parameters())
    for p in seq.parameters():
        p.grad = None
    torch.manual_seed(3)
    a1, a2, states = x1.detach(), x2.detach(), []
    with torch.no_grad():
        for block in seq.blocks:
            a1, a2, state = forward_step(block, a1, a2, True)
            states.append(state)
    assert torch.equal(a1, y1.detach()) and torch.equal(a2, y2.detach())
    dy1, dy2 = w1, 2 * y2.detach() * w2
    r1, r2, dx1, dx2 = seq.reverse_with_states(a1, a2, dy1, dy2, states)
    for got, want, name in ((r1, x1.detach(), "x1"), (r2, x2.detach(), "x2"), (dx1, x1.grad, "dx1"),
                            (dx2, x2.grad, "dx2")):
        assert_close_rel(got, want, 1e-5, name)
    for i, (got, want) in enumerate(zip(grads_of(seq.parameters()), expected, strict=True)):
        assert_close_rel(got, want, 1e-5, f"param {i}")
    with pytest.raises(ValueError, match=r"states must be a list of one state per block \(3; .*got 2 states"):
        seq.reverse_with_states(a1, a2, dy1, dy2, states[:2])
    with pytest.raises(ValueError, match="states must be a list of one state per block .* got generator"):
        seq.reverse_with_states(a1, a2, dy1, dy2, (s for s in states))
    with pytest.raises(TypeError, match="context must be a dict of the forward's keywords or None, got list"):
        seq.reverse_with_states(a1, a2, dy1, dy2, states, [])


class _AddTable(nn.Module):
    """``tanh(x) + table``: the table's grad is the incoming grad itself."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, WIDTH))

    def forward(self, x):
        return torch.tanh(x) + self.table


def test_reverse_stores_no_grad_that_aliases_the_callers_tensors():
    """The tables' grads are dy2 and dy1 + ... themselves: writing to ``.grad`` afterwards (clipping,
    a second reverse) must change neither the caller's dy1/dy2 nor the returned grads."""
    seq = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(_AddTable(), _AddTable()))
    x1, x2 = _streams()
    y1, y2 = plain_forward(seq, x1, x2)
    dy1, dy2 = torch.randn(5, WIDTH), torch.randn(5, WIDTH)
    caller = [dy1.clone(), dy2.clone()]
    _, _, dx1, dx2 = seq.reverse(y1.detach(), y2.detach(), dy1, dy2)
    returned = [dx1.clone(), dx2.clone()]
    assert torch.equal(seq.blocks[0].g.table.grad, dy2)  # the case: a grad equal to dy2
    for p in seq.parameters():
        p.grad.mul_(0.5)
    seq.reverse(y1.detach(), y2.detach(), dy1, dy2)
    assert torch.equal(dy1, caller[0]) and torch.equal(dy2, caller[1])
    assert torch.equal(dx1, returned[0]) and torch.equal(dx2, returned[1])
    assert_close_rel(seq.blocks[0].g.table.grad, 1.5 * dy2, 1e-6, "g.table grad after two reverse calls")


def test_check_reversibility_reports_per_block_errors_and_changes_no_state():
    seq = make_seq(4, WIDTH, norm="batch", dropout=0.2)
    x1, x2 = _streams(batch=8)
    buffers = {k: v.clone() for k, v in seq.state_dict().items()}
    rng = torch.get_rng_state()
    report = rk.check_reversibility(seq, x1, x2)
    assert len(report.block_errors) == len(report.chained_errors) == 4
    assert 0 <= report.max_error < 1e-5
    assert "block" in str(report) and "chained" in str(report)
    assert all(torch.equal(v, seq.state_dict()[k]) for k, v in buffers.items())
    assert torch.equal(rng, torch.get_rng_state())


def test_check_reversibility_of_blocks_changing_their_buffers_changes_no_state():
    """Blocks whose forward changes buffers (an EMA, a counter): the inverse rebuilt with the
    changed values (errors ~1e-1, a false alarm) and the check left the buffers changed."""
    torch.manual_seed(0)
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(TrackingLinear(WIDTH), TrackingLinear(WIDTH))
                                       for _ in range(3)])
    x1, x2 = _streams(batch=8)
    for _ in range(2):  # the second check starts from buffers the first put back
        held = dict(seq.named_buffers())
        buffers = {k: v.clone() for k, v in seq.state_dict().items()}
        assert rk.check_reversibility(seq, x1, x2).max_error < 1e-5
        assert all(torch.equal(v, seq.state_dict()[k]) for k, v in buffers.items())
        assert all(t is held[name] for name, t in seq.named_buffers())  # the same tensors


def test_inverse_and_reverse_leave_the_buffers_a_rebuild_changes():
    """Without a forward record (`seq.inverse`, `seq.reverse`, PETRA's stage workers) the rebuild
    ran the blocks' training forward again, which changed their buffers (an EMA, a counter) a
    second time; now they are put back (the same tensors, the same values)."""
    torch.manual_seed(0)
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(TrackingLinear(WIDTH), TrackingLinear(WIDTH))
                                       for _ in range(2)])
    for m in seq.modules():
        if isinstance(m, TrackingLinear):
            m.change_late = True
    x1, x2 = _streams(batch=8)
    with torch.no_grad():
        y1, y2 = seq(x1, x2)
    for rebuild in (lambda: seq.inverse(y1, y2), lambda: seq.reverse(y1, y2, torch.randn_like(y1), torch.randn_like(y2)),
                    lambda: seq.blocks[0].inverse(y1, y2)):
        held = dict(seq.named_buffers())
        values = {k: v.clone() for k, v in held.items()}
        rebuild()
        for name, t in seq.named_buffers():
            assert t is held[name] and torch.equal(t, values[name]), name


def test_check_reversibility_detects_a_non_invertible_setup():
    class Drifting(nn.Module):
        """Returns something different on every call: the inverse cannot rebuild the input."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * self.calls

    seq = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(Drifting(), residual_fn(WIDTH)))
    assert rk.check_reversibility(seq, *_streams()).max_error > 0.1


def test_state_dict_round_trip():
    a, b = make_seq(2, WIDTH), make_seq(2, WIDTH)
    b.load_state_dict(a.state_dict())
    x1, x2 = _streams()
    with torch.no_grad():
        torch.testing.assert_close(a(x1, x2), b(x1, x2), rtol=0, atol=0)


def test_engine_can_be_switched():
    seq = make_seq(2, WIDTH, engine="autograd")
    assert seq.engine == "autograd"
    seq.engine = "sequential"
    assert seq.engine == "sequential"


@pytest.mark.parametrize("engine", [e for e in rk.engine.ENGINES if e != "autograd"])
def test_lazy_modules_initialize_in_the_first_step(engine):
    """A lazy module creates its parameters in its first forward: the memory-saving engines took
    the uninitialized ones as inputs of their Function and failed in the backward ("invalid
    gradient ... shape compatible with [0]"). The first step runs plain autograd; the next ones
    the engine; both give plain autograd's grads."""
    def build(engine):
        torch.manual_seed(0)
        blocks = [rk.nn.ReversibleBlock(nn.Sequential(nn.LazyLinear(WIDTH), nn.Tanh()),
                                        nn.Sequential(nn.LazyLinear(WIDTH), nn.GELU())) for _ in range(2)]
        seq = rk.nn.ReversibleSequential(*blocks, engine=engine)
        seq.compile_options = {"backend": "eager"}
        return seq

    seq, reference = build(engine), build("autograd")
    w1, w2 = torch.randn(5, WIDTH), torch.randn(5, WIDTH)
    for step in range(2):
        x1, x2 = _streams(requires_grad=True)
        results = []
        for model in (seq, reference):
            for p in model.parameters():
                p.grad = None
            a, b = x1.detach().requires_grad_(), x2.detach().requires_grad_()
            torch.manual_seed(step)  # the lazy modules draw their initial weights in the first step
            y1, y2 = model(a, b)
            if model is seq:  # the engine's autograd Function (a Python one) from the second step on
                assert isinstance(y1.grad_fn, torch.autograd.function.BackwardCFunction) == (step == 1)
            loss_of(y1, y2, w1, w2).backward()
            results.append([y1, y2, a.grad, b.grad] + grads_of(model.parameters()))
        for i, (got, expected) in enumerate(zip(*results, strict=True)):
            assert_close_rel(got, expected, 1e-5, f"step {step}: output/grad {i}")


@pytest.mark.parametrize("wrt", ["parameters", "input"])
@pytest.mark.parametrize("engine", [e for e in rk.engine.ENGINES if e != "autograd"])
def test_a_second_backward_restricted_to_some_inputs_raises_too(engine, wrt):
    """``torch.autograd.grad(penalty, parameters or x, allow_unused=True)``: the node that raises
    lies on the path to every input of the run (it hung off fresh leaves, so a restricted backward
    found no path to it and returned None for every input, silently)."""
    seq = make_seq(2, WIDTH, engine=engine)
    seq.compile_options = {"backend": "eager"}
    x = torch.randn(5, WIDTH, requires_grad=True)
    y1, y2 = seq(x, x)
    (dx,) = torch.autograd.grad(y1.square().sum() + y2.sum(), x, create_graph=True)
    inputs = list(seq.parameters()) if wrt == "parameters" else [x]
    with pytest.raises(RuntimeError, match="differentiate twice"):
        torch.autograd.grad(dx.square().sum(), inputs, allow_unused=True)


@pytest.mark.parametrize("loss", ["quadratic", "linear"])
@pytest.mark.parametrize("engine", rk.engine.ENGINES)
def test_gradient_penalty_needs_the_autograd_engine(engine, loss):
    """docs/support.md, limits: a loss built with create_graph=True through a memory-saving run raises (its
    backward is not differentiable), also where the loss is linear in the run's outputs (whose grads
    then do not require grad: the penalty lost its second-order term, silently); the autograd engine
    gives plain autograd's second-order grads."""
    seq = make_seq(2, WIDTH, engine=engine)
    seq.compile_options = {"backend": "eager"}
    x = torch.randn(5, WIDTH, requires_grad=True)

    def penalty(run):
        y1, y2 = run(x, x)
        out = y1.square().sum() + y2.sum() if loss == "quadratic" else y1.sum() + 2 * y2.sum()
        (dx,) = torch.autograd.grad(out, x, create_graph=True)
        dx.square().sum().backward()
        return grads_of(seq.parameters())

    if engine != "autograd":
        with pytest.raises(RuntimeError, match="differentiate twice"):
            penalty(seq)
        return
    got = penalty(seq)
    for p in seq.parameters():
        p.grad = None
    for a, b in zip(got, penalty(lambda a, b: plain_forward(seq, a, b)), strict=True):
        assert (a is None) == (b is None)  # (the last biases do not move dx)
        if b is not None:
            assert_close_rel(a, b, 1e-5)


@pytest.mark.parametrize("engine", rk.engine.ENGINES)
def test_gradient_penalty_first_order_grads_equal_plain_autograd(engine):
    """create_graph=True through a memory-saving run still returns the first-order grads."""
    seq = perturb_parameters(make_seq(2, WIDTH, engine=engine))
    seq.compile_options = {"backend": "eager"}
    x = torch.randn(5, WIDTH, requires_grad=True)
    got = torch.autograd.grad(sum(y.sum() for y in seq(x, x)), [x, *seq.parameters()], create_graph=True)
    expected = torch.autograd.grad(sum(y.sum() for y in plain_forward(seq, x, x)), [x, *seq.parameters()])
    for a, b in zip(got, expected, strict=True):
        assert_close_rel(a, b, 1e-5)


@pytest.mark.parametrize("engine", rk.engine.ENGINES)
def test_a_parameter_changed_in_place_before_the_backward_raises_autograds_error(engine):
    """An optimizer step (any in-place change of a parameter) between a forward and its backward:
    plain autograd raises, as the memory-saving engines must (they rebuild the activations from
    the parameters: the grads would be those at the new values, silently); the error names the
    parameter. A change after the backward is the normal step."""
    seq = make_seq(2, WIDTH, engine=engine)
    seq.compile_options = {"backend": "eager"}
    x1, x2 = _streams(requires_grad=True)
    y1, y2 = seq(x1, x2)
    with torch.no_grad():
        seq.blocks[1].f[1].weight.mul_(0.5)
    match = "modified by an inplace operation" + ("" if engine == "autograd" else ".*blocks.1.f.1.weight")
    with pytest.raises(RuntimeError, match=match):
        (y1.square().sum() + y2.sum()).backward()
    y1, y2 = seq(x1, x2)
    (y1.square().sum() + y2.sum()).backward()
    with torch.no_grad():
        seq.blocks[1].f[1].weight.mul_(0.5)


@pytest.mark.parametrize("engine", rk.engine.ENGINES)
def test_torch_func_transforms_need_the_autograd_engine(engine):
    """docs/support.md, limits: torch.func.grad through a memory-saving run raises torch's error; through the
    autograd engine it gives plain autograd's parameter grads."""
    seq = make_seq(2, WIDTH, engine=engine)
    seq.compile_options = {"backend": "eager"}
    params = {name: p.detach() for name, p in seq.named_parameters()}
    x1, x2 = _streams()

    def loss(p):
        return torch.func.functional_call(seq, p, (x1, x2))[1].square().sum()

    if engine != "autograd":
        with pytest.raises(RuntimeError, match="functorch transforms"):
            torch.func.grad(loss)(params)
        return
    got = torch.func.grad(loss)(params)
    plain_forward(seq, x1, x2)[1].square().sum().backward()
    for name, p in seq.named_parameters():
        assert_close_rel(got[name], p.grad, 1e-5, name)


# --- bad input: a clear exception naming the argument -------------------------------------------

def test_streams_of_different_shapes():
    seq = make_seq(1, WIDTH)
    with pytest.raises(ValueError, match="x1 and x2 must have the same shape"):
        seq(torch.randn(5, WIDTH), torch.randn(4, WIDTH))


def test_streams_of_different_dtypes():
    seq = make_seq(1, WIDTH)
    with pytest.raises(ValueError, match="x1 and x2 must have the same dtype"):
        seq(torch.randn(5, WIDTH), torch.randn(5, WIDTH, dtype=torch.float64))


def test_streams_on_different_devices():
    block = rk.nn.ReversibleBlock(nn.Identity(), nn.Identity())
    with pytest.raises(ValueError, match="x1 and x2 must be on the same device"):
        block(torch.randn(5, WIDTH), torch.randn(5, WIDTH, device="meta"))


def test_stream_that_is_not_a_tensor_or_not_float():
    seq = make_seq(1, WIDTH)
    with pytest.raises(TypeError, match="x2 must be a torch.Tensor"):
        seq(torch.randn(5, WIDTH), [1.0])
    with pytest.raises(TypeError, match="x1 must be a floating-point tensor"):
        seq(torch.ones(5, WIDTH, dtype=torch.int64), torch.randn(5, WIDTH))


@pytest.mark.parametrize("bad", ["f", "g"])
def test_f_or_g_that_changes_the_shape(bad):
    good, wrong = residual_fn(WIDTH), nn.Linear(WIDTH, WIDTH + 1)
    block = rk.nn.ReversibleBlock(wrong if bad == "f" else good, wrong if bad == "g" else good)
    for engine in ("autograd", "sequential"):
        seq = rk.nn.ReversibleSequential(block, engine=engine)
        with pytest.raises(ValueError, match=f"{bad} must preserve the shape"):
            seq(*_streams(requires_grad=True))


class _Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


@pytest.mark.parametrize("dtype,error,message", [
    (torch.float64, ValueError, "f returned torch.float64, which would promote the x1 stream"),
    (torch.int64, TypeError, "f must return a floating-point tensor, got torch.int64"),
])
def test_f_that_returns_another_dtype(dtype, error, message):
    block = rk.nn.ReversibleBlock(_Cast(dtype), residual_fn(WIDTH))
    with pytest.raises(error, match=message):
        block(*_streams())


@pytest.mark.parametrize("bad", ["f", "g"])
def test_f_or_g_that_is_not_a_module(bad):
    with pytest.raises(TypeError, match=f"{bad} must be a torch.nn.Module"):
        rk.nn.ReversibleBlock(torch.tanh if bad == "f" else nn.Identity(), torch.tanh if bad == "g" else nn.Identity())


def test_blocks_that_are_not_reversible_blocks():
    with pytest.raises(TypeError, match=r"blocks\[1\] must be a revkernels.nn.ReversibleBlock"):
        rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(nn.Identity(), nn.Identity()), nn.Linear(3, 3))
    with pytest.raises(ValueError, match="at least one block"):
        rk.nn.ReversibleSequential()


def test_unknown_engine():
    with pytest.raises(ValueError, match="engine must be one of"):
        make_seq(1, WIDTH, engine="magic")
    seq = make_seq(1, WIDTH)
    with pytest.raises(ValueError, match="engine must be one of"):
        seq.engine = "nope"
    assert seq.engine == "sequential"


@pytest.mark.parametrize("which", ["dy1", "dy2"])
def test_reverse_with_gradients_of_the_wrong_shape(which):
    seq = make_seq(2, WIDTH)
    y1, y2 = _streams()
    good, bad = torch.randn(5, WIDTH), torch.randn(5, WIDTH + 1)
    with pytest.raises(ValueError, match=f"{which} must have the shape of the output"):
        seq.reverse(y1, y2, bad if which == "dy1" else good, bad if which == "dy2" else good)
    with pytest.raises(TypeError, match=f"{which} must be a torch.Tensor"):
        seq.reverse(y1, y2, None if which == "dy1" else good, None if which == "dy2" else good)


def test_reverse_casts_each_output_grad_to_its_outputs_dtype():
    # (as autograd does; reverse returned dx1 and dx2 in the grads' mixed dtypes)
    seq = make_seq(2, WIDTH)
    x1, x2 = _streams(requires_grad=True)
    dy1, dy2 = torch.randn(5, WIDTH, dtype=torch.float64), torch.randn(5, WIDTH, dtype=torch.bfloat16)
    y1, y2 = plain_forward(seq, x1, x2)
    torch.autograd.backward((y1, y2), (dy1, dy2))
    expected = [x1.grad, x2.grad, *grads_of(seq.parameters())]
    seq.zero_grad(set_to_none=True)
    _, _, dx1, dx2 = seq.reverse(y1.detach(), y2.detach(), dy1, dy2)
    assert dx1.dtype == dx2.dtype == torch.float32
    for i, (got, want) in enumerate(zip([dx1, dx2, *grads_of(seq.parameters())], expected, strict=True)):
        assert_close_rel(got, want, 1e-5, f"grad {i}")
    exact = rk.nn.ReversibleSequential(*make_seq(1, WIDTH).blocks, exact=True)  # (streams int64: no dtype to cast to)
    f1, f2 = (torch.randint(-2 ** 20, 2 ** 20, (5, WIDTH)) for _ in range(2))
    with pytest.raises(TypeError, match="dy2 must have dy1's dtype"):
        exact.reverse(f1, f2, dy1, dy2)


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_half_coupling_blocks_match_plain_autograd(depth):
    fs = [residual_fn(WIDTH, dropout=0.2) for _ in range(depth)]
    seq = rk.nn.ReversibleSequential(*[rk.nn.HalfCouplingBlock(f) for f in fs])
    x1, x2 = _streams(requires_grad=True)
    w1, w2 = torch.randn(5, WIDTH), torch.randn(5, WIDTH)

    def plain(a1, a2):
        for f in fs:
            a1, a2 = a2, a1 + f(a2)
        return a1, a2

    results = []
    for fn in (plain, seq):
        for p in seq.parameters():
            p.grad = None
        a1, a2 = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
        torch.manual_seed(11)
        y1, y2 = fn(a1, a2)
        loss_of(y1, y2, w1, w2).backward()
        results.append([y1.detach(), y2.detach(), a1.grad, a2.grad] + grads_of(seq.parameters()))
    for i, (a, e) in enumerate(zip(results[1], results[0])):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")
    with torch.no_grad():
        seq.eval()
        y1, y2 = seq(x1, x2)
        r1, r2 = seq.inverse(y1, y2)
    assert_close_rel(r1, x1.detach(), 1e-5, "x1")
    assert_close_rel(r2, x2.detach(), 1e-5, "x2")


def test_half_coupling_block_needs_a_module():
    with pytest.raises(TypeError, match="f must be a torch.nn.Module"):
        rk.nn.HalfCouplingBlock(torch.tanh)
