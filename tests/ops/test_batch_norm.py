"""revkernels::batch_norm_act / batch_norm_act_bwd against float64 references and torch's own
BatchNorm: the C++ CPU kernels, the Triton kernels (under TRITON_INTERPRET=1 on CPU, fp32) and,
with -m gpu, the CUDA path."""

import functools
import pathlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import revkernels as rk
from revkernels.ops._library import has_compiled_kernel
from revkernels.ops.batch_norm import (batch_norm_act, batch_norm_act_bwd, batch_norm_act_bwd_reference,
                                       batch_norm_act_reference)
from tests.helpers import assert_close_rel, assert_low_precision_rule, run_without_c_extension, triton_device

EPS = 1e-5
ROOT = str(pathlib.Path(__file__).resolve().parents[2])  # the checkout, for the subprocess checks
SHAPES = [(2, 3, 5, 7), (4, 64, 8, 8), (1, 3, 1, 1), (6, 5), (3, 4, 10)]
LAYOUTS = ["contiguous", "channels_last", "non-contiguous"]


def _random(shape, dtype=torch.float32):
    """Data with a per-channel offset of random sign and magnitude 2 to 4, so the means are well away
    from zero (with an offset of 2 * N(0, 1) a channel's mean could come near zero and its rounding
    error look large relative to it: the inf-channel test's finite channel of 105 values was past
    1e-5 in 15 of 5000 draws, 1.3e-5 in a CI run; with this offset at most 2.1e-7)."""
    c = shape[1]
    offset = (2 + 2 * torch.rand(c)) * torch.where(torch.rand(c) < 0.5, -1.0, 1.0)
    return (torch.randn(shape) * 3 + offset.view((1, c) + (1,) * (len(shape) - 2))).to(dtype)


def _off_the_kink(x, weight, bias, eps=1e-5):
    """`x` with the few elements whose pre-activation (float64, from x's own batch statistics) is
    within 1e-5 of zero moved 0.05 away. At such an element the fp32 kernel and the float64
    reference may take different sides of the ReLU's kink (an FMA on the GPU rounds the
    pre-activation differently), and dx there differs by scale * dy: the H200 saw 0.16 relative on
    6.4M elements, where a handful lie that close to zero in every draw."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    for _ in range(5):
        x64 = x.double()
        dims = [d for d in range(x.dim()) if d != 1]
        mean, var = x64.mean(dims, keepdim=True), x64.var(dims, unbiased=False, keepdim=True)
        pre = (x64 - mean) * (var + eps).rsqrt() * weight.double().view(shape) + bias.double().view(shape)
        near = pre.abs() < 1e-5
        if not near.any():
            return x
        x = torch.where(near, x + 0.05, x)
    raise AssertionError("pre-activations stay near zero")


def _params(c, dtype=torch.float32):
    return (1 + 0.5 * torch.randn(c)).to(dtype), (0.5 * torch.randn(c)).to(dtype)


def _in_layout(t, layout):
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
    if layout == "non-contiguous":
        strided = torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]  # last-dim stride 2: copied
        assert not strided.is_contiguous()
        return strided
    return t


def _torch_bn_act(x, weight, bias, relu):
    """Training-mode F.batch_norm (+ ReLU) in x's dtype, with torch's autograd graph."""
    out = F.batch_norm(x, None, None, weight, bias, True, 0.0, EPS)
    return torch.relu(out) if relu else out


def _torch_grads(x, weight, bias, dout, relu):
    x, weight, bias = (t.detach().clone().requires_grad_() for t in (x, weight, bias))
    _torch_bn_act(x, weight, bias, relu).backward(dout)
    return x.grad, weight.grad, bias.grad


def _max_err(actual, exact):
    return (actual.double() - exact.double()).abs().max().item()


def _assert_within_2x(actual, torch_result, exact, what):
    """The low-precision rule: error against the exact result at most 2x that of torch's op."""
    err, torch_err = _max_err(actual, exact), _max_err(torch_result, exact)
    assert err <= 2 * torch_err + 1e-30, f"{what}: error {err:.3e} > 2 x torch's {torch_err:.3e}"


def test_cpu_kernels_are_compiled():
    assert rk.HAS_C_EXTENSION, rk._extension.C_EXTENSION_ERROR
    assert has_compiled_kernel("batch_norm_act", "CPU") and has_compiled_kernel("batch_norm_act_bwd", "CPU")


# --- C++ CPU path ------------------------------------------------------------------------------------

@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_act_fp32(shape, layout, relu):
    x = _in_layout(_random(shape), layout)
    weight, bias = _params(shape[1])
    out, mean, rstd = batch_norm_act(x, weight, bias, EPS, relu)
    assert out.dtype == mean.dtype == rstd.dtype == torch.float32
    assert out.shape == shape and mean.shape == rstd.shape == (shape[1],)
    if layout == "channels_last" and x.dim() == 4:
        assert out.is_contiguous(memory_format=torch.channels_last)
    want = batch_norm_act_reference(x.double(), weight.double(), bias.double(), EPS, relu)
    for got, exact, what in zip((out, mean, rstd), want, ("out", "mean", "rstd")):
        assert_close_rel(got, exact, 1e-5, what)
    # The reference agrees with torch's BatchNorm (+ ReLU) in float64 (not defined for one value).
    if x.numel() > shape[1]:
        assert_close_rel(want[0], _torch_bn_act(x.double(), weight.double(), bias.double(), relu), 1e-10, "reference")


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_batch_norm_act_bwd_fp32(shape, layout, relu):
    x = _in_layout(_random(shape), layout)
    dout = _in_layout(torch.randn(shape), "contiguous" if layout == "channels_last" else layout)
    weight, bias = _params(shape[1])
    _, mean, rstd = batch_norm_act(x, weight, bias, EPS, relu)
    dx, dweight, dbias = batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, relu)
    assert dx.dtype == dweight.dtype == dbias.dtype == torch.float32
    assert dx.shape == shape and dweight.shape == dbias.shape == (shape[1],)
    exact = batch_norm_act_bwd_reference(dout.double(), x.double(), weight.double(), bias.double(), mean.double(),
                                         rstd.double(), relu)
    for got, e, what in zip((dx, dweight, dbias), exact, ("dx", "dweight", "dbias")):
        if e.abs().max() == 0:  # one value per channel: dx is exactly zero
            assert torch.equal(got, torch.zeros_like(got)), what
        else:
            assert_close_rel(got, e, 1e-5, what)
    if x.numel() > shape[1]:  # the explicit formulas agree with torch's autograd (float64)
        args64 = [t.double() for t in (x, weight, bias)]
        _, mean64, rstd64 = batch_norm_act_reference(*args64, EPS, relu)
        ref = batch_norm_act_bwd_reference(dout.double(), *args64, mean64, rstd64, relu)
        gx, gw, gb = _torch_grads(*args64, dout.double(), relu)
        for got, e, what in zip(ref, (gx, gw, gb), ("dx", "dweight", "dbias")):
            assert_close_rel(got, e, 1e-8, f"reference {what}")


@pytest.mark.parametrize("shape,layout", [((1, 2, 2048, 2048), "contiguous"), ((1, 2, 2048, 2048), "channels_last"),
                                          ((65536, 4), "contiguous")])
def test_millions_per_channel_far_from_zero(shape, layout):
    # Each channel's sums are chunked (kernels/batch_norm.h): a running sum over all M = 4M (65536)
    # values near 100 per lane loses the mean and variance. dout in x's layout (vector paths) and,
    # for channels_last x, NCHW (the scalar backward).
    x = _in_layout(torch.randn(shape) + 100, layout)
    weight, bias = _params(shape[1])
    out, mean, rstd = batch_norm_act(x, weight, bias, EPS, False)
    want = batch_norm_act_reference(x.double(), weight.double(), bias.double(), EPS, False)
    for got, exact, what in zip((out, mean, rstd), want, ("out", "mean", "rstd")):
        assert_close_rel(got, exact, 1e-5, what)
    dout = torch.randn(shape)
    for d in {layout: _in_layout(dout, layout), "contiguous": dout}.values():
        exact = batch_norm_act_bwd_reference(d.double(), x.double(), weight.double(), bias.double(), mean.double(),
                                             rstd.double(), False)
        for got, e, what in zip(batch_norm_act_bwd(d, x, weight, bias, mean, rstd, False), exact,
                                ("dx", "dweight", "dbias")):
            assert_close_rel(got, e, 1e-5, what)


def test_one_value_per_channel():
    # N=1, 1x1 spatial: variance 0, rstd = 1/sqrt(eps), out = act(bias).
    x = torch.randn(1, 4, 1, 1)
    weight, bias = _params(4)
    out, mean, rstd = batch_norm_act(x, weight, bias, EPS, False)
    torch.testing.assert_close(mean, x.flatten())
    torch.testing.assert_close(rstd, torch.full((4,), EPS ** -0.5))
    torch.testing.assert_close(out.flatten(), bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 64, 8, 8)])
def test_low_precision_within_2x_of_torch(shape, relu, dtype):
    x = _random(shape, dtype)
    if shape[1] == 64:
        x = x.contiguous(memory_format=torch.channels_last)
    weight, bias = _params(shape[1])
    out, mean, rstd = batch_norm_act(x, weight, bias, EPS, relu)
    assert out.dtype == dtype and mean.dtype == torch.float32
    # Exact: the same input in fp32 -> float64. torch: F.batch_norm (+ relu) in the low dtype.
    exact = _torch_bn_act(x.double(), weight.double(), bias.double(), relu)
    theirs = _torch_bn_act(x, weight.to(dtype), bias.to(dtype), relu)
    _assert_within_2x(out, theirs, exact, f"out {dtype}")
    dout = torch.randn(shape).to(dtype)
    dx, dweight, dbias = batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, relu)
    assert dx.dtype == dtype and dweight.dtype == torch.float32
    exact = _torch_grads(x.double(), weight.double(), bias.double(), dout.double(), relu)
    ref = _torch_grads(x, weight.to(dtype), bias.to(dtype), dout, relu)
    for ours, theirs_, e, what in zip((dx, dweight, dbias), ref, exact, ("dx", "dweight", "dbias")):
        _assert_within_2x(ours, theirs_, e, f"{what} {dtype}")


def test_fp64():
    x = _random((3, 4, 5, 6)).double()
    weight, bias = _params(4, torch.float64)
    out, mean, rstd = batch_norm_act(x, weight, bias, EPS, True)
    assert out.dtype == mean.dtype == torch.float64
    assert_close_rel(out, _torch_bn_act(x, weight, bias, True), 1e-12, "out")
    dout = torch.randn(3, 4, 5, 6, dtype=torch.float64)
    got = batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, True)
    for g, e, what in zip(got, _torch_grads(x, weight, bias, dout, True), ("dx", "dweight", "dbias")):
        assert_close_rel(g, e, 1e-12, what)


def test_mixed_param_dtypes():
    x = _random((4, 8, 3, 3)).bfloat16()
    weight, bias = _params(8)
    out, mean, rstd = batch_norm_act(x, weight.bfloat16(), bias.double(), EPS, True)
    want = batch_norm_act_reference(x.double(), weight.bfloat16().double(), bias.double(), EPS, True)
    composed = torch.relu(F.batch_norm(x.float(), None, None, weight.bfloat16().float(), bias.float(), True, 0.0, EPS))
    assert_low_precision_rule(out, composed.bfloat16(), want[0], "out")
    dx, dweight, dbias = batch_norm_act_bwd(x, x, weight.bfloat16(), bias, mean, rstd, True)
    assert dweight.dtype == torch.bfloat16 and dbias.dtype == torch.float32


PARAM_DTYPE_PAIRS = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float64)]


def _check_param_grads_of_two_dtypes():
    # weight and bias of different dtypes: each grad is its fp32 sum rounded once to its own dtype (the
    # bias's not through the weight's dtype first), from the op and through autograd.
    x, dout = _random((16, 8, 6, 6)), torch.randn(16, 8, 6, 6)
    for weight_dtype, bias_dtype in PARAM_DTYPE_PAIRS:
        weight, bias = (p.to(dt).requires_grad_() for p, dt in zip(_params(8), (weight_dtype, bias_dtype)))
        out, mean, rstd = batch_norm_act(x, weight, bias, EPS, False)
        out.backward(dout)
        exact = batch_norm_act_bwd_reference(dout.double(), x.double(), weight.double(), bias.double(),
                                             mean.double(), rstd.double(), False)
        _, dweight, dbias = batch_norm_act_bwd(dout, x, weight.detach(), bias.detach(), mean, rstd, False)
        for got, e, what in [(dweight, exact[1], "dweight"), (weight.grad, exact[1], "weight.grad"),
                             (dbias, exact[2], "dbias"), (bias.grad, exact[2], "bias.grad")]:
            dtype = weight_dtype if "weight" in what else bias_dtype
            assert got.dtype == dtype, what
            if dtype in (torch.bfloat16, torch.float16):
                assert_low_precision_rule(got, e.to(dtype), e, what)
            else:
                assert_close_rel(got, e, 1e-5, what)


def test_param_grads_of_two_dtypes():
    _check_param_grads_of_two_dtypes()


def test_deterministic_and_inputs_untouched():
    x = _random((8, 16, 6, 6)).contiguous(memory_format=torch.channels_last)
    weight, bias = _params(16)
    dout = torch.randn(8, 16, 6, 6)
    before = [t.clone() for t in (x, weight, bias, dout)]
    first = batch_norm_act(x, weight, bias, EPS, True)
    second = batch_norm_act(x, weight, bias, EPS, True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    g1 = batch_norm_act_bwd(dout, x, weight, bias, first[1], first[2], True)
    g2 = batch_norm_act_bwd(dout, x, weight, bias, first[1], first[2], True)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert all(torch.equal(a, b) for a, b in zip(before, (x, weight, bias, dout)))


# --- torch.library checks, autograd ---------------------------------------------------------------

def _nan_case(layout):
    x = _in_layout(_random((3, 4, 3, 3)), layout).clone()
    x[1, 2, 0, 1] = float("nan")  # channel 2's statistics, and so all of its outputs, are NaN
    return x, *_params(4), _in_layout(torch.randn(3, 4, 3, 3), layout)


def _check_relu_keeps_nan(fwd, bwd, x, weight, bias, dout):
    """As torch.relu and its backward: NaN stays NaN, in the outputs and in the grads."""
    out, mean, rstd = fwd(x, weight, bias, EPS, True)
    dx, dweight, dbias = bwd(dout, x, weight, bias, mean, rstd, True)
    want = _torch_bn_act(x, weight, bias, True)
    want_grads = _torch_grads(x, weight, bias, dout, True)
    assert torch.equal(out.isnan(), want.isnan()) and out[:, 2].isnan().all()
    for got, expected, what in zip((dx, dweight, dbias), want_grads, ("dx", "dweight", "dbias")):
        finite = ~expected.isnan()
        assert torch.equal(got.isnan(), ~finite), what
        assert_close_rel(got[finite], expected[finite], 1e-5, what)  # dbias of the NaN channel: sum of dout
    assert_close_rel(out[:, [0, 1, 3]], want[:, [0, 1, 3]], 1e-5, "out of the other channels")


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])  # the scalar and the vectorised kernels
def test_relu_keeps_nan_as_torch(layout):
    _check_relu_keeps_nan(batch_norm_act, batch_norm_act_bwd, *_nan_case(layout))


def test_reference_relu_keeps_nan_as_torch():
    _check_relu_keeps_nan(batch_norm_act_reference, batch_norm_act_bwd_reference, *_nan_case("contiguous"))


def test_relu_mask_of_the_backward_is_the_forwards_whatever_the_layouts():
    """A channels_last x with an NCHW dout runs a vectorised forward and a scalar backward: the
    recomputed pre-activation must round as the forward's did (no FMA contraction in one build
    only), also for elements whose pre-activation is zero to within one rounding."""
    x = _random((2, 16, 4, 4)).contiguous(memory_format=torch.channels_last)
    weight, bias = _params(16)
    _, mean, rstd = batch_norm_act(x, weight, bias, EPS, True)  # mean and rstd do not depend on bias
    t = (x[0, :, 0, 0] - mean) * rstd
    bias = -(t * weight)  # the pre-activation of element (0, c, 0, 0) is zero up to the rounding of t * w
    out, _, _ = batch_norm_act(x, weight, bias, EPS, True)
    kept = (out > 0).sum((0, 2, 3)).float()  # with dout = 1, dbias counts the elements the ReLU kept
    for dout in (torch.ones(2, 16, 4, 4), torch.ones(2, 16, 4, 4).contiguous(memory_format=torch.channels_last)):
        _, _, dbias = batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, True)
        assert torch.equal(dbias, kept)


def test_opcheck_batch_norm_act():
    op = torch.ops.revkernels.batch_norm_act.default
    w, b = _params(5)
    for args in [(_random((2, 5, 3, 4)), w, b, EPS, True),
                 (_random((2, 5, 3, 4)).contiguous(memory_format=torch.channels_last).requires_grad_(),
                  w.clone().requires_grad_(), b.clone().requires_grad_(), EPS, False),
                 (_random((3, 5, 4)).transpose(0, 2).transpose(0, 2)[:, :, ::2], w.bfloat16(), b, 1e-3, True),
                 (_random((4, 5)).double().requires_grad_(), w.double().requires_grad_(), b.double(), EPS, True)]:
        torch.library.opcheck(op, args)


def test_opcheck_batch_norm_act_bwd():
    op = torch.ops.revkernels.batch_norm_act_bwd.default
    w, b = _params(5)
    x = _random((2, 5, 3, 4))
    _, mean, rstd = batch_norm_act(x, w, b, EPS, True)
    xcl = x.contiguous(memory_format=torch.channels_last)
    for args in [(torch.randn(2, 5, 3, 4), x, w, b, mean, rstd, True),
                 (torch.randn(2, 5, 3, 4), xcl, w, b, mean, rstd, False),
                 (torch.randn(2, 5, 4, 3).transpose(-1, -2), x, w.bfloat16(), b, mean, rstd, True)]:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("relu", [True, False])
def test_double_backward(relu):
    """A backward with create_graph=True differentiates batch_norm_act twice (autograd's fallback for
    the backward op warned and returned no second-order grads): against finite differences in
    float64, and a gradient penalty in fp32 against eager BatchNorm (+ ReLU) in float64."""
    x = _random((3, 2, 2, 3)).double().requires_grad_()
    w, b = (t.double().requires_grad_() for t in _params(2))
    assert torch.autograd.gradgradcheck(lambda *a: torch.ops.revkernels.batch_norm_act(*a, EPS, relu)[0], (x, w, b))
    x, dout = _random((4, 3, 5, 5)), torch.randn(4, 3, 5, 5)
    w, b = _params(3)

    def eager(x, w, b):
        out = F.batch_norm(x, None, None, w, b, True, 0.0, EPS)
        return torch.relu(out) if relu else out

    grads = []
    for fn, dtype in ((lambda *a: batch_norm_act(*a, EPS, relu)[0], torch.float32), (eager, torch.float64)):
        leaves = [t.to(dtype).requires_grad_() for t in (x, w, b)]
        first = torch.autograd.grad(fn(*leaves), leaves, dout.to(dtype), create_graph=True)
        grads.append(torch.autograd.grad(sum((d ** 2).sum() for d in first), leaves, materialize_grads=True))
    for name, actual, expected in zip(("x", "weight", "bias"), *grads):
        assert_close_rel(actual, expected, tol=1e-5, what=f"second-order grad of {name}")


@pytest.mark.parametrize("relu", [True, False])
def test_autograd_gradcheck(relu):
    x = _random((3, 2, 2, 3)).double().requires_grad_()
    w, b = (t.double().requires_grad_() for t in _params(2))
    assert torch.autograd.gradcheck(lambda *a: torch.ops.revkernels.batch_norm_act(*a, EPS, relu)[0], (x, w, b))
    _, mean, rstd = torch.ops.revkernels.batch_norm_act(x, w, b, EPS, relu)
    assert not mean.requires_grad and not rstd.requires_grad


def test_autograd_matches_torch():
    x = _random((4, 6, 5, 5)).contiguous(memory_format=torch.channels_last)
    weight, bias = _params(6)
    up = torch.randn(4, 6, 5, 5)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    (batch_norm_act(*leaves, EPS, True)[0].tanh() * up).sum().backward()
    ref = [t.double().requires_grad_() for t in (x, weight, bias)]
    (_torch_bn_act(*ref, True).tanh() * up.double()).sum().backward()
    for t, r, what in zip(leaves, ref, ("x", "weight", "bias")):
        assert_close_rel(t.grad, r.grad, 1e-5, f"grad of {what}")


# --- bad input ----------------------------------------------------------------------------------

def _bad_cases(fwd, bwd):
    x = torch.randn(2, 3, 4, 4)
    w, b = _params(3)
    mean, rstd = torch.zeros(3), torch.ones(3)
    return [
        (ValueError, r"weight must have shape \(3,\)", lambda: fwd(x, torch.randn(4), b, EPS, True)),
        (ValueError, r"bias must have shape \(3,\)", lambda: fwd(x, w, torch.randn(1, 3), EPS, True)),
        (TypeError, "x must be float32", lambda: fwd(x.int(), w, b, EPS, True)),
        (TypeError, "weight must be float32", lambda: fwd(x, w.int(), b, EPS, True)),
        (ValueError, "eps must be finite and non-negative", lambda: fwd(x, w, b, -1.0, True)),
        (ValueError, r"x must have shape \(N, C, \*spatial\)", lambda: fwd(torch.randn(3), w, b, EPS, True)),
        (ValueError, "x must have at least one channel", lambda: fwd(torch.randn(2, 0, 3), w[:0], b[:0], EPS, True)),
        (ValueError, "bias must be on the device of x", lambda: fwd(x, w, b.to("meta"), EPS, True)),
        (TypeError, "dout must have the dtype of x", lambda: bwd(x.bfloat16(), x, w, b, mean, rstd, True)),
        (ValueError, "dout must have the shape of x", lambda: bwd(x[:1], x, w, b, mean, rstd, True)),
        (ValueError, r"mean must have shape \(3,\)", lambda: bwd(x, x, w, b, mean[:2], rstd, True)),
        (ValueError, r"rstd must have shape \(3,\)", lambda: bwd(x, x, w, b, mean, rstd[None], True)),
        (TypeError, "dout must be float32", lambda: bwd(x.int(), x, w, b, mean, rstd, True)),
    ]


def test_bad_input_names_the_argument():
    for error, message, call in _bad_cases(batch_norm_act, batch_norm_act_bwd):
        with pytest.raises(error, match=message):
            call()
    with pytest.raises(TypeError, match="relu must be a bool, got str"):
        batch_norm_act(torch.randn(2, 3), *_params(3), EPS, "yes")


@pytest.mark.parametrize("relu", [None, 1, 0.0])
def test_scalars_the_schema_parser_would_convert_are_rejected(relu):
    # The parser turns relu=None into False (no ReLU) and eps=True into 1.0 without a word: the
    # entry points check these Python scalars before calling the op.
    x, (w, b) = torch.randn(4, 3), _params(3)
    with pytest.raises(TypeError, match="relu must be a bool"):
        batch_norm_act(x, w, b, EPS, relu)
    out, mean, rstd = batch_norm_act(x, w, b, EPS, True)
    with pytest.raises(TypeError, match="relu must be a bool"):
        batch_norm_act_bwd(out, x, w, b, mean, rstd, relu)
    with pytest.raises(TypeError, match="eps must be a real number"):
        batch_norm_act(x, w, b, True, True)
    out, _, _ = batch_norm_act(x, w, b, np.float32(EPS), True)  # a NumPy float is a real number
    assert torch.equal(out, batch_norm_act(x, w, b, float(np.float32(EPS)), True)[0])


def test_torch_op_checks_in_cpp():
    # Calling the registered ops directly (bypassing the Python wrappers) still names the argument.
    for error, message, call in _bad_cases(torch.ops.revkernels.batch_norm_act, torch.ops.revkernels.batch_norm_act_bwd):
        with pytest.raises(error, match=message):
            call()


def test_pure_pytorch_fallback_when_library_missing():
    run_without_c_extension(
        "warnings.simplefilter('ignore')\n"
        "import torch\n"
        "import revkernels as rk\n"
        "from revkernels.ops import batch_norm as B\n"
        "assert not rk.HAS_C_EXTENSION\n"
        "x = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)\n"
        "w, b = torch.randn(3), torch.randn(3)\n"
        "out, mean, rstd = torch.ops.revkernels.batch_norm_act(x, w, b, 1e-5, True)\n"
        "assert out.is_contiguous(memory_format=torch.channels_last)\n"
        "want = torch.relu(torch.nn.functional.batch_norm(x, None, None, w, b, True, 0.0, 1e-5))\n"
        "torch.testing.assert_close(out, want)\n"
        "d = torch.ops.revkernels.batch_norm_act_bwd(x, x, w, b, mean, rstd, True)\n"
        "assert all(torch.equal(o, r) for o, r in zip(d, B.batch_norm_act_bwd_reference(x, x, w, b, mean, rstd, True)))\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from tests.ops import test_batch_norm as T\n"
        "T._check_param_grads_of_two_dtypes()\n"
        "T.test_double_backward(True)\n"
        "print('ok')\n"
    )


def _channels_starting_with_inf():
    """(3, 4, 5, 7): channel 0 starts with inf, channel 1 with -inf, channel 2 has an inf later."""
    x = _random((3, 4, 5, 7))
    x[0, 0, 0, 0], x[0, 1, 0, 0], x[1, 2, 3, 4] = float("inf"), float("-inf"), float("inf")
    return x


def _check_mean_of_channels_starting_with_inf(kernel, x):
    weight, bias = (t.to(x.device) for t in _params(x.shape[1]))
    mean = kernel(x, weight, bias, EPS, False)[1].cpu()
    want = batch_norm_act_reference(x.double(), weight.double(), bias.double(), EPS, False)[1].cpu()
    assert torch.equal(mean[:3], want[:3].float()) and mean[:3].isinf().all()
    assert_close_rel(mean[3:], want[3:], 1e-5, "mean of the finite channel")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mean_of_a_channel_starting_with_inf(layout):
    """A channel whose first value is infinite: mean inf or -inf as the reference's (the sums are
    shifted by the first value, and inf - inf is NaN; a non-finite first value shifts by 0)."""
    _check_mean_of_channels_starting_with_inf(batch_norm_act, _in_layout(_channels_starting_with_inf(), layout))


# --- Triton kernels (under TRITON_INTERPRET=1 on CPU: fp32, small shapes) ---------------------------

# "split": each channel's reduction over several programs, forced with small blocks.
TRITON_PATHS = {"default": {}, "split": {"block_m": 16, "chunks": 3}}


# Many channels: 64 on the default path; 40 (> MAX_BLOCK_C: two channel tiles, the second masked) on
# the split path, with fewer rows (the interpreter runs every program of the larger grid serially).
# Channel tiles exist only in channels_last: in NCHW a program holds one channel, so there the
# many-channel shapes run with TRITON_NCHW_CHANNELS, the same reductions in fewer programs.
TRITON_NCHW_CHANNELS = 5
TRITON_SHAPES = [("default", (2, 3, 5, 7)), ("default", (4, 64, 8, 8)), ("default", (1, 3, 1, 1)),
                 ("split", (2, 3, 5, 7)), ("split", (4, 40, 4, 4)), ("split", (1, 3, 1, 1))]


@pytest.mark.parametrize("path,shape", TRITON_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_triton_batch_norm_act(shape, layout, path):
    from revkernels.triton.batch_norm import batch_norm_act as fwd_kernel
    from revkernels.triton.batch_norm import batch_norm_act_bwd as bwd_kernel

    device = triton_device()
    if layout != "channels_last":
        shape = (shape[0], min(shape[1], TRITON_NCHW_CHANNELS), *shape[2:])
    x = _in_layout(_random(shape), layout).to(device)
    weight, bias = (t.to(device) for t in _params(shape[1]))
    dout = torch.randn(shape, device=device)
    for relu in (True, False):
        out, mean, rstd = fwd_kernel(x, weight, bias, EPS, relu, **TRITON_PATHS[path])
        assert out.dtype == mean.dtype == torch.float32 and mean.shape == (shape[1],)
        want = batch_norm_act_reference(x.double(), weight.double(), bias.double(), EPS, relu)
        for got, exact, what in zip((out, mean, rstd), want, ("out", "mean", "rstd")):
            assert_close_rel(got, exact, 1e-5, what)
        dx, dweight, dbias = bwd_kernel(dout, x, weight, bias, mean, rstd, relu, **TRITON_PATHS[path])
        exact = batch_norm_act_bwd_reference(dout.double(), x.double(), weight.double(), bias.double(),
                                             mean.double(), rstd.double(), relu)
        for got, e, what in zip((dx, dweight, dbias), exact, ("dx", "dweight", "dbias")):
            if e.abs().max() == 0:
                assert not got.any(), what
            else:
                assert_close_rel(got, e, 1e-5, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_statistics_of_constant_and_offset_channels(layout, dtype):
    """Channels of one value (random, up to 1e4) and channels far from zero, on every CPU path: the
    statistics are formed from x minus each channel's first value, so a constant channel's mean is
    exact and out is its bias (the mean summed from the values rounded, and times rstd ~ 1/sqrt(eps)
    put out 2.7e-3 off in fp32)."""
    values = torch.randn(1, 2, 1, 1, dtype=torch.float64) * 1e4
    x = torch.cat([values.expand(8, 2, 16, 16), _random((8, 2, 16, 16)).double() + 100.0], dim=1).to(dtype)
    x = _in_layout(x, layout)
    weight, bias = (t.to(dtype) for t in _params(4))
    out, mean, rstd = batch_norm_act(x, weight, bias, EPS, False)
    want = batch_norm_act_reference(x.double(), weight.double(), bias.double(), EPS, False)
    for got, exact, what in zip((out, mean, rstd), want, ("out", "mean", "rstd")):
        assert_close_rel(got, exact, 1e-5, what)
    assert torch.equal(mean[:2], x[0, :2, 0, 0]) and torch.equal(out[:, :2], bias[:2].view(1, 2, 1, 1).expand(8, 2, 16, 16))


@pytest.mark.parametrize("path", list(TRITON_PATHS))
def test_triton_mean_of_a_channel_starting_with_inf(path):
    """Both paths; a chunk stores the mean of its blocks' sums (merging the blocks' means subtracts
    them: NaN after an infinite value), and the split path's merge weighs those means."""
    from revkernels.triton.batch_norm import batch_norm_act

    _check_mean_of_channels_starting_with_inf(functools.partial(batch_norm_act, **TRITON_PATHS[path]),
                                              _channels_starting_with_inf().to(triton_device()))


@pytest.mark.parametrize("path", list(TRITON_PATHS))
def test_triton_statistics_of_constant_and_offset_channels(path):
    """Channels of one value (random, up to 1e4) and channels far from zero: the statistics are
    formed from x minus each channel's first value (block means of the values themselves rounded,
    and the merge carried that into the variance: a constant channel's rstd 4.5e-2 off)."""
    from revkernels.triton.batch_norm import batch_norm_act as fwd_kernel

    device = triton_device()
    shape = (3, 4, 5, 7)
    values = torch.randn(1, 2, 1, 1) * 1e4
    x = torch.cat([values.expand(3, 2, 5, 7), _random((3, 2, 5, 7)) + 100.0], dim=1).to(device)
    weight, bias = (t.to(device) for t in _params(shape[1]))
    out, mean, rstd = fwd_kernel(x, weight, bias, EPS, False, **TRITON_PATHS[path])
    want = batch_norm_act_reference(x.double(), weight.double(), bias.double(), EPS, False)
    for got, exact, what in zip((out, mean, rstd), want, ("out", "mean", "rstd")):
        assert_close_rel(got.cpu(), exact.cpu(), 1e-5, what)
    assert torch.equal(mean[:2].cpu(), x[0, :2, 0, 0].cpu())


@pytest.mark.parametrize("path", list(TRITON_PATHS))
def test_triton_relu_keeps_nan_as_torch(path):
    from revkernels.triton.batch_norm import batch_norm_act as fwd_kernel
    from revkernels.triton.batch_norm import batch_norm_act_bwd as bwd_kernel

    device = triton_device()
    x, weight, bias, dout = (t.to(device) for t in _nan_case("contiguous"))
    _check_relu_keeps_nan(lambda *a: fwd_kernel(*a, **TRITON_PATHS[path]),
                          lambda *a: bwd_kernel(*a, **TRITON_PATHS[path]), x, weight, bias, dout)


def test_triton_bias_grad_in_the_bias_dtype():
    from revkernels.triton.batch_norm import batch_norm_act_bwd as bwd_kernel

    device = triton_device()
    x, dout = _random((2, 3, 5, 7)).to(device), torch.randn(2, 3, 5, 7, device=device)
    weight, bias = _params(3)
    weight, bias = weight.half().to(device), bias.to(device)  # fp16: the interpreter has no bf16
    mean, rstd = x.double().mean((0, 2, 3)).float(), torch.rsqrt(x.double().var((0, 2, 3), correction=0) + EPS).float()
    _, dweight, dbias = bwd_kernel(dout, x, weight, bias, mean, rstd, False, block_m=16, chunks=3)
    exact = batch_norm_act_bwd_reference(dout.double(), x.double(), weight.double(), bias.double(), mean.double(),
                                         rstd.double(), False)
    assert dweight.dtype == torch.float16 and dbias.dtype == torch.float32
    assert_low_precision_rule(dweight, exact[1].half(), exact[1], "dweight")
    assert_close_rel(dbias, exact[2], 1e-5, "dbias")


def test_triton_fp64_and_empty():
    from revkernels.triton.batch_norm import batch_norm_act as fwd_kernel
    from revkernels.triton.batch_norm import batch_norm_act_bwd as bwd_kernel

    device = triton_device()
    x = _random((3, 4, 5)).double().to(device)
    weight, bias = (t.double().to(device) for t in _params(4))
    out, mean, rstd = fwd_kernel(x, weight, bias, EPS, True, block_m=16, chunks=2)
    assert mean.dtype == torch.float64
    assert_close_rel(out, _torch_bn_act(x, weight, bias, True), 1e-12, "out")
    empty = torch.empty(0, 4, 3, device=device)
    out, mean, rstd = fwd_kernel(empty, weight.float(), bias.float(), EPS, True)
    assert out.shape == (0, 4, 3)
    dx, dweight, dbias = bwd_kernel(empty, empty, weight.float(), bias.float(), mean, rstd, True)
    assert dx.shape == (0, 4, 3) and not dweight.any() and not dbias.any()


# --- CUDA (with -m gpu) -----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (32, 64, 56, 56), (256, 64, 7, 7), (1, 8, 1, 1)])
def test_cuda_fp32(shape, layout):
    weight, bias = _params(shape[1])
    x = _in_layout(_off_the_kink(_random(shape), weight, bias), layout).cuda()
    weight, bias = weight.cuda(), bias.cuda()
    dout = torch.randn(shape, device="cuda")
    for relu in (True, False):
        out, mean, rstd = batch_norm_act(x, weight, bias, EPS, relu)
        want = batch_norm_act_reference(x.double(), weight.double(), bias.double(), EPS, relu)
        for got, exact, what in zip((out, mean, rstd), want, ("out", "mean", "rstd")):
            assert_close_rel(got, exact, 1e-5, what)
        got = batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, relu)
        exact = batch_norm_act_bwd_reference(dout.double(), x.double(), weight.double(), bias.double(),
                                             mean.double(), rstd.double(), relu)
        for g, e, what in zip(got, exact, ("dx", "dweight", "dbias")):
            if e.abs().max() == 0:
                assert not g.any(), what
            else:
                assert_close_rel(g, e, 1e-5, what)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (32, 64, 56, 56)])
def test_cuda_bf16_within_2x_of_torch(shape, layout):
    x = _in_layout(_random(shape), layout).cuda().bfloat16()
    weight, bias = (t.cuda() for t in _params(shape[1]))
    dout = torch.randn(shape, device="cuda").bfloat16()
    for relu in (True, False):
        out, mean, rstd = batch_norm_act(x, weight, bias, EPS, relu)
        exact = _torch_bn_act(x.float(), weight, bias, relu)
        _assert_within_2x(out, _torch_bn_act(x, weight.bfloat16(), bias.bfloat16(), relu), exact, "out bf16")
        got = batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, relu)
        exact = _torch_grads(x.float(), weight, bias, dout.float(), relu)
        theirs = _torch_grads(x, weight.bfloat16(), bias.bfloat16(), dout, relu)
        for g, t, e, what in zip(got, theirs, exact, ("dx", "dweight", "dbias")):
            _assert_within_2x(g, t, e, f"{what} bf16")


@pytest.mark.gpu
def test_cuda_reduction_is_split_over_programs():
    # C = 64 channels of 256*56*56 elements each: the grid has several programs per SM, not 64.
    from revkernels.triton._device import sm_count
    from revkernels.triton.batch_norm import _launch_config

    x = torch.empty(256, 64, 56, 56, device="cuda", dtype=torch.bfloat16)
    for t in (x, x.contiguous(memory_format=torch.channels_last)):
        block_c, _, _, chunks = _launch_config(t, 64, 256 * 56 * 56, None, None)
        assert (64 // block_c) * chunks >= 4 * sm_count(t.device)


@pytest.mark.gpu
@pytest.mark.skipif(not has_compiled_kernel("batch_norm_act", "CUDA"), reason="no CUDA C++ kernel compiled")
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cuda_cpp_backend(layout):
    # REVKERNELS_CUDA_BACKEND=cuda: ATen's batch statistics + the CUDA C++ apply kernel.
    from revkernels.ops import get_cuda_backend, set_cuda_backend

    x = _in_layout(_random((8, 16, 9, 9)), layout).cuda()
    weight, bias = (t.cuda() for t in _params(16))
    previous = get_cuda_backend()
    set_cuda_backend("cuda")
    try:
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            for relu in (True, False):
                out, mean, rstd = batch_norm_act(xd, weight, bias, EPS, relu)
                assert out.dtype == dtype and out.stride() == xd.stride()
                want = batch_norm_act_reference(xd.double(), weight.double(), bias.double(), EPS, relu)
                for got, exact, what in zip((out, mean, rstd), want, ("out", "mean", "rstd")):
                    if what == "out" and dtype == torch.bfloat16:  # the low-precision rule
                        composed = F.batch_norm(xd.float(), None, None, weight, bias, True, 0.0, EPS)
                        composed = (torch.relu(composed) if relu else composed).to(dtype)
                        assert_low_precision_rule(got, composed, exact, what)
                    else:
                        assert_close_rel(got, exact, 1e-5, what)
    finally:
        set_cuda_backend(previous)
