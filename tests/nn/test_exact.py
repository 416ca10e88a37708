"""Exact mode (ReversibleSequential(exact=True)): fixed-point streams, a bit-exact rebuild.

The references are written in the tests: the fixed-point network as plain PyTorch
(`tests.helpers.fixed_point_forward`: round to the grid, integer adds, float views, straight-through
gradients), and the rebuilt block inputs compared with the forward's int64 streams element by
element. tests/engine/test_conformance.py runs the design's invariants in exact mode too."""
import warnings

import pytest
import torch
from torch import nn

import revkernels as rk
from revkernels.check import monitor_reconstruction
from revkernels.models import revnet18, revswin, revtext, revvit
from revkernels.nn import HalfCouplingBlock, ReversibleBlock, ReversibleSequential
from revkernels.nn.revvit import RevTransformerBlock, RevViTBlock
from tests.helpers import assert_close_rel, fixed_point_forward, residual_fn

MEMORY_SAVING = ["sequential", "pareprop", "compiled", "auto"]  # (pareprop and auto run the sequential walker on CPU)


def _generic(width, dropout=0.1):
    return ReversibleBlock(residual_fn(width, dropout=dropout), residual_fn(width, dropout=dropout))


def _loss(y1, y2, w1, w2):
    return (y1.float() * w1).sum() + (y2.float() * w2).sum()


def _run(seq, x1, x2, w, seed, **context):
    """Output and grads (inputs, then parameters) of one step with randomness seeded by `seed`."""
    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    torch.manual_seed(seed)
    y1, y2 = seq(a1, a2, **context)
    _loss(y1, y2, *w).backward()
    grads = [a1.grad, a2.grad] + [p.grad.clone() for p in seq.parameters() if p.grad is not None]
    seq.zero_grad(set_to_none=True)
    return y1.detach(), y2.detach(), grads


# -- the rebuild is bit-exact ------------------------------------------------------------------


def _exact_rebuild_checked(seq, x1, x2, autocast=None, **context):
    """One training step of `seq` with every rebuilt block input compared, element by element, with
    the forward's (the monitor samples every element): the per-block errors (all 0.0 when exact)."""
    numel = x1.numel()
    with monitor_reconstruction(seq, threshold=1e-30, max_samples=numel) as monitor:
        a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        with torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False):
            y1, y2 = seq(a1, a2, **context)
        (y1.float().square().sum() + y2.float().sum()).backward()
        return monitor.errors


@pytest.mark.parametrize("engine", MEMORY_SAVING)
@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("depth", [1, 8, 96])
def test_every_rebuilt_input_equals_the_forwards_bit_for_bit(engine, autocast, depth):
    seq = ReversibleSequential(*[_generic(16) for _ in range(depth)], engine=engine, exact=True)
    x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the compiled engine says once that it runs exact steps eagerly)
        errors = _exact_rebuild_checked(seq, x1, x2, autocast)
    assert errors == [0.0] * depth


def test_float_streams_do_not_rebuild_exactly_where_exact_ones_do():
    # The contrast the exact mode exists for (bf16 autocast, depth 64): the monitor would pass a
    # float run that happened to rebuild exactly
    blocks = [_generic(16, dropout=0.0) for _ in range(64)]
    x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
    with pytest.warns(UserWarning, match="reconstruction monitor: block"):  # (float streams: not exact)
        float_errors = _exact_rebuild_checked(ReversibleSequential(*blocks), x1, x2, torch.bfloat16)
    exact_errors = _exact_rebuild_checked(ReversibleSequential(*blocks, exact=True), x1, x2, torch.bfloat16)
    assert max(float_errors) > 0 and exact_errors == [0.0] * 64


@pytest.mark.parametrize("block", ["revvit", "revtransformer_causal", "half"])
def test_fused_and_half_blocks_rebuild_exactly(block):
    if block == "revvit":
        blocks, shape, context = [RevViTBlock(32, 4, drop_path=0.1) for _ in range(4)], (2, 9, 32), {}
    elif block == "revtransformer_causal":
        blocks = [RevTransformerBlock(32, 4, causal=True, dropout=0.1, drop_path=0.1) for _ in range(4)]
        mask = torch.ones(2, 9, dtype=torch.bool)
        mask[1, 6:] = False
        shape, context = (2, 9, 32), {"attn_mask": mask}
    else:
        blocks, shape, context = [HalfCouplingBlock(residual_fn(32, dropout=0.1)) for _ in range(5)], (4, 32), {}
    seq = ReversibleSequential(*blocks, engine="sequential", exact=True)
    x1, x2 = torch.randn(shape), torch.randn(shape)
    for autocast in (None, torch.bfloat16):
        assert _exact_rebuild_checked(seq, x1, x2, autocast, **context) == [0.0] * len(blocks)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_revnet_stages_rebuild_exactly(autocast):
    # RevNet-18's runs (convolutions, BatchNorm in training mode) with their inputs as the model
    # hands them over: every block input rebuilt bit for bit, in every run
    model = revnet18(num_classes=10, stem="cifar", exact=True)
    inputs = []
    hooks = [run.register_forward_pre_hook(lambda module, args: inputs.append((module, args))) for run in model.runs]
    with torch.no_grad():
        model(torch.randn(2, 3, 16, 16))
    for hook in hooks:
        hook.remove()
    assert len(inputs) == len(model.runs) == 4
    for run, (x1, x2) in inputs:
        assert _exact_rebuild_checked(run, x1, x2, autocast) == [0.0] * len(run.blocks)


def test_check_reversibility_reports_zero_for_an_exact_run():
    blocks = [RevViTBlock(32, 4) for _ in range(12)]
    x1, x2 = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact = rk.check_reversibility(ReversibleSequential(*blocks, exact=True), x1, x2)
        floating = rk.check_reversibility(ReversibleSequential(*blocks), x1, x2)
    assert exact.exact and exact.max_error == 0.0 and "exact mode" in str(exact)
    assert floating.max_error > 0


# -- forward values and gradients --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_exact_autograd_engine_is_the_fixed_point_network(dtype):
    blocks = [_generic(16) for _ in range(6)] + [HalfCouplingBlock(residual_fn(16)) for _ in range(2)]
    seq = ReversibleSequential(*blocks, engine="autograd", exact=True).to(dtype)
    x1, x2 = torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype)
    w = torch.randn(4, 16), torch.randn(4, 16)
    y1, y2, grads = _run(seq, x1, x2, w, seed=5)

    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    torch.manual_seed(5)
    r1, r2 = fixed_point_forward(list(seq.blocks), a1, a2)
    _loss(r1, r2, *w).backward()
    expected = [a1.grad, a2.grad] + [p.grad for p in seq.parameters() if p.grad is not None]
    assert torch.equal(y1, r1.detach()) and torch.equal(y2, r2.detach())
    assert len(grads) == len(expected)
    for i, (got, want) in enumerate(zip(grads, expected)):
        assert_close_rel(got, want, 1e-6, what=f"grad {i}")


def _blocks(kind):
    """(blocks, stream shape, context) of a run of `kind`."""
    if kind == "generic":
        return [_generic(16) for _ in range(5)], (4, 16), {}
    if kind == "revvit":
        return [RevViTBlock(16, 2, drop_path=0.2) for _ in range(3)], (2, 5, 16), {}
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False
    return [RevTransformerBlock(16, 2, causal=True, dropout=0.2, drop_path=0.1) for _ in range(3)], (2, 5, 16), \
        {"attn_mask": mask}


@pytest.mark.parametrize("kind", ["generic", "revvit", "revtransformer_causal"])
@pytest.mark.parametrize("engine", MEMORY_SAVING)
def test_memory_saving_engines_give_the_exact_autograd_engines_outputs_and_grads(engine, kind):
    blocks, shape, context = _blocks(kind)
    x1, x2 = torch.randn(shape), torch.randn(shape)
    w = torch.randn(shape), torch.randn(shape)
    ref = _run(ReversibleSequential(*blocks, engine="autograd", exact=True), x1, x2, w, seed=3, **context)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run(ReversibleSequential(*blocks, engine=engine, exact=True), x1, x2, w, seed=3, **context)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert len(got[2]) == len(ref[2])
    for i, (a, b) in enumerate(zip(got[2], ref[2])):
        assert_close_rel(a, b, 1e-6, what=f"grad {i}")
    with torch.no_grad():  # inference gives the same bits
        torch.manual_seed(3)
        y1, y2 = ReversibleSequential(*blocks, engine=engine, exact=True)(x1, x2, **context)
    assert torch.equal(y1, ref[0]) and torch.equal(y2, ref[1])


def test_fused_blocks_step_the_fixed_point_streams_with_their_own_steps(monkeypatch):
    calls = []
    for name in ("forward_with_state_exact", "recompute_exact"):
        original = getattr(RevTransformerBlock, name)
        monkeypatch.setattr(RevTransformerBlock, name,
                            lambda self, *a, _f=original, _n=name: calls.append(_n) or _f(self, *a))
    blocks, shape, context = _blocks("revvit")
    seq = ReversibleSequential(*blocks, engine="sequential", exact=True)
    assert _exact_rebuild_checked(seq, torch.randn(shape), torch.randn(shape)) == [0.0] * 3
    assert calls.count("forward_with_state_exact") == 3 and calls.count("recompute_exact") == 3


@pytest.mark.parametrize("budget", [0.25, 0.6, 1.0])
def test_a_memory_budget_keeps_the_fixed_point_networks_outputs_and_grads(budget):
    # The kept blocks go on under exact autograd from the head node's int64 outputs: the whole run
    # is the fixed-point network, bit for bit; exact mode keeps whole blocks (no selective option)
    blocks, shape, _ = _blocks("generic")
    x1, x2 = torch.randn(shape), torch.randn(shape)
    w = torch.randn(shape), torch.randn(shape)
    ref = _run(ReversibleSequential(*blocks, engine="autograd", exact=True), x1, x2, w, seed=6)
    seq = ReversibleSequential(*blocks, engine="sequential", exact=True, memory_budget=budget)
    plan = seq.memory_plan(x1, x2)
    assert "selective" not in plan.options and "keep" in plan.options
    with monitor_reconstruction(seq, threshold=1e-30, max_samples=x1.numel()) as monitor:
        got = _run(seq, x1, x2, w, seed=6)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for i, (a, b) in enumerate(zip(got[2], ref[2])):
        assert_close_rel(a, b, 1e-6, what=f"grad {i}")
    rebuilt = plan.first_kept  # (the head's blocks, rebuilt exactly)
    assert (monitor.errors or []) == [0.0] * rebuilt


def test_gpt2_small_grads_match_the_exact_autograd_engine():
    # The case float streams get 5.9e-5 wrong (std-0.02 embeddings under branches adding values near 1)
    torch.manual_seed(0)
    model = revtext("gpt2_small", vocab_size=1000, max_len=64, exact=True)
    tokens = torch.randint(0, 1000, (1, 32))
    grads = {}
    for engine in ("autograd", "sequential"):
        model.engine = engine
        torch.manual_seed(1)
        model(tokens).square().mean().backward()
        grads[engine] = [p.grad.clone() for p in model.blocks.blocks[0].parameters()]
        model.zero_grad(set_to_none=True)
    for i, (a, b) in enumerate(zip(grads["sequential"], grads["autograd"])):
        assert_close_rel(a, b, 1e-6, what=f"block 0 grad {i}")


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_torch_compile_runs_exact_mode_in_the_opaque_op(engine, monkeypatch, fresh_dynamo):
    from revkernels.engine import opaque
    from revkernels.ops.fixed_point import fixed_point_from_float

    rebuilt = []

    def walker(*args, **kwargs):  # the opaque backward's walk: keep the rebuilt input of block 0
        out = reverse_blocks(*args, **kwargs)
        rebuilt.append(out[:2])
        return out

    from revkernels.engine.sequential import reverse_blocks
    monkeypatch.setattr(opaque, "reverse_blocks", walker)
    blocks, shape, context = _blocks("revtransformer_causal")
    x1, x2 = torch.randn(shape), torch.randn(shape)
    w = torch.randn(shape), torch.randn(shape)
    eager = _run(ReversibleSequential(*blocks, engine=engine, exact=True), x1, x2, w, seed=4, **context)
    seq = ReversibleSequential(*blocks, engine=engine, exact=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run(torch.compile(seq, fullgraph=True), x1, x2, w, seed=4, **context)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    for i, (a, b) in enumerate(zip(got[2], eager[2])):
        assert_close_rel(a, b, 1e-6, what=f"grad {i}")
    (r1, r2), = rebuilt
    assert torch.equal(r1, fixed_point_from_float(x1)[1]) and torch.equal(r2, fixed_point_from_float(x2)[1])


def test_models_take_exact():
    images = torch.randn(2, 3, 32, 32)
    for model in (revvit("vit_s16", num_classes=10, img_size=32, exact=True),
                  revnet18(num_classes=10, stem="cifar", exact=True),
                  revswin("swin_t", num_classes=10, img_size=32, window_size=4, embed_dim=16, depths=(2, 2),
                          num_heads=(2, 4), exact=True)):
        runs = [m for m in model.modules() if isinstance(m, ReversibleSequential)]
        assert runs and all(run.exact for run in runs)
        model(images).sum().backward()
    assert revtext("gpt2_small", vocab_size=50, max_len=8, depth=2, dim=32, heads=2, exact=True).blocks.exact


# -- overflow, bad blocks and bad arguments --------------------------------------------------


def test_overflow_raises_naming_the_block():
    seq = ReversibleSequential(*[_generic(8, dropout=0.0) for _ in range(3)], exact=True)
    with torch.no_grad():
        seq.blocks[1].g[-1].weight.mul_(1e12)
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    for engine in ("autograd", "sequential"):
        seq.engine = engine
        with pytest.raises(OverflowError, match=r"blocks\[1\] \(ReversibleBlock\)"):
            seq(x1.requires_grad_(), x2)
    with pytest.raises(OverflowError, match="the run's input"):
        seq(torch.full((2, 8), 2.0 ** 31), x2)
    with torch.no_grad():
        seq.blocks[1].g[-1].weight.fill_(float("nan"))
    with pytest.raises(OverflowError, match=r"blocks\[1\]"):
        seq(x1, x2)


def test_a_block_that_does_not_recompute_its_bits_is_named():
    class Drifting(nn.Module):  # its output changes with each call: never the same bits twice
        def __init__(self):
            super().__init__()
            self.calls = 0
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            self.calls += 1
            return self.lin(x) * (1 + 1e-3 * self.calls)

    blocks = [_generic(8, dropout=0.0), ReversibleBlock(Drifting(), residual_fn(8)), _generic(8, dropout=0.0)]
    seq = ReversibleSequential(*blocks, exact=True)
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    report = rk.check_reversibility(seq, x1, x2)
    assert report.block_errors[1][0] > 0 and report.block_errors[0] == (0.0, 0.0) and report.block_errors[2] == (0.0, 0.0)
    with pytest.warns(UserWarning, match=r"exact mode rebuilt block 1's input"):
        with monitor_reconstruction(seq):
            y1, y2 = seq(x1.requires_grad_(), x2)
            (y1 + y2).sum().backward()


def test_bad_arguments_and_unsupported_combinations_raise_clearly():
    blocks = [_generic(8) for _ in range(2)]
    with pytest.raises(TypeError, match="exact must be a bool"):
        ReversibleSequential(*blocks, exact=1)

    class OwnSteps(ReversibleBlock):
        coupling = None

        def forward_with_state(self, x1, x2, preserve_rng_state=True, context=None):
            return super().forward_with_state(x1, x2, preserve_rng_state)

    with pytest.raises(TypeError, match=r"blocks\[1\] \(OwnSteps\).*declares no coupling"):
        ReversibleSequential(blocks[0], OwnSteps(residual_fn(8), residual_fn(8)), exact=True)
    seq = ReversibleSequential(*blocks, exact=True)
    x = torch.randn(2, 8)
    seq.exact_bits = 61
    with pytest.raises(ValueError, match="bits must be in"):
        seq(x, x)
    seq.exact_bits = 32
    with pytest.raises(TypeError, match="y1 must be an int64 fixed-point stream"):  # (reverse takes the int64 streams)
        seq.reverse(x, x, x, x)
    with pytest.raises(NotImplementedError, match="cannot be exported"):
        torch.export.export(seq, (x, x))


def test_the_callers_tensors_are_left_alone_and_inverse_rebuilds_from_float_outputs():
    seq = ReversibleSequential(*[_generic(8, dropout=0.0) for _ in range(4)], exact=True).eval()
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
    kept = x1.clone(), x2.clone()
    y1, y2 = seq(x1, x2)
    assert torch.equal(x1, kept[0]) and torch.equal(x2, kept[1])
    r1, r2 = seq.inverse(y1, y2)
    # The float outputs are views of the streams (rounded to fp32): the inverse is exact up to that
    assert_close_rel(r1, x1, 1e-5) and assert_close_rel(r2, x2, 1e-5)


def _saved_bytes(seq, x):
    """Bytes autograd saves for one step (parameters left out)."""
    params = {id(p) for p in seq.parameters()}
    total = [0]

    def pack(t):
        if id(t) not in params:
            total[0] += t.numel() * t.element_size()
        return t

    a = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y1, y2 = seq(a, a)
    (y1 + y2).sum().backward()
    return total[0]


def test_an_exact_run_saves_its_two_int64_output_streams_at_any_depth():
    # (fp32 streams: twice the bytes the float run saves; flat in depth on every engine: the
    # conformance table's exact column)
    x = torch.randn(2, 5, 16)
    for depth in (2, 6):
        blocks = [RevViTBlock(16, 2) for _ in range(depth)]
        exact = _saved_bytes(ReversibleSequential(*blocks, engine="sequential", exact=True), x)
        floating = _saved_bytes(ReversibleSequential(*blocks, engine="sequential"), x)
        assert exact == 2 * x.numel() * 8 == 2 * floating, (depth, exact, floating)


def test_the_view_cache_gives_each_stream_its_own_view():
    # (a step reuses the view of a stream the previous step made; pareprop interleaves two blocks'
    # steps, so the cache must match the stream itself, not the latest entry)
    from revkernels.nn.exact import FixedPointStreams

    streams = FixedPointStreams(32, torch.float32)
    a_view, a = streams.enter(torch.randn(3, 4))
    b_view, b = streams.enter(torch.randn(3, 4))
    assert streams.view(a) is a_view and streams.view(b) is b_view
    copy = a.clone()  # an equal stream that is not the one made: converted afresh, to the same bits
    assert streams.view(copy) is not a_view and torch.equal(streams.view(copy), a_view)


@pytest.mark.parametrize("used", ["y1", "y2"])
@pytest.mark.parametrize("half", [False, True])
def test_a_loss_of_one_output_gets_the_exact_autograd_engines_grads(used, half):
    # The missing output grad becomes zeros in the views' float dtype (the int64 streams have none)
    blocks = ([HalfCouplingBlock(residual_fn(8, dropout=0.0)) for _ in range(3)] if half
              else [_generic(8, dropout=0.0) for _ in range(3)])
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    grads = {}
    for engine in ("autograd", "sequential"):
        seq = ReversibleSequential(*blocks, engine=engine, exact=True)
        a1 = x1.clone().requires_grad_()
        y1, y2 = seq(a1, x2)
        (y1 if used == "y1" else y2).square().sum().backward()
        grads[engine] = [a1.grad] + [p.grad for p in seq.parameters()]
        seq.zero_grad(set_to_none=True)
    assert [g is None for g in grads["sequential"]] == [g is None for g in grads["autograd"]]
    for i, (a, b) in enumerate(zip(grads["sequential"], grads["autograd"])):
        if b is not None:
            assert_close_rel(a, b, 1e-6, what=f"grad {i}")
