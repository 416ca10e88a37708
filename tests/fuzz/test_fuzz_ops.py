"""Hypothesis fuzzing of the revkernels ops (issue 7, item 4): random shapes (0-d, empty, one row,
wide rows), dtypes (fp32/fp64/bf16/fp16 and mixed where an op allows it) and strided views against
the pure-PyTorch references and float64 truth; wrong arguments raise a TypeError/ValueError that
names the argument, through the Python entry points and the direct ``torch.ops.revkernels`` calls.

Tolerances are the ops' own: exact (rtol=0, atol=0) where the docstring promises one rounding like
the reference (coupling ops, sub_layer_norm's x); otherwise fp32/fp64 outputs within 1e-5 relative of
float64 truth (max-abs error over max-abs value), bf16/fp16 outputs at most 2x the error of the
same-dtype PyTorch composition, and outputs rounded to a 16-bit dtype from mixed-dtype inputs
within one rounding of the truth.

Tensor values come from a torch.Generator seeded by a drawn integer, so a failure replays from the
hypothesis example alone. The direct op calls' argument checks (fake kernels included) are tested at the end.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from revkernels.ops import (batch_norm_act, batch_norm_act_bwd, bias_gelu, bias_gelu_bwd, coupling_add, coupling_add_reference, coupling_sub,
                            coupling_sub_reference, layer_norm_bwd_add, layer_norm_bwd_add_reference, linear_sub,
                            sub_layer_norm)
from tests.helpers import rel_err

R = torch.ops.revkernels
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
LOW = (torch.bfloat16, torch.float16)
HALF_ULP = {torch.bfloat16: 2**-8, torch.float16: 2**-11}
# Half the spacing of the subnormals (below the smallest normal the spacing stops shrinking)
HALF_SUBNORMAL = {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}
LAYOUTS = ["contiguous", "transposed", "sliced", "strided", "expanded"]
MAX_NUMEL = 2000
MIN_2X = 64


def fuzz(n):
    return settings(max_examples=n, deadline=None, derandomize=False,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# --- strategies --------------------------------------------------------------------------------

@st.composite
def shapes(draw, min_dims=0, max_dims=4, min_last=0):
    """Shapes with numel <= MAX_NUMEL: 0-d, empty, one row, many short rows, wide rows. The cap counts
    a 0 dim as 1: an empty (250, 1000, 1000, 0) has numel 0, but `make` pads the last dim of its
    "sliced" layout (a 6 GB float64 buffer; CI was killed for memory)."""
    ndim = draw(st.integers(min_dims, max_dims))
    if ndim == 0:
        return ()
    last = draw(st.one_of(st.integers(max(min_last, 0), 40),
                          st.sampled_from([n for n in (0, 1, 2, 127, 128, 129, 513, 1000, 2000) if n >= min_last])))
    lead = [draw(st.one_of(st.integers(1, 8), st.sampled_from([0, 1, 1, 250, 1000]))) for _ in range(ndim - 1)]
    shape = lead + [last]

    def size(dims):
        return math.prod(max(1, d) for d in dims)

    for i in range(len(lead)):  # cap the size, shrinking the leading dims first
        if size(shape) > MAX_NUMEL and shape[i] > 1:
            shape[i] = max(1, MAX_NUMEL // size(shape[:i] + shape[i + 1:]))
    if size(shape) > MAX_NUMEL:
        shape[-1] = max(min_last, MAX_NUMEL // size(shape[:-1]))
    return tuple(shape)


@fuzz(300)
@given(shape=shapes())
def test_drawn_shapes_keep_the_buffers_small(shape):
    """A drawn shape, its 0 dims counted as 1, holds at most MAX_NUMEL: `make`'s buffers (padded for
    the "sliced" and "strided" layouts) then stay small for empty shapes too."""
    assert math.prod(max(1, d) for d in shape) <= MAX_NUMEL


def make(shape, dtype, layout, gen, scale=2.0, offset=0.25):
    """A tensor of `shape` and `dtype` viewed in `layout` (contiguous where the shape has no such view)."""
    def rand(s):
        return (torch.randn(s, generator=gen, dtype=torch.float64) * scale + offset).to(dtype)

    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        return rand(shape[:-2] + (shape[-1], shape[-2])).transpose(-1, -2)
    if layout == "sliced" and len(shape) >= 1:
        return rand(shape[:-1] + (shape[-1] + 3,))[..., 1:shape[-1] + 1]
    if layout == "strided" and len(shape) >= 1:
        return rand((2 * shape[0],) + shape[1:])[::2]
    if layout == "expanded" and len(shape) >= 2 and shape[0] != 0:  # broadcast rows (stride 0)
        return rand((1,) + shape[1:]).expand(shape)
    return rand(shape)


seeds = st.integers(0, 2**31 - 1)
dtypes = st.sampled_from(FLOATS)
layouts = st.sampled_from(LAYOUTS)
entries = st.sampled_from(["python", "torch.ops"])
# A Python value the schema parser cannot convert to the argument's type (a float for a Tensor, None
# for a str): it raises a RuntimeError naming the argument before any kernel runs. The entry points
# are the ops themselves (tests/ops/test_dispatch.py), so both entries raise it.
NOT_CONVERTIBLE = RuntimeError


def not_a_tensor_error(value):
    """The error for `value` passed as a Tensor: None reaches the kernels as an undefined tensor and
    gets their TypeError; anything else is not convertible."""
    return TypeError if value is None else NOT_CONVERTIBLE


def gen_of(seed):
    return torch.Generator().manual_seed(seed)


# --- comparisons -------------------------------------------------------------------------------

def exact_equal(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def close_rel(got, exact, tol, what, scale=None):
    """max |got - exact| <= tol * max |exact| (tests.helpers.rel_err), or tol * max(scale) where a
    sum cancels: `scale` is the same expression summed in absolute values, the magnitude a
    floating-point evaluation is accurate relative to (a sum of +-1 terms that cancels to ~0 has no
    relative accuracy in any precision)."""
    if got.numel() == 0:
        return
    if scale is None:
        err = rel_err(got, exact)
    else:
        err = (got.double() - exact.double()).abs().max().item() / max(
            exact.double().abs().max().item(), scale.double().abs().max().item(), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


def _check_grads(grads, composed, exact, scales, dx_dtype, acc):
    """(dx, dweight, dbias) of a backward op against float64: within 2x of the same-dtype PyTorch
    composition's error when `composed` is given (16-bit, unmixed), else one rounding (16-bit) or
    the float tolerance."""
    for i, (got, e, scale, what) in enumerate(zip(grads, exact, scales, ("dx", "dweight", "dbias"))):
        if composed is not None:
            within_2x(got, composed[i], e, f"{what} {dx_dtype}", scale)
        elif got.dtype in LOW:
            one_rounding(got, e, what, scale)
        else:
            close_rel(got, e, fp_tol(got.dtype, acc), what, scale)


def within_2x(got, composed, exact, what, scale=None):
    """bf16/fp16: max-abs error at most twice that of the same-dtype PyTorch composition. A max over
    a handful of values compares single roundings by luck (PyTorch's can be exact), so below
    MIN_2X elements the bound is instead two roundings of the largest magnitude (max |exact|, or
    max(scale) where a sum cancels)."""
    if got.numel() == 0:
        return
    err = (got.double() - exact.double()).abs().max().item()
    if got.numel() >= MIN_2X:
        torch_err = (composed.double() - exact.double()).abs().max().item()
        assert err <= 2 * torch_err, f"{what}: error {err:.3e} > 2 x PyTorch's {torch_err:.3e}"
    else:
        magnitude = exact.double().abs().max().item()
        if scale is not None:
            magnitude = max(magnitude, scale.double().abs().max().item())
        assert err <= 2 * HALF_ULP[got.dtype] * magnitude, f"{what}: error {err:.3e} > two roundings of {magnitude:.3e}"


def one_rounding(got, exact, what, scale=None):
    """A 16-bit output of a mixed-dtype op: half an ulp of each value (half the subnormal spacing for
    a subnormal value), of a value accurate to fp32 (1e-5 of max |exact|, or of max(scale) where a
    sum cancels, as in close_rel)."""
    if got.numel() == 0:
        return
    err = (got.double() - exact.double()).abs()
    magnitude = exact.double().abs().max() if scale is None else max(exact.double().abs().max(), scale.double().abs().max())
    bound = exact.double().abs() * HALF_ULP[got.dtype] + HALF_SUBNORMAL[got.dtype] + 1e-5 * magnitude
    assert (err <= bound).all(), f"{what}: error up to {(err - bound).max().item():.3e} past one rounding"


def fp_tol(dtype, acc):
    """Relative tolerance of an fp32/fp64 output accumulated in `acc`."""
    return 1e-12 if dtype == torch.float64 and acc == torch.float64 else 1e-5


def biased_var(x):
    return (x - x.mean(-1, keepdim=True)).square().mean(-1)


def snapshot(*ts):
    return [t.clone() for t in ts]


def untouched(ts, before):
    for t, b in zip(ts, before):
        torch.testing.assert_close(t, b, rtol=0, atol=0, msg="an input was modified")


# --- coupling_sub / coupling_add ---------------------------------------------------------------

COUPLING = {"sub": (coupling_sub, R.coupling_sub, coupling_sub_reference, ("y", "f")),
            "add": (coupling_add, R.coupling_add, coupling_add_reference, ("a", "b"))}


@fuzz(250)
@given(which=st.sampled_from(["sub", "add"]), entry=entries, shape=shapes(), d1=dtypes, d2=dtypes,
       same=st.booleans(), l1=layouts, l2=layouts, seed=seeds)
def test_coupling_matches_reference_exactly(which, entry, shape, d1, d2, same, l1, l2, seed):
    py, direct, reference, _ = COUPLING[which]
    op = py if entry == "python" else direct
    gen = gen_of(seed)
    a, b = make(shape, d1, l1, gen), make(shape, d1 if same else d2, l2, gen, scale=1.0, offset=0.0)
    before = snapshot(a, b)
    out = op(a, b)
    assert out.dtype == a.dtype and out.shape == a.shape
    exact_equal(out, reference(a, b), f"coupling_{which}")  # formed in fp32/fp64, rounded once
    if a.dtype == torch.float32 and b.dtype != torch.float64:
        close_rel(out, reference(a.double(), b.double()), 1e-5, "vs float64")
    untouched((a, b), before)


# --- sub_layer_norm ----------------------------------------------------------------------------

@fuzz(200)
@given(entry=entries, shape=shapes(min_dims=1, min_last=1), dy=dtypes, dg=dtypes, dw=dtypes, db=dtypes,
       mixed=st.booleans(), ly=layouts, lg=layouts, lw=st.sampled_from(["contiguous", "strided"]),
       eps=st.sampled_from([1e-5, 1e-6, 1e-3, 0.1, 1]), seed=seeds)
def test_sub_layer_norm(entry, shape, dy, dg, dw, db, mixed, ly, lg, lw, eps, seed):
    if not mixed:
        dg = dw = db = dy
    op = sub_layer_norm if entry == "python" else R.sub_layer_norm
    gen, n = gen_of(seed), shape[-1]
    y, g = make(shape, dy, ly, gen, scale=3.0, offset=0.5), make(shape, dg, lg, gen, scale=1.0, offset=0.0)
    w, b = make((n,), dw, lw, gen, scale=0.5, offset=1.0), make((n,), db, lw, gen, scale=1.0, offset=0.0)
    before = snapshot(y, g, w, b)
    x, ln, mean, rstd = op(y, g, w, b, float(eps))
    acc = torch.float64 if torch.float64 in (dy, dg) else torch.float32
    assert (x.dtype, ln.dtype, mean.dtype, rstd.dtype) == (dy, dy, acc, acc)
    assert x.shape == ln.shape == shape and mean.shape == rstd.shape == shape[:-1]
    assert x.is_contiguous() and ln.is_contiguous()
    exact_equal(x, coupling_sub_reference(y, g), "x")  # rounded once, like coupling_sub
    x64 = x.double()
    close_rel(mean, x64.mean(-1), fp_tol(mean.dtype, acc), "mean", x64.abs().mean(-1))  # a sum: may cancel
    close_rel(rstd, torch.rsqrt(biased_var(x64) + eps), fp_tol(rstd.dtype, acc), "rstd")
    ln64 = F.layer_norm(x64, (n,), w.double(), b.double(), eps)  # ln is LayerNorm of the returned x
    # LayerNorm amplifies the round-off of the row mean by rstd: near-constant rows are ill-conditioned.
    rows = x64.abs().amax(-1, keepdim=True) if x64.numel() else x64
    scale = w.double().abs() * torch.rsqrt(biased_var(x64) + eps).unsqueeze(-1) * rows + b.double().abs()
    if dy in LOW and not mixed:
        within_2x(ln, F.layer_norm(x, (n,), w, b, eps), ln64, f"ln {dy}", scale)
    elif dy in LOW:
        one_rounding(ln, ln64, f"ln {dy}", scale)
    else:
        close_rel(ln, ln64, fp_tol(dy, acc), "ln", scale)
    untouched((y, g, w, b), before)


# --- layer_norm_bwd_add ------------------------------------------------------------------------

def _torch_ln_grads(x, w, dln, eps):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b = torch.zeros_like(w, requires_grad=True)
    F.layer_norm(x, x.shape[-1:], w, b, eps).backward(dln)
    return x.grad, w.grad, b.grad


@fuzz(200)
@given(entry=entries, shape=shapes(min_dims=1, min_last=1), dx_=dtypes, dres_=dtypes, dw=dtypes,
       mixed=st.booleans(), lx=layouts, ld=layouts, lr=layouts, seed=seeds)
def test_layer_norm_bwd_add(entry, shape, dx_, dres_, dw, mixed, lx, ld, lr, seed):
    if not mixed:
        dres_ = dw = dx_
    eps = 1e-5
    op = layer_norm_bwd_add if entry == "python" else R.layer_norm_bwd_add
    gen, n = gen_of(seed), shape[-1]
    x = make(shape, dx_, lx, gen, scale=3.0, offset=0.5)
    dln, dres = make(shape, dx_, ld, gen, 1.0, 0.0), make(shape, dres_, lr, gen, 1.0, 0.0)
    w = make((n,), dw, "contiguous", gen, scale=0.5, offset=1.0)
    acc = torch.float64 if torch.float64 in (dx_, dres_) else torch.float32
    x64 = x.double()
    mean, rstd = x64.mean(-1).to(acc), torch.rsqrt(biased_var(x64) + eps).to(acc)
    before = snapshot(dln, x, w, mean, rstd, dres)
    dx, dweight, dbias = op(dln, x, w, mean, rstd, dres)
    assert (dx.dtype, dweight.dtype, dbias.dtype) == (dres_, dw, dw)
    assert dx.shape == shape and dweight.shape == dbias.shape == (n,)
    exact = layer_norm_bwd_add_reference(*(t.double() for t in (dln, x, w, mean, rstd, dres)))
    d64, r64 = dln.double().abs(), rstd.double().unsqueeze(-1)
    xhat = ((x64 - mean.double().unsqueeze(-1)) * r64).abs()
    dxhat = d64 * w.double().abs()
    scales = (dres.double().abs() + r64 * (dxhat + dxhat.mean(-1, keepdim=True)
                                           + xhat * (dxhat * xhat).mean(-1, keepdim=True)),
              (d64 * xhat).reshape(-1, n).sum(0), d64.reshape(-1, n).sum(0))
    if not mixed and dx_ in LOW:
        tx, tw, tb = _torch_ln_grads(x, w, dln, eps)
        _check_grads((dx, dweight, dbias), (dres + tx, tw, tb), exact, scales, dx_, acc)
    else:
        _check_grads((dx, dweight, dbias), None, exact, scales, dx_, acc)
    untouched((dln, x, w, mean, rstd, dres), before)


# --- batch_norm_act / batch_norm_act_bwd ----------------------------------------------------------

@st.composite
def bn_shapes(draw):
    """(N, C, *spatial) with 0-3 spatial dims and at least two values per channel."""
    n, c = draw(st.integers(1, 6)), draw(st.integers(1, 9))
    spatial = draw(st.lists(st.integers(1, 7), max_size=3))
    if n * math.prod(spatial) < 2:
        n = 2
    return (n, c, *spatial)


def bn_make(shape, dtype, layout, gen, scale=2.0, offset=0.25):
    if layout == "channels_last" and len(shape) in (4, 5):
        fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        return make(shape, dtype, "contiguous", gen, scale, offset).contiguous(memory_format=fmt)
    return make(shape, dtype, "contiguous" if layout == "channels_last" else layout, gen, scale, offset)


bn_layouts = st.sampled_from(LAYOUTS + ["channels_last"])


def _bn_truth(x, w, b, eps, relu):
    """float64 (y before ReLU, out, mean, rstd) by torch's own batch_norm (independent of the op's
    reference)."""
    x64, dims = x.double(), [0] + list(range(2, x.dim()))
    y = F.batch_norm(x64, None, None, w.double(), b.double(), training=True, eps=eps)
    return y, (torch.relu(y) if relu else y), x64.mean(dims), torch.rsqrt(x64.var(dims, correction=0) + eps)


@fuzz(120)
@given(entry=entries, shape=bn_shapes(), dx_=dtypes, dw=dtypes, mixed=st.booleans(), relu=st.booleans(),
       lx=bn_layouts, eps=st.sampled_from([1e-5, 1e-3]), seed=seeds)
def test_batch_norm_act(entry, shape, dx_, dw, mixed, relu, lx, eps, seed):
    if not mixed:
        dw = dx_
    op = batch_norm_act if entry == "python" else R.batch_norm_act
    gen = gen_of(seed)
    x = bn_make(shape, dx_, lx, gen, scale=3.0, offset=0.5)
    w = make((shape[1],), dw, "contiguous", gen, scale=0.5, offset=1.0)
    b = make((shape[1],), dw, "contiguous", gen, scale=0.5, offset=0.0)
    before = snapshot(x, w, b)
    out, mean, rstd = op(x, w, b, eps, relu)
    acc = torch.float64 if dx_ == torch.float64 else torch.float32
    assert out.dtype == dx_ and out.shape == shape and mean.dtype == rstd.dtype == acc
    y64, exact, mean64, rstd64 = _bn_truth(x, w, b, eps, relu)
    close_rel(mean, mean64, fp_tol(acc, acc), "mean", scale=x.double().abs().amax([0] + list(range(2, x.dim()))))
    close_rel(rstd, rstd64, fp_tol(acc, acc), "rstd")
    if dx_ in LOW and not mixed:
        composed = F.batch_norm(x, None, None, w, b, training=True, eps=eps)
        within_2x(out, torch.relu(composed) if relu else composed, exact, f"out {dx_}")
    elif dx_ in LOW:
        one_rounding(out, exact, "out")
    else:
        # (x - mean) * rstd * w amplifies the rounding of the mean by rstd * |w|: a channel of (near)
        # equal values (the expanded layout of a 2-D input) has rstd ~ eps^-1/2, and fp32 torch's own
        # batch_norm is then off by 2.5e-3 of max |out| (1/3 of such inputs past 1e-5). The scale is
        # that conditioning: max |x| * rstd * |w| per channel.
        dims = [0] + list(range(2, x.dim()))
        conditioning = x.double().abs().amax(dims) * rstd64 * w.double().abs() if x.numel() else None
        close_rel(out, exact, fp_tol(dx_, acc), "out", scale=conditioning)
    untouched((x, w, b), before)


@fuzz(120)
@given(entry=entries, shape=bn_shapes(), dx_=dtypes, dw=dtypes, mixed=st.booleans(), relu=st.booleans(),
       lx=bn_layouts, ld=bn_layouts, seed=seeds)
def test_batch_norm_act_bwd(entry, shape, dx_, dw, mixed, relu, lx, ld, seed):
    if not mixed:
        dw = dx_
    eps = 1e-5
    op = batch_norm_act_bwd if entry == "python" else R.batch_norm_act_bwd
    gen = gen_of(seed)
    x = bn_make(shape, dx_, lx, gen, scale=3.0, offset=0.5)
    w = make((shape[1],), dw, "contiguous", gen, scale=0.5, offset=1.0)
    b = make((shape[1],), dw, "contiguous", gen, scale=0.5, offset=0.0)
    y64, _, mean64, rstd64 = _bn_truth(x, w, b, eps, relu)
    acc = torch.float64 if dx_ == torch.float64 else torch.float32
    mean, rstd = mean64.to(acc), rstd64.to(acc)
    # No gradient where y is within rounding of the ReLU's kink: there the mask is a coin flip.
    dout = bn_make(shape, dx_, ld, gen, 1.0, 0.0)
    if relu:
        dout = torch.where(y64.abs() > 1e-3 * y64.abs().max(), dout, torch.zeros((), dtype=dx_)).to(dx_)
        dout = bn_make(shape, dx_, ld, torch.Generator(), 0.0, 0.0).copy_(dout) if ld != "expanded" else dout
    before = snapshot(dout, x, w, b, mean, rstd)
    dx, dweight, dbias = op(dout, x, w, b, mean, rstd, relu)
    assert (dx.dtype, dweight.dtype, dbias.dtype) == (dx_, dw, dw) and dx.shape == shape
    # float64 truth: autograd through torch's batch_norm (+ ReLU) at the same inputs.
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    y = F.batch_norm(x64, None, None, w64, b64, training=True, eps=eps)
    torch.autograd.backward(torch.relu(y) if relu else y, dout.double())
    exact = (x64.grad, w64.grad, b64.grad)
    dims, shape_c = [0] + list(range(2, x.dim())), (1, shape[1]) + (1,) * (x.dim() - 2)
    count = x.numel() // shape[1]
    xhat = ((x.double() - mean64.view(shape_c)) * rstd64.view(shape_c)).abs()
    dy = dout.double().abs() * ((y64 > 0) if relu else 1)
    sw, sb = (dy * xhat).sum(dims), dy.sum(dims)
    scales = ((rstd64 * w.double()).abs().view(shape_c) * (dy + sb.view(shape_c) / count + xhat * sw.view(shape_c) / count),
              sw, sb)
    if dx_ in LOW and not mixed:
        xt, wt, bt = (t.detach().clone().requires_grad_() for t in (x, w, b))
        yt = F.batch_norm(xt, None, None, wt, bt, training=True, eps=eps)
        torch.autograd.backward(torch.relu(yt) if relu else yt, dout)
        _check_grads((dx, dweight, dbias), (xt.grad, wt.grad, bt.grad), exact, scales, dx_, acc)
    else:
        _check_grads((dx, dweight, dbias), None, exact, scales, dx_, acc)
    untouched((dout, x, w, b, mean, rstd), before)


# --- bias_gelu / bias_gelu_bwd -----------------------------------------------------------------

@fuzz(200)
@given(entry=entries, shape=shapes(min_dims=1), dx_=dtypes, db=dtypes, mixed=st.booleans(),
       approximate=st.sampled_from(["none", "tanh"]), lx=layouts, ld=layouts, seed=seeds)
def test_bias_gelu(entry, shape, dx_, db, mixed, approximate, lx, ld, seed):
    if not mixed:
        db = dx_
    fwd, bwd = (bias_gelu, bias_gelu_bwd) if entry == "python" else (R.bias_gelu, R.bias_gelu_bwd)
    gen, n = gen_of(seed), shape[-1]
    x, dy = make(shape, dx_, lx, gen), make(shape, dx_, ld, gen, 1.0, 0.0)
    bias = make((n,), db, "contiguous", gen, 1.0, 0.0)
    before = snapshot(x, dy, bias)
    y = fwd(x, bias, approximate)
    dx, dbias = bwd(dy, x, bias, approximate)
    assert y.dtype == dx.dtype == dx_ and dbias.dtype == db
    assert y.shape == dx.shape == shape and dbias.shape == (n,)
    assert y.is_contiguous() and dx.is_contiguous()
    acc = torch.float64 if torch.float64 in (dx_, db) else torch.float32
    z64 = x.double() + bias.double()
    y64 = F.gelu(z64, approximate=approximate)
    dx64 = torch.ops.aten.gelu_backward(dy.double(), z64, approximate=approximate)
    dbias64 = dx64.reshape(-1, n).sum(0) if n else dx64.new_zeros(0)
    # In absolute values, as in close_rel: "none" forms 1 + erf(z / sqrt 2), which cancels in the
    # negative tail in any fp32 evaluation (PyTorch's fp32 F.gelu alike); the tanh form's 1 + tanh u.
    if approximate == "none":
        s_ = 1 + torch.special.erf(z64 / math.sqrt(2)).abs()
        dgelu = 0.5 * s_ + z64.abs() * torch.exp(-0.5 * z64**2) / math.sqrt(2 * math.pi)
    else:
        u = math.sqrt(2 / math.pi) * (z64 + 0.044715 * z64**3)
        s_ = 1 + torch.tanh(u).abs()
        dgelu = 0.5 * s_ + 0.5 * z64.abs() * (1 + torch.tanh(u) ** 2) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * z64**2)
    y_scale, dx_scale = 0.5 * z64.abs() * s_, dy.double().abs() * dgelu
    dbias_scale = dx_scale.reshape(-1, n).sum(0) if n else None  # dbias sums dx over rows
    if dx_ in LOW and not mixed:
        xt, bt = x.clone().requires_grad_(), bias.clone().requires_grad_()
        yt = F.gelu(xt + bt, approximate=approximate)
        yt.backward(dy)
        for got, composed, e, scale, what in ((y, yt, y64, y_scale, "y"), (dx, xt.grad, dx64, dx_scale, "dx"),
                                              (dbias, bt.grad, dbias64, dbias_scale, "dbias")):
            if composed is None:  # no rows: no grads at all
                continue
            within_2x(got, composed, e, f"{what} {dx_}", scale)
    else:
        for got, e, scale, what in ((y, y64, y_scale, "y"), (dx, dx64, dx_scale, "dx"), (dbias, dbias64, dbias_scale, "dbias")):
            if got.dtype in LOW:
                one_rounding(got, e, what, scale)
            else:
                close_rel(got, e, fp_tol(got.dtype, acc), what, scale)
    untouched((x, dy, bias), before)


# --- linear_sub --------------------------------------------------------------------------------

@fuzz(200)
# bf16 with a bias, found by this test: folding the bias into a bf16 accumulator (y - b rounded
# before the GEMM) made the error 2.15x the composition's; the op now rounds as F.linear does.
@example(lead=[3, 5], k=45, n=26, dtype=torch.bfloat16, mixed=False, has_bias=True, entry="python", ly="sliced",
         la="strided", lw="contiguous", seed=2147483646)
@given(lead=st.lists(st.integers(0, 6), max_size=2), k=st.integers(0, 48), n=st.integers(0, 48),
       dtype=dtypes, mixed=st.booleans(), has_bias=st.booleans(), entry=entries, ly=layouts, la=layouts,
       lw=layouts, seed=seeds)
def test_linear_sub(lead, k, n, dtype, mixed, has_bias, entry, ly, la, lw, seed):
    op = linear_sub if entry == "python" else R.linear_sub
    gen = gen_of(seed)
    lead = tuple(lead)
    # mixed: an fp32 stream with a low-precision GEMM, a bf16 stream with an fp32 one, an fp32 with an fp64 one
    ydt = {torch.float32: torch.bfloat16, torch.float64: torch.float32}.get(dtype, torch.float32) if mixed else dtype
    y, a = make(lead + (n,), ydt, ly, gen, 1.0, 0.0), make(lead + (k,), dtype, la, gen, 1.0, 0.0)
    w = make((n, k), dtype, lw, gen, 1 / math.sqrt(max(k, 1)), 0.0)
    b = make((n,), dtype, "contiguous", gen, 1.0, 0.0) if has_bias else None
    inputs = (y, a, w) + ((b,) if has_bias else ())
    before = snapshot(*inputs)
    out = op(y, a, w, b)
    assert out.dtype == ydt and out.shape == y.shape and out.is_contiguous()  # contiguous: the fake kernel's
    exact = y.double() - F.linear(a.double(), w.double(), None if b is None else b.double())
    scale = y.double().abs() + F.linear(a.double().abs(), w.double().abs(), None if b is None else b.double().abs())
    if ydt in LOW:  # the same-dtype composition, or the fp32 one rounded once to the bf16 stream
        within_2x(out, (y - F.linear(a, w, b)).to(ydt), exact, f"linear_sub {ydt} stream, {dtype} GEMM", scale)
    elif dtype in LOW:
        # Documented CPU path: the product is formed in the low dtype (one rounding of a @ W^T) and
        # subtracted from the fp32 accumulator y - b.
        product = F.linear(a.double(), w.double()).abs()
        err = (out.double() - exact).abs()
        bound = HALF_ULP[dtype] * product + 1e-5 * scale.max() if out.numel() else err
        assert (err <= bound).all(), f"linear_sub fp32 stream, {dtype} GEMM: past one rounding of the product"
    else:
        close_rel(out, exact, 1e-12 if ydt == torch.float64 else 1e-5, "linear_sub", scale)
    untouched(inputs, before)


# --- autograd of every differentiable op against autograd of its reference, in float64 ----------

@fuzz(120)
@given(which=st.sampled_from(["coupling_sub", "coupling_add", "sub_layer_norm", "bias_gelu", "linear_sub"]),
       shape=shapes(min_dims=1, max_dims=3, min_last=1), approximate=st.sampled_from(["none", "tanh"]),
       k=st.integers(1, 16), layout=layouts, seed=seeds)
def test_autograd_matches_reference(which, shape, approximate, k, layout, seed):
    gen, n = gen_of(seed), shape[-1]

    def leaf(s, lay="contiguous", scale=1.0, offset=0.0):
        return make(s, torch.float64, lay, gen, scale, offset).detach().requires_grad_()

    if which in ("coupling_sub", "coupling_add"):
        args = (leaf(shape, layout), leaf(shape))
        op = coupling_sub if which == "coupling_sub" else coupling_add
        ref = (lambda p, q: p - q) if which == "coupling_sub" else (lambda p, q: p + q)
    elif which == "sub_layer_norm":
        args = (leaf(shape, layout, 3.0, 0.5), leaf(shape), leaf((n,), scale=0.5, offset=1.0), leaf((n,)))
        op = lambda *t: sub_layer_norm(*t)[:2]  # noqa: E731
        ref = lambda y_, g_, w_, b_: (y_ - g_, F.layer_norm(y_ - g_, (n,), w_, b_, 1e-5))  # noqa: E731
    elif which == "bias_gelu":
        args = (leaf(shape, layout, 2.0, 0.25), leaf((n,)))
        op = lambda x_, b_: bias_gelu(x_, b_, approximate)  # noqa: E731
        ref = lambda x_, b_: F.gelu(x_ + b_, approximate=approximate)  # noqa: E731
    else:
        args = (leaf(shape[:-1] + (n,), layout), leaf(shape[:-1] + (k,)), leaf((n, k)), leaf((n,)))
        op = linear_sub
        ref = lambda y_, a_, w_, b_: y_ - F.linear(a_, w_, b_)  # noqa: E731
    outs, refs = op(*args), ref(*args)
    outs, refs = (outs, refs) if isinstance(outs, tuple) else ((outs,), (refs,))
    cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in refs]
    got = torch.autograd.grad(outs, args, cotangents, allow_unused=True)
    want = torch.autograd.grad(refs, args, cotangents, allow_unused=True)
    for i, (g_, w_) in enumerate(zip(got, want)):
        if w_ is None or w_.numel() == 0 or (which == "linear_sub" and i == 3):
            continue  # linear_sub's bias grad goes through fp32: test_linear_sub_fp64_bias_grad
        assert g_ is not None and g_.shape == w_.shape and g_.dtype == w_.dtype, f"{which} grad {i}"
        # float64 both ways; values are O(1), so an absolute floor of 1e-10 covers grads that are 0
        # exactly (LayerNorm's dweight at width 1) but come out as round-off from the reference.
        err = (g_ - w_).abs().max().item()
        assert err <= 1e-10 * max(1.0, w_.abs().max().item()), f"{which} grad {i}: error {err:.3e}"


# --- invalid input -----------------------------------------------------------------------------

INT_DTYPES = [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
bad_dtypes = st.sampled_from(INT_DTYPES + [torch.complex64])
bad_approx = st.text(max_size=6).filter(lambda s: s not in ("none", "tanh"))


def expect(call, error, names):
    """`call` raises `error` whose message names one of `names` (no other exception, no result)."""
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert any(name in message for name in names), f"{error.__name__} does not name {names}: {message}"


def _bad_dtype(t, dtype):
    return t.to(dtype) if dtype != torch.bool else t > 0


@st.composite
def wrong_shape(draw, shape):
    """A shape other than `shape` (one more or one less dim, or one dim changed)."""
    kind = draw(st.sampled_from(["extra", "drop", "change"]))
    if kind == "extra" or not shape:
        return tuple(shape) + (draw(st.integers(2, 3)),)
    if kind == "drop":
        return tuple(shape[:-1])
    i = draw(st.integers(0, len(shape) - 1))
    s = list(shape)
    s[i] = s[i] + draw(st.integers(1, 3))
    return tuple(s)


@fuzz(120)
@given(which=st.sampled_from(["sub", "add"]), entry=entries, shape=shapes(max_dims=3),
       bad=st.sampled_from(["shape", "dtype1", "dtype2", "not_tensor", "device"]), bad_dtype=bad_dtypes,
       data=st.data())
def test_coupling_bad_input(which, entry, shape, bad, bad_dtype, data):
    py, direct, _, (first, second) = COUPLING[which]
    op = py if entry == "python" else direct
    a, b = torch.randn(shape), torch.randn(shape)
    if bad == "shape":
        b = torch.randn(data.draw(wrong_shape(shape)))
        expect(lambda: op(a, b), ValueError, [second])
    elif bad == "dtype1":
        expect(lambda: op(_bad_dtype(a, bad_dtype), b), TypeError, [first])
    elif bad == "dtype2":
        expect(lambda: op(a, _bad_dtype(b, bad_dtype)), TypeError, [second])
    elif bad == "not_tensor":
        value = data.draw(st.sampled_from([1.0, 2, None, [0.0], "x"]))
        expect(lambda: op(a, value), not_a_tensor_error(value), [second])
    else:
        swap = data.draw(st.booleans())
        a, b = (a.to("meta"), b) if swap else (a, b.to("meta"))
        expect(lambda: op(a, b), ValueError, [second])


@fuzz(120)
@given(entry=entries, shape=shapes(min_dims=1, max_dims=3, min_last=1), bwd=st.booleans(),
       bad=st.sampled_from(["approx", "approx_type", "bias_shape", "x_dtype", "bias_dtype", "x_0d", "bias_device",
                            "x_device", "bias_not_tensor", "dy_dtype", "dy_float_dtype", "dy_shape",
                            "dy_device"]),
       bad_dtype=bad_dtypes, approx=bad_approx, data=st.data())
def test_bias_gelu_bad_input(entry, shape, bwd, bad, bad_dtype, approx, data):
    if bad.startswith("dy"):
        bwd = True
    fwd_op, bwd_op = (bias_gelu, bias_gelu_bwd) if entry == "python" else (R.bias_gelu, R.bias_gelu_bwd)
    x, bias, dy, a = torch.randn(shape), torch.randn(shape[-1]), torch.randn(shape), "none"
    if bad == "approx":
        a, error, names = approx, ValueError, ["approximate"]
    elif bad == "approx_type":
        # (bytes convert to str)
        a, error, names = data.draw(st.sampled_from([None, 1, ["none"]])), NOT_CONVERTIBLE, ["approximate"]
    elif bad == "bias_shape":
        bias, error, names = torch.randn(data.draw(wrong_shape((shape[-1],)))), ValueError, ["bias"]
    elif bad == "x_dtype":
        x, error, names = _bad_dtype(x, bad_dtype), TypeError, ["x"]
    elif bad == "bias_dtype":
        bias, error, names = _bad_dtype(bias, bad_dtype), TypeError, ["bias"]
    elif bad == "x_0d":
        x, dy, bias, error, names = torch.tensor(1.0), torch.tensor(1.0), torch.randn(1), ValueError, ["x"]
    elif bad == "bias_device":
        bias, error, names = bias.to("meta"), ValueError, ["bias"]
    elif bad == "x_device":
        x, dy, error, names = x.to("meta"), dy.to("meta"), ValueError, ["bias"]
    elif bad == "bias_not_tensor":
        bias, names = data.draw(st.sampled_from([1.0, [0.0] * shape[-1], None])), ["bias"]
        error = not_a_tensor_error(bias)
    elif bad == "dy_dtype":
        dy, error, names = _bad_dtype(dy, bad_dtype), TypeError, ["dy"]
    elif bad == "dy_float_dtype":
        dy, error, names = dy.to(data.draw(st.sampled_from([torch.float64, torch.bfloat16, torch.float16]))), TypeError, ["dy"]
    elif bad == "dy_shape":
        dy, error, names = torch.randn(data.draw(wrong_shape(shape))), ValueError, ["dy"]
    else:
        dy, error, names = dy.to("meta"), ValueError, ["dy"]
    if bwd:
        expect(lambda: bwd_op(dy, x, bias, a), error, names)
    else:
        expect(lambda: fwd_op(x, bias, a), error, names)


@fuzz(120)
@given(entry=entries, shape=shapes(min_dims=1, max_dims=3, min_last=1),
       bad=st.sampled_from(["g_shape", "dtype", "weight_shape", "bias_shape", "eps", "eps_type", "zero_d", "empty_n",
                            "device", "not_tensor"]),
       bad_dtype=bad_dtypes, data=st.data())
def test_sub_layer_norm_bad_input(entry, shape, bad, bad_dtype, data):
    op = sub_layer_norm if entry == "python" else R.sub_layer_norm
    n = shape[-1]
    args = {"y": torch.randn(shape), "g": torch.randn(shape), "weight": torch.randn(n), "bias": torch.randn(n),
            "eps": 1e-5}
    name = data.draw(st.sampled_from(["y", "g", "weight", "bias"]))
    if bad == "g_shape":
        args["g"], error, names = torch.randn(data.draw(wrong_shape(shape))), ValueError, ["g"]
    elif bad == "dtype":
        args[name], error, names = _bad_dtype(args[name], bad_dtype), TypeError, [name]
    elif bad in ("weight_shape", "bias_shape"):
        p = bad[:-6]
        args[p], error, names = torch.randn(data.draw(wrong_shape((n,)))), ValueError, [p]
    elif bad == "eps":
        args["eps"], error, names = data.draw(st.sampled_from([-1e-5, -1.0, math.nan, math.inf, -math.inf])), ValueError, ["eps"]
    elif bad == "eps_type":
        # The Python entry checks its scalars before the op (TypeError: not a real number); the op's
        # schema parser rejects what does not convert to a float (RuntimeError naming eps).
        args["eps"] = data.draw(st.sampled_from(["1e-5", None, [1e-5], True]))
        error, names = TypeError if entry == "python" else NOT_CONVERTIBLE, ["eps"]
        if args["eps"] is True and entry != "python":
            return  # the parser converts True to 1.0: only the entry point guards against it
    elif bad == "zero_d":
        args.update(y=torch.tensor(1.0), g=torch.tensor(1.0), weight=torch.randn(1), bias=torch.randn(1))
        error, names = ValueError, ["y"]
    elif bad == "empty_n":
        args.update(y=torch.randn(shape[:-1] + (0,)), g=torch.randn(shape[:-1] + (0,)), weight=torch.randn(0),
                    bias=torch.randn(0))
        error, names = ValueError, ["y"]
    elif bad == "device":
        name = data.draw(st.sampled_from(["g", "weight", "bias"]))
        args[name], error, names = args[name].to("meta"), ValueError, [name]
    else:
        args[name], names = data.draw(st.sampled_from([1.0, None, [1.0]])), [name]
        error = not_a_tensor_error(args[name])
    expect(lambda: op(args["y"], args["g"], args["weight"], args["bias"], args["eps"]), error, names)


@fuzz(120)
@given(entry=entries, shape=shapes(min_dims=1, max_dims=3, min_last=1),
       bad=st.sampled_from(["dln_dtype", "dtype", "shape", "weight_shape", "stat_shape", "zero_d", "empty_n",
                            "device", "not_tensor"]),
       bad_dtype=bad_dtypes, data=st.data())
def test_layer_norm_bwd_add_bad_input(entry, shape, bad, bad_dtype, data):
    op = layer_norm_bwd_add if entry == "python" else R.layer_norm_bwd_add
    n = shape[-1]
    args = {"dln": torch.randn(shape), "x": torch.randn(shape), "weight": torch.randn(n),
            "mean": torch.randn(shape[:-1]), "rstd": torch.rand(shape[:-1]) + 0.5, "dres": torch.randn(shape)}
    others = ["dln", "weight", "mean", "rstd", "dres"]
    if bad == "dln_dtype":
        args["dln"], error, names = args["dln"].to(data.draw(st.sampled_from(FLOATS[1:]))), TypeError, ["dln"]
    elif bad == "dtype":
        name = data.draw(st.sampled_from(["x"] + others))
        args[name], error, names = _bad_dtype(args[name], bad_dtype), TypeError, [name]
    elif bad == "shape":
        name = data.draw(st.sampled_from(["dln", "dres"]))
        args[name], error, names = torch.randn(data.draw(wrong_shape(shape))), ValueError, [name]
    elif bad == "weight_shape":
        args["weight"], error, names = torch.randn(data.draw(wrong_shape((n,)))), ValueError, ["weight"]
    elif bad == "stat_shape":
        name = data.draw(st.sampled_from(["mean", "rstd"]))
        args[name], error, names = torch.randn(data.draw(wrong_shape(shape[:-1]))), ValueError, [name]
    elif bad == "zero_d":
        args = {k: torch.tensor(1.0) for k in args}
        args["weight"] = torch.randn(1)
        error, names = ValueError, ["x"]
    elif bad == "empty_n":
        e = shape[:-1] + (0,)
        args.update(dln=torch.randn(e), x=torch.randn(e), dres=torch.randn(e), weight=torch.randn(0))
        error, names = ValueError, ["x"]
    elif bad == "device":
        name = data.draw(st.sampled_from(others))
        args[name], error, names = args[name].to("meta"), ValueError, [name]
    else:
        name = data.draw(st.sampled_from(["x"] + others))
        args[name], names = data.draw(st.sampled_from([1.0, None, [1.0]])), [name]
        error = not_a_tensor_error(args[name])
    expect(lambda: op(*args.values()), error, names)


@fuzz(120)
@given(lead=st.lists(st.integers(1, 5), max_size=2), k=st.integers(1, 12), n=st.integers(1, 12),
       bad=st.sampled_from(["weight_dim", "a_width", "a_0d", "y_shape", "bias_shape", "dtype", "not_tensor", "device"]),
       bad_dtype=bad_dtypes, data=st.data())
def test_linear_sub_bad_input(lead, k, n, bad, bad_dtype, data):
    lead = tuple(lead)
    args = {"y": torch.randn(lead + (n,)), "a": torch.randn(lead + (k,)), "weight": torch.randn(n, k),
            "bias": torch.randn(n)}
    if bad == "weight_dim":
        args["weight"], error, names = torch.randn(data.draw(st.sampled_from([(n,), (1, n, k), ()]))), ValueError, ["weight"]
    elif bad == "a_width":
        args["a"], error, names = torch.randn(lead + (k + data.draw(st.integers(1, 3)),)), ValueError, ["a"]
    elif bad == "a_0d":
        args["a"], error, names = torch.tensor(1.0), ValueError, ["a"]
    elif bad == "y_shape":
        args["y"], error, names = torch.randn(data.draw(wrong_shape(lead + (n,)))), ValueError, ["y"]
    elif bad == "bias_shape":
        args["bias"], error, names = torch.randn(data.draw(wrong_shape((n,)))), ValueError, ["bias"]
    elif bad == "dtype":
        name = data.draw(st.sampled_from(list(args)))
        args[name], error, names = _bad_dtype(args[name], bad_dtype), TypeError, [name]
    elif bad == "not_tensor":
        name = data.draw(st.sampled_from(["y", "a", "weight", "bias"]))
        values = [1.0, "w", [1.0]] + ([None] if name != "bias" else [])  # bias=None: no bias
        args[name], names = data.draw(st.sampled_from(values)), [name]
        error = not_a_tensor_error(args[name])
    else:
        name = data.draw(st.sampled_from(list(args)))
        args[name], error, names = args[name].to("meta"), ValueError, ["device"]
    expect(lambda: linear_sub(*args.values()), error, names)


# --- direct torch.ops calls: what the dispatcher and the fake kernels do -----------------------

@pytest.mark.parametrize("call,arg", [
    (lambda: R.coupling_sub(torch.randn(3), 1.0), "f"),
    (lambda: R.bias_gelu(torch.randn(2, 3), [0.0] * 3), "bias"),
    (lambda: R.bias_gelu(torch.randn(2, 3), torch.randn(3), None), "approximate"),
    (lambda: R.sub_layer_norm(torch.randn(2, 3), torch.randn(2, 3), torch.randn(3), torch.randn(3), "1e-5"), "eps"),
])
def test_direct_non_tensor(call, arg):
    # Not the ops' own checks: PyTorch's schema parser rejects the argument before any kernel runs,
    # naming it, but as a RuntimeError (not fixable in revkernels; the entry points are these ops).
    with pytest.raises(RuntimeError, match=f"for argument '{arg}'"):
        call()


def _m(*shape):
    return torch.randn(*shape, device="meta")


@pytest.mark.parametrize("case", ["coupling_sub", "coupling_add", "coupling_sub int on meta", "sub_layer_norm",
                                  "layer_norm_bwd_add"])
def test_direct_mismatched_device_raises(case):
    x = torch.randn(3, 4)
    call = {
        "coupling_sub": lambda: R.coupling_sub(x, _m(3, 4)),
        "coupling_add": lambda: R.coupling_add(_m(3, 4), x),
        "coupling_sub int on meta": lambda: R.coupling_sub(_m(3, 4).int(), _m(3, 4)),
        "sub_layer_norm": lambda: R.sub_layer_norm(x, x, _m(4), torch.randn(4), 1e-5),
        "layer_norm_bwd_add": lambda: R.layer_norm_bwd_add(x, x, torch.randn(4), torch.randn(3), torch.randn(3),
                                                           _m(3, 4)),
    }[case]
    with pytest.raises((TypeError, ValueError)):
        call()


@pytest.mark.parametrize("case,arg", [("y_shape", "y"), ("a_width", "a"), ("weight_1d", "weight"),
                                      ("bias_shape", "bias"), ("bias_2d", "bias"), ("int_a", "a"), ("meta_bias", "bias")])
def test_direct_linear_sub_bad_input(case, arg):
    y, a, w, b = torch.randn(3, 6), torch.randn(3, 4), torch.randn(6, 4), torch.randn(6)
    args = {"y_shape": (torch.randn(3, 5), a, w, b), "a_width": (y, torch.randn(3, 5), w, b),
            "weight_1d": (y, a, torch.randn(4), b), "bias_shape": (y, a, w, torch.randn(5)),
            "bias_2d": (y, a, w, torch.randn(1, 6)), "int_a": (y, a.int(), w, b), "meta_bias": (y, a, w, b.to("meta"))}[case]
    expect(lambda: R.linear_sub(*args), (TypeError, ValueError), [arg])


def test_linear_sub_fp64_bias_grad():
    y, a, w = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 2, dtype=torch.float64) * 1.1
    (db,) = torch.autograd.grad(linear_sub(y, a, w, b), b, g)
    torch.testing.assert_close(db, -g.sum(0), rtol=1e-12, atol=1e-12)
