"""revkernels::sub_layer_norm / layer_norm_bwd_add against float64 references and torch's own
LayerNorm: the C++ CPU kernels, the Triton kernels (under TRITON_INTERPRET=1 on CPU, fp32 only)
and, with -m gpu, the CUDA path."""

import functools
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import revkernels as rk
from revkernels.ops._library import has_compiled_kernel
from revkernels.ops.coupling import coupling_sub_reference
from revkernels.ops.layer_norm import (layer_norm_bwd_add, layer_norm_bwd_add_reference, sub_layer_norm,
                                       sub_layer_norm_reference)
from tests.helpers import assert_close_rel, assert_low_precision_rule, run_without_c_extension, triton_device

EPS = 1e-5
ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the checkout, for the subprocess checks
# Widths 33, 1000, 4097; one row and up to a few hundred, some with two leading dims.
SHAPES = [(1, 33), (200, 33), (1, 1000), (3, 40, 1000), (1, 4097), (64, 4097)]
LOW_PRECISION = [torch.bfloat16, torch.float16]


def _random(shape, dtype=torch.float32):
    """Data with an offset: x = y - g and its row means are well away from zero (a row mean has a
    spread of about 3.2 / sqrt(width): 0.55 for one row of 33, so an offset of 0.5 let a mean come
    near zero and its rounding error look large relative to it)."""
    return (torch.randn(shape) * 3 + 4.0).to(dtype)


def _g(shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype)


def _params(n, dtype=torch.float32):
    return (1 + 0.5 * torch.randn(n)).to(dtype), torch.randn(n).to(dtype)


def _stats(x):
    """fp32 mean and rstd of x over the last dim (as the forward returns them)."""
    x64 = x.double()
    return x64.mean(-1).float(), torch.rsqrt(x64.var(-1, correction=0) + EPS).float()


def _max_err(actual, exact):
    return (actual.double() - exact.double()).abs().max().item()


def _assert_within_2x(actual, torch_result, exact, what):
    """The low-precision rule: error against the exact result at most 2x that of torch's op."""
    err, torch_err = _max_err(actual, exact), _max_err(torch_result, exact)
    assert err <= 2 * torch_err, f"{what}: error {err:.3e} > 2 x torch's {torch_err:.3e}"


def _assert_one_rounding(actual, exact):
    """Elementwise: one rounding to actual's dtype (half an ulp: 2^-8 relative for bf16, 2^-11 for
    fp16) of a value accurate to fp32 (1e-5 of the largest |exact|). Stricter than the 2x rule where
    it applies: ln formed from an x other than the stored one stays within 2x of torch's error but
    fails here."""
    half_ulp = {torch.bfloat16: 2**-8, torch.float16: 2**-11}.get(actual.dtype, 0.0)
    err = (actual.double() - exact.double()).abs()
    bound = exact.double().abs() * half_ulp + 1e-5 * exact.double().abs().max()
    assert (err <= bound).all(), f"{actual.dtype}: error up to {(err - bound).max().item():.3e} past one rounding"


def _torch_layer_norm_grads(x, weight, bias, dln):
    """(dx, dweight, dbias) of F.layer_norm by torch's autograd, in the inputs' dtypes."""
    x, weight, bias = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    F.layer_norm(x, x.shape[-1:], weight, bias, EPS).backward(dln)
    return x.grad, weight.grad, bias.grad


def test_cpu_kernels_are_compiled():
    assert rk.HAS_C_EXTENSION, rk._extension.C_EXTENSION_ERROR
    assert has_compiled_kernel("sub_layer_norm", "CPU") and has_compiled_kernel("layer_norm_bwd_add", "CPU")


# --- sub_layer_norm on the C++ CPU path ----------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_sub_layer_norm_fp32(shape):
    y, g = _random(shape), _g(shape)
    weight, bias = _params(shape[-1])
    x, ln, mean, rstd = sub_layer_norm(y, g, weight, bias, EPS)
    assert x.dtype == ln.dtype == mean.dtype == rstd.dtype == torch.float32
    assert x.shape == ln.shape == shape and mean.shape == rstd.shape == shape[:-1]
    assert x.is_contiguous() and ln.is_contiguous()
    torch.testing.assert_close(x, coupling_sub_reference(y, g), rtol=0, atol=0)  # rounded once
    want = sub_layer_norm_reference(*(t.double() for t in (y, g, weight, bias)), EPS)
    for got, exact, what in zip((x, ln, mean, rstd), want, ("x", "ln", "mean", "rstd")):
        assert_close_rel(got, exact, 1e-5, what)


def _constant_rows(rows, n, dtype=torch.float32, device="cpu"):
    """y and g whose x = y - g has rows of one value each (random, up to 1e4: a row mean formed by
    summing the values rounds), beside a row of random data."""
    values = torch.randn(rows, 1, dtype=torch.float64) * 1e4
    y = values.expand(rows, n).to(dtype)
    g = torch.full((rows, n), 0.375, dtype=dtype)
    random_y, random_g = _random((1, n)).to(dtype), _g((1, n)).to(dtype)
    return torch.cat([y, random_y]).to(device), torch.cat([g, random_g]).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [7, 129, 768, 4097])
def test_sub_layer_norm_constant_rows(n, dtype):
    """A row of one value: mean exact, ln = bias (its mean, summed from the values, rounded; the
    rounding over sqrt(eps) put ln 5e-3 off in fp32)."""
    y, g = _constant_rows(3, n, dtype)
    weight, bias = _params(n, dtype)
    x, ln, mean, rstd = sub_layer_norm(y, g, weight, bias, EPS)
    want = sub_layer_norm_reference(*(t.double() for t in (y, g, weight, bias)), EPS)
    for got, exact, what in zip((x, ln, mean, rstd), want, ("x", "ln", "mean", "rstd")):
        assert_close_rel(got, exact, 1e-5, what)
    assert torch.equal(mean[:3], x[:3, 0].to(mean.dtype)) and torch.equal(ln[:3], bias.expand(3, n))


def _check_mean_of_rows_starting_with_inf(kernel, device="cpu"):
    y = _random((4, 33))
    y[0, 0], y[1, 0], y[2, 5] = float("inf"), float("-inf"), float("inf")
    g, (weight, bias) = _g((4, 33)), _params(33)
    mean = kernel(*(t.to(device) for t in (y, g, weight, bias)), EPS)[2].cpu()
    want = sub_layer_norm_reference(y.double(), g.double(), weight.double(), bias.double(), EPS)[2]
    assert torch.equal(mean[:3], want[:3].float()) and mean[:3].isinf().all()
    assert_close_rel(mean[3:], want[3:], 1e-5, "mean of the finite row")


def test_sub_layer_norm_mean_of_a_row_starting_with_inf():
    """A row whose first x is infinite: mean inf or -inf as the reference's (it was NaN: the sums
    are shifted by the first value, and inf - inf is NaN; a non-finite first value shifts by 0)."""
    _check_mean_of_rows_starting_with_inf(sub_layer_norm)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("shape", SHAPES)
def test_sub_layer_norm_low_precision(dtype, shape):
    y, g = _random(shape, dtype), _g(shape, dtype)
    weight, bias = _params(shape[-1], dtype)
    x, ln, mean, rstd = sub_layer_norm(y, g, weight, bias, EPS)
    assert x.dtype == ln.dtype == dtype and mean.dtype == rstd.dtype == torch.float32
    torch.testing.assert_close(x, coupling_sub_reference(y, g), rtol=0, atol=0)
    # ln is the LayerNorm of the stored (rounded) x: compare with torch's on that x.
    exact = F.layer_norm(x.double(), shape[-1:], weight.double(), bias.double(), EPS)
    _assert_within_2x(ln, F.layer_norm(x, shape[-1:], weight, bias, EPS), exact, f"ln {dtype}")
    _assert_one_rounding(ln, exact)
    want_mean, want_rstd = _stats(x)
    assert_close_rel(mean, want_mean, 1e-5, "mean")
    assert_close_rel(rstd, want_rstd, 1e-5, "rstd")


@pytest.mark.parametrize("y_dtype,g_dtype,param_dtype", [
    (torch.float32, torch.bfloat16, torch.float32), (torch.float32, torch.float16, torch.bfloat16),
    (torch.bfloat16, torch.float32, torch.float32), (torch.float32, torch.float64, torch.float32),
    (torch.float64, torch.float64, torch.float64)])
def test_sub_layer_norm_mixed_dtypes(y_dtype, g_dtype, param_dtype):
    y, g = _random((50, 1000), y_dtype), _g((50, 1000), g_dtype)
    weight, bias = _params(1000, param_dtype)
    x, ln, mean, rstd = sub_layer_norm(y, g, weight, bias, EPS)
    stats_dtype = torch.float64 if torch.float64 in (y_dtype, g_dtype) else torch.float32
    assert x.dtype == ln.dtype == y_dtype and mean.dtype == rstd.dtype == stats_dtype
    torch.testing.assert_close(x, coupling_sub_reference(y, g), rtol=0, atol=0)
    exact = F.layer_norm(x.double(), (1000,), weight.double(), bias.double(), EPS)
    if y_dtype == torch.bfloat16:
        _assert_one_rounding(ln, exact)
    else:
        assert_close_rel(ln, exact, 1e-12 if y_dtype == torch.float64 else 1e-5, "ln")
    want_mean, want_rstd = x.double().mean(-1), torch.rsqrt(x.double().var(-1, correction=0) + EPS)
    assert_close_rel(mean, want_mean, 1e-5, "mean")
    assert_close_rel(rstd, want_rstd, 1e-5, "rstd")


# --- layer_norm_bwd_add on the C++ CPU path ------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_bwd_add_fp32(shape):
    x, dln, dres = _random(shape), torch.randn(shape), torch.randn(shape)
    weight, bias = _params(shape[-1])
    mean, rstd = _stats(x)
    dx, dweight, dbias = layer_norm_bwd_add(dln, x, weight, mean, rstd, dres)
    assert dx.dtype == dweight.dtype == dbias.dtype == torch.float32
    assert dx.shape == shape and dweight.shape == dbias.shape == shape[-1:]
    # Reference: torch's autograd of LayerNorm in float64, plus the residual gradient.
    gx, gw, gb = _torch_layer_norm_grads(x.double(), weight.double(), bias.double(), dln.double())
    assert_close_rel(dx, dres.double() + gx, 1e-5, "dx")
    assert_close_rel(dweight, gw, 1e-5, "dweight")
    assert_close_rel(dbias, gb, 1e-5, "dbias")
    # The pure-PyTorch reference's explicit formulas agree with autograd.
    ref = layer_norm_bwd_add_reference(dln.double(), x.double(), weight.double(), mean.double(), rstd.double(),
                                       dres.double())
    for got, exact, what in zip(ref, (dres.double() + gx, gw, gb), ("dx", "dweight", "dbias")):
        assert_close_rel(got, exact, 1e-5, f"reference {what}")


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm_bwd_add_low_precision(dtype, shape):
    y, g = _random(shape, dtype), _g(shape, dtype)
    weight, bias = _params(shape[-1], dtype)
    x, _, mean, rstd = sub_layer_norm(y, g, weight, bias, EPS)
    dln, dres = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    dx, dweight, dbias = layer_norm_bwd_add(dln, x, weight, mean, rstd, dres)
    assert dx.dtype == dweight.dtype == dbias.dtype == dtype
    exact = _torch_layer_norm_grads(x.double(), weight.double(), bias.double(), dln.double())
    exact = (dres.double() + exact[0],) + exact[1:]
    tx, tw, tb = _torch_layer_norm_grads(x, weight, bias, dln)
    for ours, theirs, e, what in zip((dx, dweight, dbias), (dres + tx, tw, tb), exact, ("dx", "dweight", "dbias")):
        _assert_within_2x(ours, theirs, e, f"{what} {dtype}")


@pytest.mark.parametrize("x_dtype,dres_dtype,weight_dtype", [
    (torch.bfloat16, torch.float32, torch.float32), (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16, torch.float32), (torch.float32, torch.float64, torch.float32)])
def test_layer_norm_bwd_add_mixed_dtypes(x_dtype, dres_dtype, weight_dtype):
    x, dln, dres = _random((40, 1000), x_dtype), torch.randn(40, 1000).to(x_dtype), torch.randn(40, 1000).to(dres_dtype)
    weight, _ = _params(1000, weight_dtype)
    mean, rstd = _stats(x)
    dx, dweight, dbias = layer_norm_bwd_add(dln, x, weight, mean, rstd, dres)
    assert dx.dtype == dres_dtype and dweight.dtype == dbias.dtype == weight_dtype
    exact = layer_norm_bwd_add_reference(dln.double(), x.double(), weight.double(), mean.double(), rstd.double(),
                                         dres.double())
    for got, e in zip((dx, dweight, dbias), exact):
        _assert_one_rounding(got, e)


# --- layouts, empty inputs -----------------------------------------------------------------------

def _layout_inputs(layout, dtype):
    """Four (rows, n) inputs a, b, c, d in `layout` and params (weight, bias)."""
    n = 33 if layout != "sliced rows" else 1000
    make = {
        "transposed": lambda: _random((n, 40), dtype).t(),  # last dim strided: copied
        "sliced rows": lambda: _random((40, n + 10), dtype)[:, 5:n + 5],  # row stride n + 10: a view
        "every other row": lambda: _random((80, n), dtype)[::2],
        "broadcast row": lambda: _random((1, n), dtype).expand(40, n),  # row stride 0
        "permuted 3-d": lambda: _random((8, 5, n), dtype).transpose(0, 1),  # leading dims do not merge
    }[layout]
    weight, bias = _params(2 * n, dtype)
    return (make(), _random((40, n) if layout != "permuted 3-d" else (5, 8, n), dtype), make(), make(),
            weight[::2], bias[::2])


LAYOUTS = ["transposed", "sliced rows", "every other row", "broadcast row", "permuted 3-d"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_non_contiguous_inputs(layout, dtype):
    a, b, c, d, weight, bias = _layout_inputs(layout, dtype)
    before = [t.clone() for t in (a, b, c, d, weight, bias)]
    # Same rows, same kernel: bitwise the results of contiguous copies.
    for y, g in ((a, b), (b, a)):
        outs = sub_layer_norm(y, g, weight, bias, EPS)
        want = sub_layer_norm(y.contiguous(), g.contiguous(), weight.contiguous(), bias.contiguous(), EPS)
        for got, w in zip(outs, want):
            assert got.is_contiguous()
            torch.testing.assert_close(got, w, rtol=0, atol=0)
    x = b
    mean, rstd = _stats(x)
    for dln, dres in ((a, c), (c, d)):
        outs = layer_norm_bwd_add(dln, x, weight, mean, rstd, dres)
        want = layer_norm_bwd_add(dln.contiguous(), x, weight.contiguous(), mean, rstd, dres.contiguous())
        for got, w in zip(outs, want):
            assert got.is_contiguous()
            torch.testing.assert_close(got, w, rtol=0, atol=0)
    outs = layer_norm_bwd_add(a, c, weight, *_stats(c), d)  # x itself strided
    want = layer_norm_bwd_add(a.contiguous(), c.contiguous(), weight.contiguous(), *_stats(c), d.contiguous())
    for got, w in zip(outs, want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    if dtype == torch.float32:
        exact = sub_layer_norm_reference(*(t.double() for t in (a, b, weight, bias)), EPS)
        assert_close_rel(sub_layer_norm(a, b, weight, bias, EPS)[1], exact[1], 1e-5, "ln")
    for t, t0 in zip((a, b, c, d, weight, bias), before):  # inputs untouched
        torch.testing.assert_close(t, t0, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(0, 33), (2, 0, 33)])
def test_empty_rows(shape):
    y = torch.randn(shape)
    weight, bias = _params(33)
    x, ln, mean, rstd = sub_layer_norm(y, y, weight, bias, EPS)
    assert x.shape == ln.shape == shape and mean.shape == rstd.shape == shape[:-1]
    dx, dweight, dbias = layer_norm_bwd_add(y, y, weight, mean, rstd, y)
    assert dx.shape == shape
    assert torch.equal(dweight, torch.zeros(33)) and torch.equal(dbias, torch.zeros(33))


# --- torch.library checks, autograd ---------------------------------------------------------------

def test_opcheck_sub_layer_norm():
    op = torch.ops.revkernels.sub_layer_norm.default
    w, b = _params(17)
    for args in [(torch.randn(3, 17), torch.randn(3, 17), w, b, EPS),
                 (torch.randn(2, 3, 17, requires_grad=True), torch.randn(2, 3, 17).bfloat16().requires_grad_(),
                  w.clone().requires_grad_(), b.clone().requires_grad_(), 1e-6),
                 (torch.randn(17, 4).t(), torch.randn(1, 17).expand(4, 17), w.bfloat16(), b.bfloat16(), EPS),
                 (torch.randn(5, 17, dtype=torch.float64, requires_grad=True), torch.randn(5, 17), w, b, EPS)]:
        torch.library.opcheck(op, args)


def test_opcheck_layer_norm_bwd_add():
    op = torch.ops.revkernels.layer_norm_bwd_add.default
    w, _ = _params(17)
    x = _random((3, 17))
    mean, rstd = _stats(x)
    xb = _random((2, 4, 17)).bfloat16()
    for args in [(torch.randn(3, 17), x, w, mean, rstd, torch.randn(3, 17)),
                 (torch.randn(2, 4, 17).bfloat16(), xb, w, *_stats(xb), torch.randn(2, 4, 17)),
                 (torch.randn(17, 3).t(), x, w.bfloat16(), mean, rstd, torch.randn(1, 17).expand(3, 17))]:
        torch.library.opcheck(op, args)


def test_double_backward():
    """A backward with create_graph=True differentiates sub_layer_norm twice (autograd's fallback for
    the backward op warned and returned zero second-order grads): against finite differences in
    float64; and a gradient penalty in fp32 (a bf16 g) against float64, with docs/design.md's rule for
    results whose PyTorch counterpart is itself inexact: ATen's LayerNorm double backward in fp32 is
    some 3e-5 from float64 on these rows, and ours may be at most twice that."""
    inputs = [torch.randn(3, 6, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    inputs += [torch.randn(6, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    assert torch.autograd.gradgradcheck(lambda *a: torch.ops.revkernels.sub_layer_norm(*a, EPS)[:2], inputs)
    y, g, dx, dln = _random((3, 2, 33)), _random((3, 2, 33), torch.bfloat16), torch.randn(3, 2, 33), torch.randn(3, 2, 33)
    w, b = _params(33)

    def fused(y, g, w, b):
        x, ln, _, _ = sub_layer_norm(y, g, w, b, EPS)
        return x, ln

    def eager(y, g, w, b):
        x = y - g
        return x, F.layer_norm(x, (33,), w, b, EPS)

    grads = []
    for fn, dtype in ((fused, None), (eager, None), (eager, torch.float64)):
        leaves = [t.to(dtype or t.dtype).requires_grad_() for t in (y, g, w, b)]
        x, ln = fn(*leaves)
        first = torch.autograd.grad((x, ln), leaves, (dx.to(x.dtype), dln.to(ln.dtype)), create_graph=True)
        grads.append(torch.autograd.grad(sum((d.double() ** 2).sum() for d in first), leaves, materialize_grads=True))
    for name, actual, same_dtype_torch, exact in zip(("y", "g", "weight"), *grads):
        assert_low_precision_rule(actual, same_dtype_torch, exact, what=f"second-order grad of {name}")
    assert not grads[0][3].any() and not grads[2][3].any()  # no first-order grad depends on the bias


def test_autograd_gradcheck():
    for shape in [(4, 7), (2, 3, 5)]:
        inputs = [torch.randn(shape, dtype=torch.float64, requires_grad=True) for _ in range(2)]
        inputs += [torch.randn(shape[-1], dtype=torch.float64, requires_grad=True) for _ in range(2)]
        # Both differentiable outputs (x and ln); mean and rstd are not differentiable.
        assert torch.autograd.gradcheck(lambda *a: torch.ops.revkernels.sub_layer_norm(*a, EPS)[:2], inputs)
        _, _, mean, rstd = torch.ops.revkernels.sub_layer_norm(*inputs, EPS)
        assert not mean.requires_grad and not rstd.requires_grad


def test_autograd_matches_composite():
    # In a graph: x feeds on (as the rebuilt stream) and ln feeds F; grads as for y - g, LayerNorm.
    y, g = _random((30, 1000)), _g((30, 1000))
    weight, bias = _params(1000)
    up_x, up_ln = torch.randn(30, 1000), torch.randn(30, 1000)
    leaves = [t.clone().requires_grad_() for t in (y, g, weight, bias)]
    x, ln, _, _ = sub_layer_norm(*leaves, EPS)
    ((x * up_x).sum() + (ln.tanh() * up_ln).sum()).backward()
    ref = [t.double().requires_grad_() for t in (y, g, weight, bias)]
    x64 = ref[0] - ref[1]
    ln64 = F.layer_norm(x64, (1000,), ref[2], ref[3], EPS)
    ((x64 * up_x.double()).sum() + (ln64.tanh() * up_ln.double()).sum()).backward()
    for t, r, what in zip(leaves, ref, ("y", "g", "weight", "bias")):
        assert_close_rel(t.grad, r.grad, 1e-5, f"grad of {what}")


def test_autograd_grad_dtypes():
    y, g = _random((6, 33)).requires_grad_(), _g((6, 33), torch.bfloat16).requires_grad_()
    weight, bias = _params(33)
    weight, bias = weight.requires_grad_(), bias.bfloat16().requires_grad_()
    _, ln, _, _ = sub_layer_norm(y, g, weight, bias, EPS)  # x unused: its grad is zero
    (ln * torch.randn(6, 33)).sum().backward()
    assert (y.grad.dtype, g.grad.dtype, weight.grad.dtype, bias.grad.dtype) == (
        torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)
    torch.testing.assert_close(g.grad, (-y.grad).bfloat16(), rtol=0, atol=0)


PARAM_DTYPE_PAIRS = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float64)]


def _check_param_grads_of_two_dtypes():
    # weight and bias of different dtypes: each grad is its fp32 sum rounded once to its own dtype (the
    # bias's not through the weight's dtype first).
    y, g, dln = _random((512, 64)), _g((512, 64)), torch.randn(512, 64)
    for weight_dtype, bias_dtype in PARAM_DTYPE_PAIRS:
        weight, bias = (p.to(dt).requires_grad_() for p, dt in zip(_params(64), (weight_dtype, bias_dtype)))
        x, ln, mean, rstd = sub_layer_norm(y, g, weight, bias, EPS)
        ln.backward(dln)
        exact = layer_norm_bwd_add_reference(dln.double(), x.double(), weight.double(), mean.double(),
                                             rstd.double(), torch.zeros(512, 64, dtype=torch.float64))
        for got, e, dtype, what in [(weight.grad, exact[1], weight_dtype, "weight"),
                                    (bias.grad, exact[2], bias_dtype, "bias")]:
            assert got.dtype == dtype, what
            _assert_one_rounding(got, e)  # 1e-5 of max |e| for fp32 and fp64


def test_param_grads_of_two_dtypes():
    _check_param_grads_of_two_dtypes()


# --- bad input ----------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    y, g = torch.randn(4, 33), torch.randn(4, 33)
    w, b = _params(33)
    mean, rstd = _stats(y)
    cases = [
        (ValueError, r"weight must have shape \(33,\)", lambda: sub_layer_norm(y, g, torch.randn(32), b)),
        (ValueError, r"bias must have shape \(33,\)", lambda: sub_layer_norm(y, g, w, torch.randn(1, 33))),
        (ValueError, "g must have the shape of y", lambda: sub_layer_norm(y, torch.randn(33, 4), w, b)),
        (TypeError, "y must be float32", lambda: sub_layer_norm(torch.ones(4, 33, dtype=torch.int64), g, w, b)),
        (TypeError, "weight must be float32", lambda: sub_layer_norm(y, g, torch.ones(33, dtype=torch.int32), b)),
        (RuntimeError, "for argument 'g'", lambda: sub_layer_norm(y, 1.0, w, b)),  # the schema parser's
        (ValueError, "eps must be finite and non-negative", lambda: sub_layer_norm(y, g, w, b, -1.0)),
        (ValueError, "y must have at least one dim",
         lambda: sub_layer_norm(torch.tensor(1.0), torch.tensor(1.0), w, b)),
        (ValueError, "last \\(normalised\\) dim of y must be non-empty",
         lambda: sub_layer_norm(torch.randn(3, 0), torch.randn(3, 0), torch.randn(0), torch.randn(0))),
        (ValueError, "g must be on the device of y", lambda: sub_layer_norm(y, g.to("meta"), w, b)),
        (TypeError, "dln must have the dtype of x", lambda: layer_norm_bwd_add(g.bfloat16(), y, w, mean, rstd, g)),
        (ValueError, "dres must have the shape of x", lambda: layer_norm_bwd_add(g, y, w, mean, rstd, g[:2])),
        (ValueError, "dln must have the shape of x", lambda: layer_norm_bwd_add(g[:, :5], y, w, mean, rstd, g)),
        (ValueError, r"weight must have shape \(33,\)", lambda: layer_norm_bwd_add(g, y, w[:5], mean, rstd, g)),
        (ValueError, r"mean must have shape x.shape\[:-1\]",
         lambda: layer_norm_bwd_add(g, y, w, mean[:, None], rstd, g)),
        (ValueError, r"rstd must have shape x.shape\[:-1\]", lambda: layer_norm_bwd_add(g, y, w, mean, rstd[:2], g)),
        (TypeError, "dres must be float32", lambda: layer_norm_bwd_add(g, y, w, mean, rstd, g.int())),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()


def test_torch_op_checks_in_cpp():
    # Calling the registered ops directly (bypassing the Python wrappers) still names the argument.
    y, w, b = torch.randn(4, 33), *_params(33)
    mean, rstd = _stats(y)
    with pytest.raises(ValueError, match="g must have the shape of y"):
        torch.ops.revkernels.sub_layer_norm(y, torch.randn(33, 4), w, b, EPS)
    with pytest.raises(ValueError, match=r"bias must have shape \(33,\)"):
        torch.ops.revkernels.sub_layer_norm(y, y, w, b[:3], EPS)
    with pytest.raises(TypeError, match="g must be float32"):
        torch.ops.revkernels.sub_layer_norm(y, y.int(), w, b, EPS)
    with pytest.raises(ValueError, match="eps must be finite and non-negative"):
        torch.ops.revkernels.sub_layer_norm(y, y, w, b, float("nan"))
    with pytest.raises(TypeError, match="dln must have the dtype of x"):
        torch.ops.revkernels.layer_norm_bwd_add(y.half(), y, w, mean, rstd, y)
    with pytest.raises(ValueError, match=r"mean must have shape x.shape\[:-1\]"):
        torch.ops.revkernels.layer_norm_bwd_add(y, y, w, mean[:3], rstd, y)


def test_pure_pytorch_fallback_when_library_missing():
    # Without revkernels._C the ops run their references (contiguous outputs, as the kernels).
    run_without_c_extension(
        "warnings.simplefilter('ignore')\n"
        "import torch\n"
        "import revkernels as rk\n"
        "from revkernels.ops import layer_norm as L\n"
        "assert not rk.HAS_C_EXTENSION\n"
        "y, g = torch.randn(40, 5).t(), torch.randn(5, 40).bfloat16()\n"
        "w, b = torch.randn(40), torch.randn(40)\n"
        "out = torch.ops.revkernels.sub_layer_norm(y, g, w, b, 1e-5)\n"
        "want = L.sub_layer_norm_reference(y, g, w, b, 1e-5)\n"
        "assert all(o.is_contiguous() and torch.equal(o, r) for o, r in zip(out, want))\n"
        "x, ln, mean, rstd = out\n"
        "d = torch.ops.revkernels.layer_norm_bwd_add(ln, x, w, mean, rstd, y)\n"
        "assert all(torch.equal(o, r) for o, r in zip(d, L.layer_norm_bwd_add_reference(ln, x, w, mean, rstd, y)))\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from tests.ops import test_layer_norm as T\n"
        "T._check_param_grads_of_two_dtypes()\n"
        "T.test_double_backward()\n"
        # the ops called directly run the C++ kernels' checks
        "expect_error(lambda: torch.ops.revkernels.sub_layer_norm(y, g[:, :1], w, b), 'g must have the shape')\n"
        "expect_error(lambda: torch.ops.revkernels.sub_layer_norm(y, g, w, b, -1.0), 'eps must be')\n"
        "expect_error(lambda: torch.ops.revkernels.layer_norm_bwd_add(ln.double(), x, w, mean, rstd, y),\n"
        "             'dln must have the dtype')\n"
        "print('ok')\n"
    )


# --- Triton kernels (under TRITON_INTERPRET=1 on CPU: fp32, few rows) ------------------------------

TRITON_SHAPES = [(1, 33), (3, 33), (1, 1000), (2, 1000), (1, 4097), (3, 4097)]
# "chunked": the kernels for rows wider than one block, forced with small blocks (33 -> 2 chunks).
TRITON_PATHS = {"fused": {}, "chunked": {"max_fused_n": 16, "chunk_n": 32}}


@pytest.mark.parametrize("path", list(TRITON_PATHS))
@pytest.mark.parametrize("shape", TRITON_SHAPES)
def test_triton_sub_layer_norm(shape, path):
    from revkernels.triton.layer_norm import sub_layer_norm as kernel

    device = triton_device()
    y, g = _random(shape).to(device), _g(shape).to(device)
    weight, bias = (t.to(device) for t in _params(shape[-1]))
    x, ln, mean, rstd = kernel(y, g, weight, bias, EPS, **TRITON_PATHS[path])
    assert x.dtype == ln.dtype == mean.dtype == torch.float32 and mean.shape == shape[:-1]
    torch.testing.assert_close(x, coupling_sub_reference(y, g), rtol=0, atol=0)
    want = sub_layer_norm_reference(*(t.double() for t in (y, g, weight, bias)), EPS)
    for got, exact, what in zip((x, ln, mean, rstd), want, ("x", "ln", "mean", "rstd")):
        assert_close_rel(got, exact, 1e-5, what)


@pytest.mark.parametrize("path", list(TRITON_PATHS))
@pytest.mark.parametrize("n", [33, 1000])
def test_triton_sub_layer_norm_constant_rows(n, path):
    from revkernels.triton.layer_norm import sub_layer_norm as kernel

    device = triton_device()
    y, g = _constant_rows(2, n, device=device)
    weight, bias = (t.to(device) for t in _params(n))
    x, ln, mean, rstd = kernel(y, g, weight, bias, EPS, **TRITON_PATHS[path])
    want = sub_layer_norm_reference(*(t.double() for t in (y, g, weight, bias)), EPS)
    for got, exact, what in zip((x, ln, mean, rstd), want, ("x", "ln", "mean", "rstd")):
        assert_close_rel(got.cpu(), exact.cpu(), 1e-5, what)


@pytest.mark.parametrize("path", list(TRITON_PATHS))
def test_triton_sub_layer_norm_mean_of_a_row_starting_with_inf(path):
    """Both kernels; the chunked one writes the mean of its chunks' sums (merging the chunks'
    means subtracts them: NaN after an infinite value)."""
    from revkernels.triton.layer_norm import sub_layer_norm

    _check_mean_of_rows_starting_with_inf(functools.partial(sub_layer_norm, **TRITON_PATHS[path]), triton_device())


@pytest.mark.parametrize("path", list(TRITON_PATHS))
@pytest.mark.parametrize("shape", TRITON_SHAPES)
def test_triton_layer_norm_bwd_add(shape, path):
    from revkernels.triton.layer_norm import layer_norm_bwd_add as kernel

    device = triton_device()
    x, dln, dres = _random(shape).to(device), torch.randn(shape).to(device), torch.randn(shape).to(device)
    weight, bias = (t.to(device) for t in _params(shape[-1]))
    mean, rstd = _stats(x)
    dx, dweight, dbias = kernel(dln, x, weight, mean, rstd, dres, **TRITON_PATHS[path])
    assert dx.dtype == dweight.dtype == torch.float32 and dx.shape == shape and dweight.shape == shape[-1:]
    gx, gw, gb = _torch_layer_norm_grads(x.double(), weight.double(), bias.double(), dln.double())
    assert_close_rel(dx, dres.double() + gx, 1e-5, "dx")
    assert_close_rel(dweight, gw, 1e-5, "dweight")
    assert_close_rel(dbias, gb, 1e-5, "dbias")


@pytest.mark.parametrize("path", list(TRITON_PATHS))
def test_triton_layouts_and_fp64_accumulation(path):
    from revkernels.triton.layer_norm import layer_norm_bwd_add as bwd_kernel
    from revkernels.triton.layer_norm import sub_layer_norm as fwd_kernel

    device = triton_device()
    kwargs = TRITON_PATHS[path]
    y = _random((33, 5)).to(device).t()  # last dim strided: copied
    g = _random((1, 33)).to(device).expand(5, 33)  # row stride 0
    weight, bias = (t.to(device)[::2] for t in _params(66))  # strided params
    x, ln, mean, rstd = fwd_kernel(y, g, weight, bias, EPS, **kwargs)
    want = sub_layer_norm_reference(*(t.double() for t in (y, g, weight, bias)), EPS)
    torch.testing.assert_close(x, coupling_sub_reference(y, g), rtol=0, atol=0)
    assert_close_rel(ln, want[1], 1e-5, "ln")
    # g in fp64: accumulation and statistics in fp64.
    x, ln, mean, rstd = fwd_kernel(y, g.double(), weight, bias, EPS, **kwargs)
    assert x.dtype == torch.float32 and mean.dtype == rstd.dtype == torch.float64
    assert_close_rel(ln, want[1], 1e-5, "ln (fp64 g)")
    dln = _random((10, 33)).to(device)[::2]  # row stride 66
    dres = torch.randn(5, 33, dtype=torch.float64, device=device)  # fp64: fp64 accumulation, fp64 dx
    dx, dweight, dbias = bwd_kernel(dln, x, weight, mean, rstd, dres, **kwargs)
    assert dx.dtype == torch.float64 and dweight.dtype == torch.float32
    exact = layer_norm_bwd_add_reference(dln.double(), x.double(), weight.double(), mean, rstd, dres)
    for got, e, what in zip((dx, dweight, dbias), exact, ("dx", "dweight", "dbias")):
        assert_close_rel(got, e, 1e-5, what)


def test_triton_empty_rows():
    from revkernels.triton.layer_norm import layer_norm_bwd_add as bwd_kernel
    from revkernels.triton.layer_norm import sub_layer_norm as fwd_kernel

    device = triton_device()
    y = torch.randn(0, 33, device=device)
    weight, bias = (t.to(device) for t in _params(33))
    x, ln, mean, rstd = fwd_kernel(y, y, weight, bias, EPS)
    assert x.shape == (0, 33) and mean.shape == (0,)
    dx, dweight, dbias = bwd_kernel(y, y, weight, mean, rstd, y)
    assert dx.shape == (0, 33) and not dweight.any() and not dbias.any()


class _LaunchLog:
    """Stands in for a @triton.jit kernel of the module and records each launch's config."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.log.append((self.name, kwargs.get("BLOCK_N"), kwargs.get("num_warps")))
            return launch(*args, **kwargs)
        return run


# (width, forward kernel, backward kernels): the backward keeps rows whole only up to
# MAX_FUSED_N_BWD = 4096 (BLOCK_N 8192 spills registers), the forward up to MAX_FUSED_N = 8192.
ROUTES = [(33, ["fwd"], ["bwd_add"]), (1000, ["fwd"], ["bwd_add"]), (4096, ["fwd"], ["bwd_add"]),
          (4097, ["fwd"], ["bwd_row_stats", "bwd_add_chunked"]),
          (8193, ["fwd_chunked"], ["bwd_row_stats", "bwd_add_chunked"])]


@pytest.mark.parametrize("width,fwd,bwd", ROUTES)
def test_triton_launch_configs(width, fwd, bwd, monkeypatch):
    """Which kernels each width takes, with the tuned warps: the forward's _num_warps, the backward's
    min(8, max(1, BLOCK_N // 128)) for the fused kernel and the chunked ones' chunk width."""
    import triton

    from revkernels.triton import layer_norm as L

    log = []
    for name in ("fwd", "fwd_chunked", "bwd_add", "bwd_row_stats", "bwd_add_chunked"):
        attr = {"fwd": "_sub_layer_norm_fwd_kernel", "fwd_chunked": "_sub_layer_norm_fwd_chunked_kernel",
                "bwd_add": "_layer_norm_bwd_add_kernel", "bwd_row_stats": "_layer_norm_bwd_row_stats_kernel",
                "bwd_add_chunked": "_layer_norm_bwd_add_chunked_kernel"}[name]
        monkeypatch.setattr(L, attr, _LaunchLog(getattr(L, attr), name, log))
    device = triton_device()
    shape = (2, width)
    y, g = _random(shape).to(device), _g(shape).to(device)
    weight, bias = (t.to(device) for t in _params(width))
    x, ln, mean, rstd = L.sub_layer_norm(y, g, weight, bias, EPS)
    block = triton.next_power_of_2(width)
    fwd_block = block if fwd == ["fwd"] else L.CHUNK_N
    assert log == [(fwd[0], fwd_block, L._num_warps(fwd_block))]
    log.clear()
    dln, dres = torch.randn(shape).to(device), torch.randn(shape).to(device)
    dx, dweight, dbias = L.layer_norm_bwd_add(dln, x, weight, mean, rstd, dres)
    bwd_block = block if bwd == ["bwd_add"] else L.CHUNK_N
    assert log == [(name, bwd_block, L._bwd_num_warps(bwd_block)) for name in bwd]
    gx, gw, gb = _torch_layer_norm_grads(x.double(), weight.double(), bias.double(), dln.double())
    assert_close_rel(dx, dres.double() + gx, 1e-5, "dx")
    assert_close_rel(dweight, gw, 1e-5, "dweight")


def test_triton_backward_tuning(monkeypatch):
    """The H200-tuned backward config: 8 warps (fewer for narrow blocks), 4 programs per SM up to
    BLOCK_N 2048 and 2 above, a separate (smaller) fused width limit than the forward's."""
    from revkernels.triton import layer_norm as L

    assert L.MAX_FUSED_N_BWD == 4096 and L.MAX_FUSED_N == 8192
    assert [L._bwd_num_warps(b) for b in (1, 64, 128, 256, 512, 1024, 2048, 4096)] == [1, 1, 1, 2, 4, 8, 8, 8]
    assert [L._num_warps(b) for b in (1024, 4096, 8192)] == [4, 16, 16]  # the forward's, unchanged
    assert [L._bwd_programs_per_sm(b) for b in (64, 1024, 2048, 4096, 8192, 16384)] == [4, 4, 4, 2, 2, 2]
    monkeypatch.setattr(L, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert L._num_row_programs(12608, cuda, 4) == 528 and L._num_row_programs(32768, cuda, 2) == 264
    assert L._num_row_programs(100, cuda, 4) == 100
    assert L._num_row_programs(100, torch.device("cpu"), 4) == 4


# --- CUDA (Triton through torch.ops) -------------------------------------------------------------

# 4097: fused forward, chunked backward (wider than MAX_FUSED_N_BWD); 12288: chunked both ways.
GPU_SHAPES = [(1, 33), (300, 1000), (64, 4096), (64, 4097), (8, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_cuda_sub_layer_norm(dtype, shape):
    y, g = _random(shape, dtype).cuda(), _g(shape, dtype).cuda()
    weight, bias = (t.cuda() for t in _params(shape[-1], dtype))
    x, ln, mean, rstd = torch.ops.revkernels.sub_layer_norm(y, g, weight, bias, EPS)
    torch.testing.assert_close(x, coupling_sub_reference(y, g), rtol=0, atol=0)
    exact = F.layer_norm(x.double(), shape[-1:], weight.double(), bias.double(), EPS)
    if dtype == torch.float32:
        assert_close_rel(ln, exact, 1e-5, "ln")
    else:
        _assert_within_2x(ln, F.layer_norm(x, shape[-1:], weight, bias, EPS), exact, f"ln {dtype}")
    want_mean, want_rstd = _stats(x)
    assert_close_rel(mean, want_mean, 1e-5, "mean")
    assert_close_rel(rstd, want_rstd, 1e-5, "rstd")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_cuda_layer_norm_bwd_add(dtype, shape):
    x = _random(shape, dtype).cuda()
    dln, dres = torch.randn(shape).to(dtype).cuda(), torch.randn(shape).to(dtype).cuda()
    weight, bias = (t.cuda() for t in _params(shape[-1], dtype))
    mean, rstd = _stats(x)
    dx, dweight, dbias = torch.ops.revkernels.layer_norm_bwd_add(dln, x, weight, mean, rstd, dres)
    exact = _torch_layer_norm_grads(x.double(), weight.double(), bias.double(), dln.double())
    exact = (dres.double() + exact[0],) + exact[1:]
    if dtype == torch.float32:
        for got, e, what in zip((dx, dweight, dbias), exact, ("dx", "dweight", "dbias")):
            assert_close_rel(got, e, 1e-5, what)
    else:
        tx, tw, tb = _torch_layer_norm_grads(x, weight, bias, dln)
        for ours, theirs, e, what in zip((dx, dweight, dbias), (dres + tx, tw, tb), exact, ("dx", "dweight", "dbias")):
            _assert_within_2x(ours, theirs, e, f"{what} {dtype}")


@pytest.mark.gpu
def test_cuda_opcheck_and_autograd():
    w, b = (t.cuda() for t in _params(17))
    torch.library.opcheck(torch.ops.revkernels.sub_layer_norm.default,
                          (torch.randn(4, 17, device="cuda", requires_grad=True),
                           torch.randn(4, 17, device="cuda").bfloat16().requires_grad_(),
                           w.clone().requires_grad_(), b.clone().requires_grad_(), EPS))
    x = _random((4, 17)).cuda()
    torch.library.opcheck(torch.ops.revkernels.layer_norm_bwd_add.default,
                          (torch.randn(4, 17, device="cuda"), x, w, *_stats(x), torch.randn(4, 17, device="cuda")))
    inputs = [torch.randn(3, 9, dtype=torch.float64, device="cuda", requires_grad=True) for _ in range(2)]
    inputs += [torch.randn(9, dtype=torch.float64, device="cuda", requires_grad=True) for _ in range(2)]
    assert torch.autograd.gradcheck(lambda *a: torch.ops.revkernels.sub_layer_norm(*a, EPS)[:2], inputs)


def test_eps_the_schema_parser_would_convert_is_rejected():
    # eps=True would reach the kernel as 1.0: the entry point checks the Python scalar first.
    y, g, w, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
    for eps in (True, np.bool_(True), torch.tensor(1e-5)):
        with pytest.raises(TypeError, match="eps must be a real number"):
            sub_layer_norm(y, g, w, b, eps)


def test_eps_may_be_a_numpy_number():
    """A NumPy float or int eps is a real number (the entry point said it was not finite)."""
    y, g, w, b = _random((3, 8)), _random((3, 8)), *_params(8)
    want = sub_layer_norm(y, g, w, b, 1e-3)
    for eps in (np.float32(1e-3), np.float64(1e-3)):
        assert all(torch.equal(o, e) for o, e in zip(sub_layer_norm(y, g, w, b, eps), want))
    assert all(torch.equal(o, e) for o, e in zip(sub_layer_norm(y, g, w, b, np.int64(1)), sub_layer_norm(y, g, w, b, 1.0)))
