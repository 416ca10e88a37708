"""Hypothesis fuzzing of revkernels.nn (issue 7, item 4): random depths, widths, batch shapes,
block kinds (ReversibleBlock, HalfCouplingBlock), engines and dropout. ReversibleSequential's
outputs and grads equal plain autograd through the same modules, inverse and check_reversibility
rebuild the input, reverse gives the input grads and parameter grads; malformed streams raise a
TypeError/ValueError naming the stream (x1/x2, y1/y2, dy1/dy2)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import revkernels as rk
from revkernels.check import check_reversibility
from tests.helpers import CPU_ENGINES, rel_err

ENGINES = CPU_ENGINES  # pareprop/graphs run the sequential code on CPU (see tests/helpers.py)
TOL = 1e-5


def fuzz(n):
    return settings(max_examples=n, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def residual(width, dropout):
    layers = [nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def build(kinds, width, dropout, engine, seed):
    torch.manual_seed(seed)
    blocks = [rk.nn.ReversibleBlock(residual(width, dropout), residual(width, dropout)) if kind == "full"
              else rk.nn.HalfCouplingBlock(residual(width, dropout)) for kind in kinds]
    return rk.nn.ReversibleSequential(*blocks, engine=engine)


def plain(blocks, x1, x2):
    """The run written out with ordinary autograd, through the same modules."""
    for block in blocks:
        if isinstance(block, rk.nn.HalfCouplingBlock):
            x1, x2 = x2, x1 + block.f(x2)
        else:
            x1 = x1 + block.f(x2)
            x2 = x2 + block.g(x1)
    return x1, x2


def streams(batch, width, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*batch, width, generator=gen, dtype=torch.float64).to(dtype) for _ in range(4)]


def close(got, want, what):
    err = rel_err(got, want)
    assert err <= TOL, f"{what}: relative error {err:.3e} > {TOL:.0e}"


kinds_st = st.lists(st.sampled_from(["full", "half"]), min_size=1, max_size=6)
batch_st = st.lists(st.integers(1, 5), min_size=1, max_size=2).map(tuple)
# Grads are compared in fp32 at 1e-5: a LayerNorm over a handful of features amplifies the round-off
# of the rebuilt input by rstd (width 2, two close features: 3e-5 in fp32, 2e-14 in fp64), and at
# width 1 its weight grad is pure round-off. Narrow widths are fuzzed where no grad is compared.
width_st = st.integers(8, 32)
any_width_st = st.integers(1, 32)
seeds = st.integers(0, 2**31 - 1)


@fuzz(150)
@given(kinds=kinds_st, width=width_st, batch=batch_st, engine=st.sampled_from(ENGINES),
       dropout=st.sampled_from([0.0, 0.0, 0.1, 0.5]), seed=seeds)
def test_sequential_matches_plain_autograd(kinds, width, batch, engine, dropout, seed):
    seq = build(kinds, width, dropout, engine, seed)
    params = list(seq.parameters())
    x1, x2, w1, w2 = streams(batch, width, seed)
    results = []
    for run in (lambda a, b: seq(a, b), lambda a, b: plain(seq.blocks, a, b)):
        a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        seq.zero_grad(set_to_none=True)
        torch.manual_seed(seed + 1)  # the same dropout masks in both runs
        y1, y2 = run(a, b)
        ((y1 * w1).sum() + (y2.square() * w2).sum()).backward()
        results.append([y1.detach(), y2.detach(), a.grad, b.grad] + [p.grad.clone() for p in params])
    names = ["y1", "y2", "dx1", "dx2"] + [f"param {i} grad" for i in range(len(params))]
    for got, want, what in zip(*results, names):
        close(got, want, f"{engine} {what}")


def amplification(blocks, x1, x2):
    """Largest stream magnitude along the run over the smallest: x = y - F(.) is accurate to round-off
    of |y| and |F|, so an input rebuilt from much larger streams (a width-1 stream near 0 next to
    F's output, dropout's 1/(1-p) scaling, deep runs) is accurate relative to those, not to itself."""
    mags, inputs = [], []
    with torch.no_grad():
        for block in blocks:
            inputs += [x1.abs().max().item(), x2.abs().max().item()]
            if isinstance(block, rk.nn.HalfCouplingBlock):
                fx = block.f(x2)
                mags.append(fx.abs().max().item())
                x1, x2 = x2, x1 + fx
            else:
                fx = block.f(x2)
                x1 = x1 + fx
                gx = block.g(x1)
                x2 = x2 + gx
                mags += [fx.abs().max().item(), gx.abs().max().item()]
        mags += inputs + [x1.abs().max().item(), x2.abs().max().item()]
    return max(1.0, max(mags) / max(min(inputs), 1e-30))


@fuzz(100)
@given(kinds=kinds_st, width=any_width_st, batch=batch_st, dropout=st.sampled_from([0.0, 0.1, 0.5]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=seeds)
def test_inverse_rebuilds_the_input(kinds, width, batch, dropout, dtype, seed):
    seq = build(kinds, width, dropout, "sequential", seed).to(dtype)
    x1, x2, _, _ = streams(batch, width, seed, dtype)
    tol = TOL if dtype == torch.float32 else 1e-12
    # check_reversibility replays each block's randomness (dropout in train mode included) and
    # restores the generator: the plain run after it draws the same masks.
    report = check_reversibility(seq, x1, x2)
    amp = amplification(seq.blocks, x1, x2)
    assert report.max_error <= tol * amp, f"{report}\namplification {amp:.2f}"
    # inverse draws fresh randomness: deterministic only in eval mode (or without dropout).
    seq.eval()
    amp = amplification(seq.blocks, x1, x2)
    with torch.no_grad():
        r1, r2 = seq.inverse(*seq(x1, x2))
    assert rel_err(r1, x1) <= tol * amp and rel_err(r2, x2) <= tol * amp
    block = seq.blocks[0]
    amp = amplification(seq.blocks[:1], x1, x2)
    with torch.no_grad():
        b1, b2 = block.inverse(*block(x1, x2))
    assert rel_err(b1, x1) <= tol * amp and rel_err(b2, x2) <= tol * amp


@fuzz(100)
@given(kinds=kinds_st, width=width_st, batch=batch_st, seed=seeds)
def test_reverse_gives_input_and_grads(kinds, width, batch, seed):
    seq = build(kinds, width, 0.0, "sequential", seed)
    params = list(seq.parameters())
    x1, x2, dy1, dy2 = streams(batch, width, seed)
    with torch.no_grad():
        y1, y2 = seq(x1, x2)
    seq.zero_grad(set_to_none=True)
    r1, r2, dx1, dx2 = seq.reverse(y1, y2, dy1, dy2)
    assert not any(t.requires_grad for t in (r1, r2, dx1, dx2))
    got_params = [p.grad for p in params]
    a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    want = torch.autograd.grad(plain(seq.blocks, a, b), [a, b] + params, (dy1, dy2), allow_unused=True)
    close(r1, x1, "x1")
    close(r2, x2, "x2")
    close(dx1, want[0], "dx1")
    close(dx2, want[1], "dx2")
    for i, (g, w) in enumerate(zip(got_params, want[2:])):
        assert (g is None) == (w is None), f"param {i}"
        if g is not None:
            close(g, w, f"param {i} grad")


# --- bad streams -------------------------------------------------------------------------------

ENTRIES = ["seq.forward", "seq.inverse", "seq.reverse", "block.forward", "block.inverse", "half.forward",
           "half.inverse", "check_reversibility"]
NAMES = {"seq.forward": ("x1", "x2"), "block.forward": ("x1", "x2"), "half.forward": ("x1", "x2"),
         "check_reversibility": ("x1", "x2"), "seq.inverse": ("y1", "y2"), "block.inverse": ("y1", "y2"),
         "half.inverse": ("y1", "y2"), "seq.reverse": ("y1", "y2")}


@fuzz(150)
@given(entry=st.sampled_from(ENTRIES), which=st.integers(0, 1), grads=st.booleans(),
       bad=st.sampled_from(["shape", "float_dtype", "int_dtype", "not_tensor", "device"]),
       width=st.integers(1, 8), batch=batch_st, engine=st.sampled_from(ENGINES), data=st.data())
def test_bad_streams_name_the_argument(entry, which, grads, bad, width, batch, engine, data):
    torch.manual_seed(0)
    seq = build(["full", "half"], width, 0.0, engine, 0)
    block, half = seq.blocks[0], seq.blocks[1]
    good = [torch.randn(*batch, width) for _ in range(4)]
    args = list(good)
    names = list(NAMES[entry])
    if entry == "seq.reverse" and grads:
        names = ["dy1", "dy2"]
        which += 2
    else:
        grads = False
    name = names[which % 2]
    if bad == "shape":
        shape = data.draw(st.sampled_from([batch + (width + 1,), (sum(batch) + 1, width), batch + (width, 2), ()]))
        args[which] = torch.randn(shape)
        error = ValueError
    elif bad == "float_dtype":
        if grads:  # grads may have another float dtype than the streams: not an error
            return
        args[which] = args[which].to(data.draw(st.sampled_from([torch.float64, torch.bfloat16, torch.float16])))
        error = ValueError
    elif bad == "int_dtype":
        args[which] = args[which].to(data.draw(st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.bool])))
        error = TypeError
    elif bad == "not_tensor":
        args[which] = data.draw(st.sampled_from([1.0, None, [0.0], "x1"]))
        error = TypeError
    else:
        args[which] = args[which].to("meta")
        error = ValueError
    call = {
        "seq.forward": lambda: seq(args[0], args[1]),
        "seq.inverse": lambda: seq.inverse(args[0], args[1]),
        "seq.reverse": lambda: seq.reverse(*args),
        "block.forward": lambda: block(args[0], args[1]),
        "block.inverse": lambda: block.inverse(args[0], args[1]),
        "half.forward": lambda: half(args[0], args[1]),
        "half.inverse": lambda: half.inverse(args[0], args[1]),
        "check_reversibility": lambda: check_reversibility(seq, args[0], args[1]),
    }[entry]
    with pytest.raises(error) as info:
        call()
    assert name in str(info.value), f"{error.__name__} does not name {name}: {info.value}"


@fuzz(40)
@given(engine=st.one_of(st.text(max_size=10), st.sampled_from([None, 1, "Sequential", "Auto", "auto "])))
def test_bad_engine_and_blocks(engine):
    block = rk.nn.ReversibleBlock(nn.Identity(), nn.Identity())
    if engine not in rk.engine.ENGINES and engine != rk.engine.AUTO:
        with pytest.raises(ValueError, match="engine"):
            rk.nn.ReversibleSequential(block, engine=engine)
    with pytest.raises(TypeError, match=r"blocks\[1\]"):
        rk.nn.ReversibleSequential(block, nn.Linear(2, 2))
    with pytest.raises(TypeError, match="g must be a torch.nn.Module"):
        rk.nn.ReversibleBlock(nn.Identity(), torch.tanh)
    with pytest.raises(TypeError, match="module must be"):
        check_reversibility(nn.Identity(), torch.randn(2), torch.randn(2))
