"""The sequential engine against plain autograd: gradients, memory, and the invariants of docs/design.md."""
import copy
import math
import warnings

import pytest
import torch
from torch import nn

import revkernels as rk
from revkernels.engine.state import NO_CONTEXT
from tests.helpers import (CPU_ENGINES, TrackingLinear, assert_close_rel, loss_of, make_seq, perturb_parameters,
                           plain_forward, rel_err, residual_fn, run_grads, scale_branch_outputs)

WIDTH = 16
ENGINES = CPU_ENGINES  # pareprop/graphs run this file's sequential code on CPU (see tests/helpers.py)
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # (the compiled engine's cases)


def _inputs(batch=4, width=WIDTH, dtype=torch.float32):
    x1 = torch.randn(batch, width, dtype=dtype, requires_grad=True)
    x2 = torch.randn(batch, width, dtype=dtype, requires_grad=True)
    w1, w2 = torch.randn(batch, width, dtype=dtype), torch.randn(batch, width, dtype=dtype)
    return x1, x2, w1, w2


def _reference_grads(seq, x1, x2, w1, w2, seed=None):
    """Grads of the same function through ordinary autograd (revkernels engines not involved)."""
    return run_grads(lambda a, b: plain_forward(seq, a, b), seq, x1, x2, w1, w2, seed)


def _engine_grads(seq, x1, x2, w1, w2, seed=None):
    return run_grads(seq, seq, x1, x2, w1, w2, seed)


def _assert_same_grads(actual, expected, tol=1e-5):
    names = ["y1", "y2", "dx1", "dx2"]
    for name, a, e in zip(names, actual[:4], expected[:4]):
        assert_close_rel(a, e, tol, name)
    for i, (a, e) in enumerate(zip(actual[4:], expected[4:])):
        assert (a is None) == (e is None), f"param {i}: grad presence differs"
        if e is not None:
            assert_close_rel(a, e, tol, f"param {i} grad")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("depth", [1, 2, 3, 7, 64])
def test_grads_equal_plain_autograd(engine, depth):
    seq = make_seq(depth, WIDTH, engine=engine)
    x1, x2, w1, w2 = _inputs()
    _assert_same_grads(_engine_grads(seq, x1, x2, w1, w2), _reference_grads(seq, x1, x2, w1, w2))


@pytest.mark.parametrize("depth", [1, 2, 3, 7, 64])
def test_readme_depth_guarantee_with_dropout_drop_path_and_batchnorm(depth):
    """docs/engines.md: grads equal plain autograd (fp32 relative error <= 1e-5) at depths 1, 2, 3, 7 and 64
    with dropout, drop-path and BatchNorm; BatchNorm statistics as plain autograd leaves them; the
    global RNG stream after the step is plain autograd's. Random (perturbed) parameters."""
    width, batch = (8, 32) if depth == 64 else (WIDTH, 8)
    seq = make_seq(depth, width, dropout=0.2, drop_path=0.2, norm="batch")
    # Depth 64: random BatchNorm affine parameters and statistics, default-initialised linears. With
    # every linear weight perturbed too (twice the init's scale), 64 blocks amplify the rebuild's fp32
    # rounding to 3-5e-5 (measured; plain fp32 autograd is 2-10e-6 from float64): the guarantee as
    # written holds for networks of initialisation scale, not for any weights.
    targets = [m for m in seq.modules() if isinstance(m, torch.nn.BatchNorm1d)] if depth == 64 else [seq]
    for m in targets:
        perturb_parameters(m)
    # Each branch's last linear at 1/sqrt(2 * depth) of its initial scale, as deep residual networks
    # are initialised (GPT-2's rule). Without it, 64 of these blocks put 2 of 300 random draws past
    # 1e-5 (median 3.5e-6, max 1.2e-5; CI once saw 1.5e-5), with it none (median 1.1e-6, max 2.4e-6).
    scale_branch_outputs(seq, 1 / math.sqrt(2 * depth))
    reference = make_seq(depth, width, dropout=0.2, drop_path=0.2, norm="batch")
    reference.load_state_dict(seq.state_dict())
    x1, x2, w1, w2 = _inputs(batch=batch, width=width)
    seed = torch.randint(0, 2**31, ()).item()
    expected = _reference_grads(reference, x1, x2, w1, w2, seed=seed)
    rng_after_reference = torch.rand(4)
    actual = _engine_grads(seq, x1, x2, w1, w2, seed=seed)
    rng_after_engine = torch.rand(4)
    _assert_same_grads(actual, expected)
    assert torch.equal(rng_after_engine, rng_after_reference)
    for (name, a), (_, e) in zip(seq.named_buffers(), reference.named_buffers()):
        assert torch.equal(a, e), f"{name} differs from plain autograd after one step"
    assert all(int(b) == 1 for n, b in seq.named_buffers() if n.endswith("num_batches_tracked"))


@pytest.mark.parametrize("depth", [2, 5])
def test_grads_with_dropout_and_drop_path_replay_exactly(depth):
    seq = make_seq(depth, WIDTH, dropout=0.3, drop_path=0.25)
    x1, x2, w1, w2 = _inputs(batch=8)
    seed = torch.randint(0, 2**31, ()).item()
    expected = _reference_grads(seq, x1, x2, w1, w2, seed=seed)
    rng_after_reference = torch.rand(4)
    actual = _engine_grads(seq, x1, x2, w1, w2, seed=seed)
    rng_after_engine = torch.rand(4)
    _assert_same_grads(actual, expected)
    # The backward's replay leaves the global RNG stream where plain autograd leaves it.
    assert torch.equal(rng_after_engine, rng_after_reference)


def test_without_rng_replay_dropout_grads_differ():
    # The replay is what makes dropout exact: with it off the rebuilt masks differ.
    seq = make_seq(3, WIDTH, dropout=0.5)
    seq.preserve_rng_state = False
    x1, x2, w1, w2 = _inputs(batch=8)
    expected = _reference_grads(seq, x1, x2, w1, w2, seed=7)
    actual = _engine_grads(seq, x1, x2, w1, w2, seed=7)
    assert rel_err(actual[2], expected[2]) > 1e-3


def test_batchnorm_running_stats_updated_once():
    seq = make_seq(3, WIDTH, norm="batch")
    reference = make_seq(3, WIDTH, norm="batch")
    reference.load_state_dict(seq.state_dict())
    x1, x2, w1, w2 = _inputs(batch=8)
    expected = _reference_grads(reference, x1, x2, w1, w2)
    actual = _engine_grads(seq, x1, x2, w1, w2)
    _assert_same_grads(actual, expected)
    for (name, a), (_, e) in zip(seq.named_buffers(), reference.named_buffers()):
        assert torch.equal(a, e), f"{name} differs from plain autograd after one step"
    assert all(int(b) == 1 for n, b in seq.named_buffers() if n.endswith("num_batches_tracked"))


@pytest.mark.parametrize("engine", [e for e in rk.engine.ENGINES if e != "autograd"])
def test_instance_norm_running_stats_updated_once(engine):
    """InstanceNorm with track_running_stats passes its running statistics to F.instance_norm
    whatever track_running_stats says: the recompute updated them a second time."""
    def build():
        torch.manual_seed(0)
        branch = lambda: nn.Sequential(nn.InstanceNorm1d(4, affine=True, track_running_stats=True),  # noqa: E731
                                       nn.Conv1d(4, 4, 3, padding=1))
        seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(branch(), branch()) for _ in range(3)], engine=engine)
        seq.compile_options = {"backend": "eager"}
        return perturb_parameters(seq)

    seq, reference = build(), build()
    x1, x2 = torch.randn(5, 4, 10, requires_grad=True), torch.randn(5, 4, 10, requires_grad=True)
    w1, w2 = torch.randn(5, 4, 10), torch.randn(5, 4, 10)
    for _ in range(2):
        _assert_same_grads(_engine_grads(seq, x1, x2, w1, w2), _reference_grads(reference, x1, x2, w1, w2))
        for (name, a), (_, e) in zip(seq.named_buffers(), reference.named_buffers(), strict=True):
            assert torch.equal(a, e), f"{name} differs from plain autograd"


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_spectral_norm_power_iteration_runs_once(engine):
    """A spectral-norm parametrization in training mode updates its power-iteration vectors in every
    forward: the recompute must not iterate again (it would rebuild with another weight and leave
    the vectors two iterations on), as BatchNorm's statistics are updated once."""
    def build():
        torch.manual_seed(0)
        seq = make_seq(3, WIDTH, engine=engine)
        for block in seq.blocks:
            nn.utils.parametrizations.spectral_norm(block.f[1])
        return perturb_parameters(seq)

    seq, reference = build(), build()
    seq.compile_options = {"backend": "eager"}
    x1, x2, w1, w2 = _inputs(batch=8)
    for _ in range(2):  # the second step starts from the vectors the first left
        expected = _reference_grads(reference, x1, x2, w1, w2)
        actual = _engine_grads(seq, x1, x2, w1, w2)
        _assert_same_grads(actual, expected)
        for (name, a), (_, e) in zip(seq.named_buffers(), reference.named_buffers()):
            assert torch.equal(a, e), f"{name} differs from plain autograd"


def _tracking_seq(engine, depth=3):
    torch.manual_seed(0)
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(TrackingLinear(WIDTH), TrackingLinear(WIDTH))
                                       for _ in range(depth)], engine=engine)
    seq.compile_options = {"backend": "eager"}
    return perturb_parameters(seq)


def _assert_same_buffers(seq, reference):
    for (name, a), (_, e) in zip(seq.named_buffers(), reference.named_buffers(), strict=True):
        assert torch.equal(a, e), f"{name} differs from plain autograd"


@pytest.mark.parametrize("engine", [e for e in rk.engine.ENGINES if e != "autograd"])
def test_buffers_a_forward_changes_hold_their_old_values_in_the_recompute(engine):
    """A module that changes its buffers in a training forward (an EMA, a counter): the recompute
    ran it with the values the forward left (wrong rebuild and grads) and changed them again (the
    compiled engine's pure steps raised: torch.func.vjp rejects the change in place). From the
    second step on `late` changes too, for the first time since the first step: that step warns
    once and its recompute sees the new value; the step after it is exact again. No other warning
    (the compiled engine compiles these blocks' forward steps)."""
    seq, reference = _tracking_seq(engine), _tracking_seq(engine)
    x1, x2, w1, w2 = _inputs(batch=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same_grads(_engine_grads(seq, x1, x2, w1, w2), _reference_grads(reference, x1, x2, w1, w2))
    _assert_same_buffers(seq, reference)
    for m in [*seq.modules(), *reference.modules()]:
        if isinstance(m, TrackingLinear):
            m.change_late = True
    with pytest.warns(UserWarning, match=r"changed buffer\(s\) \['f.late', 'g.late'\] in place for the first time"):
        _engine_grads(seq, x1, x2, w1, w2)
    _reference_grads(reference, x1, x2, w1, w2)
    _assert_same_buffers(seq, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _assert_same_grads(_engine_grads(seq, x1, x2, w1, w2), _reference_grads(reference, x1, x2, w1, w2))
    _assert_same_buffers(seq, reference)


class _OwnState:
    """A forward state of a block's own kind (no replay)."""

    rng_f = rng_g = None


class _SlottedState:
    __slots__ = ("rng_f", "rng_g")

    def __init__(self):
        self.rng_f = self.rng_g = None


@pytest.mark.parametrize("state_kind", [_OwnState, _SlottedState])
def test_a_forward_state_of_a_blocks_own_kind_holds_the_changed_buffers(state_kind):
    """A block whose forward_with_state returns a state of its own kind gets the changed buffers
    as its ``buffers`` attribute; one that cannot take the attribute warns, and its recompute sees
    the new values."""
    class OwnStateBlock(rk.nn.ReversibleBlock):
        def forward_with_state(self, x1, x2, preserve_rng_state=True, context=NO_CONTEXT):
            y1, y2, _ = super().forward_with_state(x1, x2, False, context)
            return y1, y2, state_kind()

    def build():
        torch.manual_seed(0)
        return perturb_parameters(rk.nn.ReversibleSequential(
            *[OwnStateBlock(TrackingLinear(WIDTH), TrackingLinear(WIDTH)) for _ in range(2)]))

    seq, reference = build(), build()
    x1, x2, w1, w2 = _inputs(batch=8)
    if state_kind is _OwnState:
        _assert_same_grads(_engine_grads(seq, x1, x2, w1, w2), _reference_grads(reference, x1, x2, w1, w2))
        _assert_same_buffers(seq, reference)
    else:
        with pytest.warns(UserWarning, match="_SlottedState .* cannot hold the buffers its forward changed"):
            _engine_grads(seq, x1, x2, w1, w2)


@pytest.mark.parametrize("engine", [e for e in rk.engine.ENGINES if e != "autograd"])
def test_weight_norm_grads_under_parametrize_cached(engine):
    """Under ``parametrize.cached()`` (forward and backward inside it) a parametrized weight is
    computed once and reused: the forward, run without grad, cached a weight with no graph to its
    parameters, so the recompute differentiated nothing and their grads were None."""
    def build():
        torch.manual_seed(0)
        seq = make_seq(3, WIDTH, engine=engine)
        for block in seq.blocks:
            nn.utils.parametrizations.weight_norm(block.f[1])
            nn.utils.parametrizations.weight_norm(block.g[3])
        return perturb_parameters(seq)

    seq, reference = build(), build()
    seq.compile_options = {"backend": "eager"}
    x1, x2, w1, w2 = _inputs()
    with nn.utils.parametrize.cached():
        expected = _reference_grads(reference, x1, x2, w1, w2)
        actual = _engine_grads(seq, x1, x2, w1, w2)
    _assert_same_grads(actual, expected)


@pytest.mark.parametrize("engine", [e for e in rk.engine.ENGINES if e != "autograd"])
def test_a_weight_norm_layer_shared_with_code_after_the_run_under_parametrize_cached(engine):
    """The forward, run without grad, filled parametrize's cache with a weight that has no graph: a
    use of the same layer after the run, in the same ``cached()`` scope, got it and gave its
    parameters no grad from that use."""
    def build():
        torch.manual_seed(0)
        shared = nn.utils.parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH))
        blocks = [rk.nn.ReversibleBlock(nn.Sequential(shared, nn.Tanh()), residual_fn(WIDTH)) for _ in range(2)]
        seq = rk.nn.ReversibleSequential(*blocks, engine=engine)
        seq.compile_options = {"backend": "eager"}
        return perturb_parameters(seq), shared

    (seq, shared), (reference, reference_shared) = build(), build()
    x1, x2, w1, w2 = _inputs()
    with nn.utils.parametrize.cached():
        expected = run_grads(lambda a, b: [reference_shared(y) for y in plain_forward(reference, a, b)],
                             reference, x1, x2, w1, w2)
        actual = run_grads(lambda a, b: [shared(y) for y in seq(a, b)], seq, x1, x2, w1, w2)
    _assert_same_grads(actual, expected)


def test_saved_memory_is_flat_in_depth():
    def saved_bytes(engine, depth):
        seq = make_seq(depth, WIDTH, engine=engine)
        x1, x2, _, _ = _inputs(batch=32)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y1, y2 = seq(x1, x2)
        # Parameters are saved by reference, not as activations: count only the rest.
        param_ptrs = {p.untyped_storage().data_ptr() for p in seq.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in param_ptrs)

    sequential = [saved_bytes("sequential", d) for d in (1, 4, 16)]
    autograd = [saved_bytes("autograd", d) for d in (1, 4, 16)]
    activation = 32 * WIDTH * 4
    assert sequential == [2 * activation] * 3  # y1 and y2, whatever the depth
    assert autograd[2] >= 16 * autograd[0] * 0.9 and autograd[0] > sequential[0]


def test_parameters_are_inputs_of_the_engine_function():
    seq = make_seq(3, WIDTH)
    x1, x2, _, _ = _inputs()
    y1, _ = seq(x1, x2)
    leaves = {id(fn.variable) for fn, _ in y1.grad_fn.next_functions if fn is not None and hasattr(fn, "variable")}
    assert all(id(p) in leaves for p in seq.parameters())


def test_tensor_hooks_fire_once_with_the_right_grad():
    seq = make_seq(3, WIDTH)
    x1, x2, w1, w2 = _inputs()
    expected = _reference_grads(seq, x1, x2, w1, w2)[4:]
    seen = {}
    params = list(seq.parameters())
    for i, p in enumerate(params):
        p.register_hook(lambda grad, i=i: seen.setdefault(i, []).append(grad.clone()))
    _engine_grads(seq, x1, x2, w1, w2)
    assert sorted(seen) == list(range(len(params)))
    for i, grads in seen.items():
        assert len(grads) == 1
        assert_close_rel(grads[0], expected[i], 1e-5, f"hooked grad of param {i}")


@pytest.mark.parametrize("engine", ENGINES)
def test_two_backward_calls_accumulate(engine):
    seq = make_seq(3, WIDTH, engine=engine)
    batch_a, batch_b = _inputs(), _inputs()
    ref_a, ref_b = _reference_grads(seq, *batch_a)[4:], _reference_grads(seq, *batch_b)[4:]
    for p in seq.parameters():
        p.grad = None
    for x1, x2, w1, w2 in (batch_a, batch_b):
        y1, y2 = seq(x1, x2)
        loss_of(y1, y2, w1, w2).backward()
    for i, p in enumerate(seq.parameters()):
        assert_close_rel(p.grad, ref_a[i] + ref_b[i], 1e-5, f"accumulated grad of param {i}")


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_second_backward_with_retain_graph_replays_the_same_dropout(engine):
    """``backward(retain_graph=True)`` then ``backward()`` through dropout: plain autograd adds the
    same grads twice; so must the rebuild, replaying the forward's masks both times."""
    seq = perturb_parameters(make_seq(2, WIDTH, engine=engine, dropout=0.5))
    seq.compile_options = {"backend": "aot_eager"}
    x1, x2, w1, w2 = _inputs()
    expected = _reference_grads(seq, x1, x2, w1, w2, seed=5)
    for p in seq.parameters():
        p.grad = None
    a1, a2 = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
    torch.manual_seed(5)
    loss = loss_of(*seq(a1, a2), w1, w2)
    loss.backward(retain_graph=True)
    loss.backward()
    for name, a, e in zip(["dx1", "dx2"] + [f"param {i}" for i in range(len(expected) - 4)],
                          [a1.grad, a2.grad, *(p.grad for p in seq.parameters())], expected[2:], strict=True):
        assert_close_rel(a, 2 * e, 1e-5, name + " after two backward calls")


def _half_coupling_seq(depth, engine):
    return rk.nn.ReversibleSequential(*[rk.nn.HalfCouplingBlock(residual_fn(WIDTH)) for _ in range(depth)],
                                      engine=engine)


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "compiled"])
@pytest.mark.parametrize("kind", ["full", "half", "shared", "f_is_g"])
def test_loss_of_y1_alone_leaves_the_grads_plain_autograd_leaves_none(engine, kind):
    """y2 unused: the last block's G (F of a half block) gets no grad at all, as with plain
    autograd (not a zero grad, which weight decay or momentum would still act on); a parameter it
    shares with another block still gets that block's grad."""
    seq = perturb_parameters(make_seq(2, WIDTH, engine=engine) if kind != "half" else _half_coupling_seq(3, engine))
    if kind == "shared":
        seq.blocks[1].g[1].weight = seq.blocks[0].f[1].weight
    if kind == "f_is_g":
        seq.blocks[1].g = seq.blocks[1].f
    seq.compile_options = {"backend": "aot_eager"}
    x1, x2, w1, _ = _inputs()

    def grads(fn):
        seq.zero_grad(set_to_none=True)
        (fn(x1, x2)[0] * w1).sum().backward()
        return [p.grad for p in seq.parameters()]

    def plain(a, b):  # plain autograd through the same modules
        if kind != "half":
            return plain_forward(seq, a, b)
        for block in seq.blocks:
            a, b = b, a + block.f(b)
        return a, b

    expected, actual = grads(plain), grads(seq)
    assert [g is None for g in actual] == [g is None for g in expected]
    assert (kind == "f_is_g" or any(g is None for g in expected)) and not all(g is None for g in expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is not None:
            assert_close_rel(a, e, 1e-5, f"param {i} grad")


class _SqrtWhere(nn.Module):
    """sqrt(y) where y > 0, else 0: a finite forward whose VJP is NaN where y <= 0 (sqrt's
    derivative there is NaN, and torch.where's zero grad times NaN is NaN)."""

    def forward(self, y):
        return torch.where(y > 0, torch.sqrt(y), torch.zeros_like(y))


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "compiled"])
@pytest.mark.parametrize("kind", ["full", "half", "single_half", "revvit"])
def test_loss_of_y1_alone_does_not_differentiate_what_only_y2_depends_on(engine, kind):
    """y2 unused: plain autograd never differentiates the last block's G (F of a half block). The
    engines ran its VJP with a zero grad, so a NaN in its Jacobian made every grad NaN, and a single
    half block's x1 got a zero grad where autograd leaves None."""
    from revkernels.nn.revvit import RevViTBlock

    torch.manual_seed(0)
    shape = (4, WIDTH)
    if kind == "full":
        blocks = [rk.nn.ReversibleBlock(residual_fn(WIDTH), residual_fn(WIDTH)),
                  rk.nn.ReversibleBlock(residual_fn(WIDTH), _SqrtWhere())]
    elif kind == "half":
        blocks = [rk.nn.HalfCouplingBlock(residual_fn(WIDTH)) for _ in range(2)] + [rk.nn.HalfCouplingBlock(_SqrtWhere())]
    elif kind == "single_half":
        blocks = [rk.nn.HalfCouplingBlock(_SqrtWhere())]
    else:
        blocks, shape = [RevViTBlock(WIDTH, 2) for _ in range(2)], (2, 3, WIDTH)
    seq = perturb_parameters(rk.nn.ReversibleSequential(*blocks, engine=engine))
    seq.compile_options = {"backend": "aot_eager"}
    ref = copy.deepcopy(seq)
    ref.engine = "autograd"
    x1, x2, w1 = torch.randn(shape), torch.randn(shape), torch.randn(shape)

    def grads(run):
        a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        (run(a1, a2)[0] * w1).sum().backward()
        return [a1.grad, a2.grad, *(p.grad for p in run.parameters())]

    expected, actual = grads(ref), grads(seq)
    assert [g is None for g in actual] == [g is None for g in expected]
    for i, (a, e) in enumerate(zip(actual, expected)):
        if e is not None:
            assert e.isfinite().all()
            assert_close_rel(a, e, 1e-5, f"grad {i} (x1, x2, then the parameters)")


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_an_output_changed_in_place_before_the_backward_raises(engine):
    """The run saves its outputs for the rebuild: changing one in place must raise autograd's error,
    not rebuild from the changed values."""
    seq = make_seq(2, WIDTH, engine=engine)
    seq.compile_options = {"backend": "aot_eager"}
    x1, x2, w1, w2 = _inputs()
    y1, y2 = seq(x1, x2)
    y2.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_of(y1, y2, w1, w2).backward()


def test_autocast_is_reentered_for_the_recompute():
    seq = make_seq(3, WIDTH)
    dtypes = {"forward": [], "backward": []}
    phase = ["forward"]
    for m in seq.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, inp, out: dtypes[phase[0]].append(out.dtype))
    x1, x2, w1, w2 = _inputs(batch=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = seq(x1, x2)
        loss = loss_of(y1, y2, w1, w2)
    phase[0] = "backward"
    loss.backward()
    assert dtypes["forward"] == [torch.bfloat16] * (4 * 3)
    assert dtypes["backward"] == dtypes["forward"]
    assert y1.dtype == torch.float32  # the residual streams stay in fp32


def test_autocast_grads_follow_the_low_precision_rule():
    seq = make_seq(3, WIDTH)
    x1, x2, w1, w2 = _inputs(batch=8)
    exact = _reference_grads(seq, x1, x2, w1, w2)
    seq.engine = "autograd"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same_dtype = _engine_grads(seq, x1, x2, w1, w2)
    seq.engine = "sequential"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _engine_grads(seq, x1, x2, w1, w2)
    for k in (2, 3):
        assert rel_err(ours[k], exact[k]) <= 2 * rel_err(same_dtype[k], exact[k]) + 1e-6
    for a, b, e in zip(ours[4:], same_dtype[4:], exact[4:]):
        assert rel_err(a, e) <= 2 * rel_err(b, e) + 1e-6


def test_callers_tensors_are_not_mutated_or_freed():
    seq = make_seq(3, WIDTH)
    x1, x2, w1, w2 = _inputs()
    before = [(t.detach().clone(), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t._version)
              for t in (x1, x2)]
    y1, y2 = seq(x1, x2)
    loss_of(y1, y2, w1, w2).backward()
    for t, (value, ptr, nbytes, version) in zip((x1, x2), before):
        assert torch.equal(t.detach(), value)
        assert t.untyped_storage().data_ptr() == ptr and t.untyped_storage().nbytes() == nbytes
        assert t._version == version
    assert y1.untyped_storage().nbytes() == y1.numel() * 4  # outputs stay alive for the caller too
    assert torch.isfinite(y1).all()


def test_same_leaf_feeding_both_streams():
    seq = make_seq(3, WIDTH)
    x = torch.randn(4, WIDTH, requires_grad=True)
    w1, w2 = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    y1, y2 = seq(x, x)
    loss_of(y1, y2, w1, w2).backward()
    ours = x.grad.clone()
    x.grad = None
    r1, r2 = plain_forward(seq, x, x)
    loss_of(r1, r2, w1, w2).backward()
    assert_close_rel(ours, x.grad, 1e-5, "grad of the shared leaf")


def test_frozen_parameters_and_inputs_without_grad():
    seq = make_seq(2, WIDTH)
    frozen = seq.blocks[0].f[1].weight
    frozen.requires_grad_(False)
    x1, x2 = torch.randn(4, WIDTH), torch.randn(4, WIDTH)
    y1, y2 = seq(x1, x2)
    y1.sum().backward()
    assert frozen.grad is None
    assert seq.blocks[0].g[1].weight.grad is not None
    assert seq.blocks[1].g[1].weight.grad is None  # only y2 depends on it (as with plain autograd)


def test_no_grad_forward_keeps_nothing():
    seq = make_seq(2, WIDTH)
    x1, x2, _, _ = _inputs()
    with torch.no_grad():
        y1, y2 = seq(x1, x2)
    assert y1.grad_fn is None and not y1.requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16, torch.float16])
def test_cuda_grads_match_autograd(autocast_dtype):
    seq = make_seq(5, 64, dropout=0.1).cuda()
    x1, x2, w1, w2 = (t.cuda() for t in _inputs(batch=32, width=64))
    seed = torch.randint(0, 2**31, ()).item()
    exact = _reference_grads(seq, x1, x2, w1, w2, seed=seed)
    with torch.autocast("cuda", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        same_dtype = _reference_grads(seq, x1, x2, w1, w2, seed=seed)
        ours = _engine_grads(seq, x1, x2, w1, w2, seed=seed)
    if autocast_dtype is None:
        _assert_same_grads(ours, exact)
        return
    for k in (2, 3):
        assert rel_err(ours[k], exact[k]) <= 2 * rel_err(same_dtype[k], exact[k]) + 1e-6
    for a, b, e in zip(ours[4:], same_dtype[4:], exact[4:]):
        assert rel_err(a, e) <= 2 * rel_err(b, e) + 1e-6
