r"""LayerNorm ops with the coupling fused in: the rebuild subtract feeding F's first LayerNorm, and
the LayerNorm backward feeding the residual-gradient add (docs/design.md, "Kernels: what to fuse").

Rows are all leading dims flattened; the last dim (width N) is normalised; weight and bias have
shape (N,). In a reversible block whose F starts with a LayerNorm, the rebuild ``x2 = y2 - G(y1)``
is followed at once by ``LN(x2)``, and the backward of ``x1 = ... F(x2)`` ends with the
LayerNorm's VJP added to the residual gradient of x2; each op does one of these in one pass.

Forward (``torch.ops.revkernels.sub_layer_norm``)::

    sub_layer_norm(y, g, weight, bias, eps) -> (x, ln, mean, rstd)
        x    = y - g                                     in y's dtype, formed in fp32, rounded once
        mean = x_0 + sum_i (x_i - x_0) / N               per row, of the rounded x (shifted by
                                                         x_0: a constant row's mean is exact)
        rstd = 1 / sqrt(sum_i (x_i - mean)^2 / N + eps)  (biased variance, as torch's LayerNorm)
        ln   = (x - mean) * rstd * weight + bias         in x's dtype

ln is therefore exactly ``LayerNorm(x)`` of the x the op returns. g may have another float dtype
(a bf16 G output against an fp32 stream), as in ``coupling_sub``; weight and bias any float dtype.
Accumulation is fp32, fp64 when y or g is fp64; mean and rstd (shape ``y.shape[:-1]``) are
returned in that type.

Backward (``torch.ops.revkernels.layer_norm_bwd_add``), the LayerNorm VJP plus the residual add::

    layer_norm_bwd_add(dln, x, weight, mean, rstd, dres) -> (dx, dweight, dbias)
        xhat    = (x - mean) * rstd
        dxhat   = dln * weight
        dx      = dres + rstd * (dxhat - mean_i(dxhat) - xhat * mean_i(dxhat * xhat))
        dweight = sum_rows(dln * xhat)
        dbias   = sum_rows(dln)

dx is in dres's dtype (one rounding, after the add); dln must have x's dtype. dweight and dbias
are accumulated in fp32 (fp64 when x or dres is fp64) as partial sums per block of rows, reduced in
a fixed order (deterministic), and returned in weight's dtype.

VJP of sub_layer_norm (registered, so the op works inside an autograd graph: in C++,
``csrc/ops/layer_norm_autograd.cpp``, or from Python without the compiled library; mean and rstd are
not differentiable), with grads (dx_out, dln) of its outputs (x, ln)::

    (dx, dweight, dbias) = layer_norm_bwd_add(dln, x, weight, mean, rstd, dres=dx_out)
    d y = dx,   d g = -dx,   d weight = dweight,   d bias = dbias

(with weight passed in the accumulation dtype where bias has another dtype, so that dweight and
dbias are each rounded once, to their parameter's dtype).

layer_norm_bwd_add itself has no autograd formula; a backward with ``create_graph=True`` (a double
backward) takes the same VJP through ATen's differentiable ``native_layer_norm_backward`` (on x,
weight and bias in the accumulation dtype) instead, so sub_layer_norm is differentiable twice.

Kernels: C++ on CPU (``csrc/cpu/vec_kernels.cpp``, semantics ``csrc/kernels/layer_norm.h``; a
row's sums are chunked, partial sums of at most 64 terms per lane added in fp64, so their error does
not grow with N; sub_layer_norm calls larger than the last-level cache write x and ln with
streaming stores); Triton on CUDA (``revkernels/triton/layer_norm.py``;
there is no CUDA C++ kernel for these ops); without a compiled CPU kernel, the references below.
Entry points: ``sub_layer_norm`` / ``layer_norm_bwd_add`` are the ops themselves when the compiled
library is loaded (C++ checks and autograd); without it, Python functions that check the arguments
first.
Layouts: inputs may be non-contiguous; the kernels read each as (rows, N) with unit stride along N
(any row stride, 0 included), copying one that has no such view with ``.contiguous()``. Outputs
are contiguous.
"""

import torch

from revkernels.ops._library import (check_eps, check_float_tensor, define_op, entry_point, fill_missing_kernel,
                                     register_autograd_fallback, register_cuda_kernel)


def _accumulate_dtype(a, b):
    return torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32


def sub_layer_norm_reference(y, g, weight, bias, eps=1e-5):
    """Pure-PyTorch (x, ln, mean, rstd) of ``sub_layer_norm``, in fp32 (fp64 if y or g is fp64)."""
    acc = _accumulate_dtype(y, g)
    x = (y.to(acc) - g.to(acc)).to(y.dtype)
    xa = x.to(acc)
    mean = xa.mean(-1)
    rstd = torch.rsqrt(xa.var(-1, correction=0) + eps)
    ln = torch.nn.functional.layer_norm(xa, xa.shape[-1:], weight.to(acc), bias.to(acc), eps)
    return x, ln.to(y.dtype), mean, rstd


def layer_norm_bwd_add_reference(dln, x, weight, mean, rstd, dres):
    """Pure-PyTorch (dx, dweight, dbias) of ``layer_norm_bwd_add`` by the explicit formulas, in fp32
    (fp64 if x or dres is fp64)."""
    acc = _accumulate_dtype(x, dres)
    n = x.shape[-1]
    d = dln.to(acc)
    xhat = (x.to(acc) - mean.to(acc).unsqueeze(-1)) * rstd.to(acc).unsqueeze(-1)
    dxhat = d * weight.to(acc)
    dx = rstd.to(acc).unsqueeze(-1) * (dxhat - dxhat.mean(-1, keepdim=True)
                                       - xhat * (dxhat * xhat).mean(-1, keepdim=True))
    dweight = (d * xhat).reshape(-1, n).sum(0)
    dbias = d.reshape(-1, n).sum(0)
    return (dres.to(acc) + dx).to(dres.dtype), dweight.to(weight.dtype), dbias.to(weight.dtype)


_sub_layer_norm = define_op(
    "sub_layer_norm",
    "(Tensor y, Tensor g, Tensor weight, Tensor bias, float eps=1e-05) -> (Tensor x, Tensor ln, Tensor mean, Tensor rstd)")
_layer_norm_bwd_add = define_op(
    "layer_norm_bwd_add",
    "(Tensor dln, Tensor x, Tensor weight, Tensor mean, Tensor rstd, Tensor dres) "
    "-> (Tensor dx, Tensor dweight, Tensor dbias)")


# --- argument checks (the C++ kernels repeat them; these also guard the Triton path) -------------

def _check_same_shape(t, name, ref, ref_name):
    if t.shape != ref.shape:
        raise ValueError(f"revkernels: {name} must have the shape of {ref_name} {tuple(ref.shape)}, "
                         f"got {tuple(t.shape)}")


def _check_same_device(tensors, ref, ref_name):
    for t, name in tensors:
        if t.device != ref.device:
            raise ValueError(f"revkernels: {name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


def _normalised_width(t, name):
    if t.dim() < 1:
        raise ValueError(f"revkernels: {name} must have at least one dim (the normalised one)")
    if t.shape[-1] == 0:
        raise ValueError(f"revkernels: the last (normalised) dim of {name} must be non-empty")
    return t.shape[-1]


def _check_param(p, name, n, data_name):
    check_float_tensor(p, name)
    if p.shape != (n,):
        raise ValueError(f"revkernels: {name} must have shape ({n},), the last dim of {data_name}, "
                         f"got {tuple(p.shape)}")


def _check_sub_layer_norm_args(y, g, weight, bias, eps):
    check_float_tensor(y, "y")
    check_float_tensor(g, "g")
    _check_same_shape(g, "g", y, "y")
    n = _normalised_width(y, "y")
    _check_param(weight, "weight", n, "y")
    _check_param(bias, "bias", n, "y")
    check_eps(eps)
    _check_same_device([(g, "g"), (weight, "weight"), (bias, "bias")], y, "y")


def _check_layer_norm_bwd_add_args(dln, x, weight, mean, rstd, dres):
    for t, name in ((dln, "dln"), (x, "x"), (weight, "weight"), (mean, "mean"), (rstd, "rstd"), (dres, "dres")):
        check_float_tensor(t, name)
    if dln.dtype != x.dtype:
        raise TypeError(f"revkernels: dln must have the dtype of x ({x.dtype}), got {dln.dtype}")
    n = _normalised_width(x, "x")
    _check_same_shape(dln, "dln", x, "x")
    _check_same_shape(dres, "dres", x, "x")
    _check_param(weight, "weight", n, "x")
    for t, name in ((mean, "mean"), (rstd, "rstd")):
        if t.shape != x.shape[:-1]:
            raise ValueError(f"revkernels: {name} must have shape x.shape[:-1] {tuple(x.shape[:-1])}, "
                             f"got {tuple(t.shape)}")
    _check_same_device([(dln, "dln"), (weight, "weight"), (mean, "mean"), (rstd, "rstd"), (dres, "dres")], x, "x")


# --- CPU without the compiled library: the C++ kernels' checks, then the references (with the
# kernels' contiguous outputs) ---------------------------------------------------------------------

def _sub_layer_norm_checked_reference(y, g, weight, bias, eps=1e-5):
    _check_sub_layer_norm_args(y, g, weight, bias, eps)
    return tuple(t.contiguous() for t in sub_layer_norm_reference(y, g, weight, bias, eps))


def _layer_norm_bwd_add_checked_reference(dln, x, weight, mean, rstd, dres):
    _check_layer_norm_bwd_add_args(dln, x, weight, mean, rstd, dres)
    return tuple(t.contiguous() for t in layer_norm_bwd_add_reference(dln, x, weight, mean, rstd, dres))


fill_missing_kernel("sub_layer_norm", "CPU", _sub_layer_norm_checked_reference)
fill_missing_kernel("layer_norm_bwd_add", "CPU", _layer_norm_bwd_add_checked_reference)


# --- CUDA: Triton ----------------------------------------------------------------------------------

def _sub_layer_norm_triton(y, g, weight, bias, eps=1e-5):
    from revkernels.triton.layer_norm import sub_layer_norm as kernel

    _check_sub_layer_norm_args(y, g, weight, bias, eps)
    return kernel(y, g, weight, bias, eps)


def _layer_norm_bwd_add_triton(dln, x, weight, mean, rstd, dres):
    from revkernels.triton.layer_norm import layer_norm_bwd_add as kernel

    _check_layer_norm_bwd_add_args(dln, x, weight, mean, rstd, dres)
    return kernel(dln, x, weight, mean, rstd, dres)


register_cuda_kernel("sub_layer_norm", _sub_layer_norm_triton)
register_cuda_kernel("layer_norm_bwd_add", _layer_norm_bwd_add_triton)


# --- fake (meta) implementations -------------------------------------------------------------------

@torch.library.register_fake("revkernels::sub_layer_norm")
def _sub_layer_norm_fake(y, g, weight, bias, eps=1e-5):
    _check_sub_layer_norm_args(y, g, weight, bias, eps)  # a meta argument must not slip past the checks
    x = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    stats_dtype = _accumulate_dtype(y, g)
    mean = torch.empty(y.shape[:-1], dtype=stats_dtype, device=y.device)
    return x, torch.empty_like(x), mean, torch.empty_like(mean)


@torch.library.register_fake("revkernels::layer_norm_bwd_add")
def _layer_norm_bwd_add_fake(dln, x, weight, mean, rstd, dres):
    _check_layer_norm_bwd_add_args(dln, x, weight, mean, rstd, dres)
    n = x.shape[-1]
    dx = torch.empty(x.shape, dtype=dres.dtype, device=x.device)
    return (dx, torch.empty(n, dtype=weight.dtype, device=x.device),
            torch.empty(n, dtype=weight.dtype, device=x.device))


# --- autograd ----------------------------------------------------------------------------------------

def _sub_layer_norm_setup_context(ctx, inputs, output):
    y, g, weight, bias, eps = inputs
    x, ln, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd, bias)
    ctx.g_dtype, ctx.bias_dtype = g.dtype, bias.dtype
    ctx.mark_non_differentiable(mean, rstd)


def _sub_layer_norm_backward(ctx, dx_out, dln, dmean, drstd):
    x, weight, mean, rstd, bias = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a differentiable VJP (see csrc/ops/layer_norm_autograd.cpp)
        acc = mean.dtype
        dln_x, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
            dln.to(acc), x.to(acc), [x.shape[-1]], mean, rstd, weight.to(acc), bias.to(acc), [True, True, True])
        dx = (dln_x + dx_out.to(acc)).to(x.dtype)
        return dx, (-dx).to(ctx.g_dtype), dweight.to(weight.dtype), dbias.to(ctx.bias_dtype), None
    # The op returns dweight and dbias in the dtype of the weight it gets: where bias has another dtype, it
    # gets weight in the accumulation dtype, and each sum is rounded once, to its parameter's dtype.
    w = weight if weight.dtype == ctx.bias_dtype else weight.to(_accumulate_dtype(x, dx_out))
    dx, dweight, dbias = _layer_norm_bwd_add(dln, x, w, mean, rstd, dx_out)
    return dx, (-dx).to(ctx.g_dtype), dweight.to(weight.dtype), dbias.to(ctx.bias_dtype), None


register_autograd_fallback("sub_layer_norm", _sub_layer_norm_backward, _sub_layer_norm_setup_context)


# --- entry points ----------------------------------------------------------------------------------

def _sub_layer_norm_checked(y, g, weight, bias, eps=1e-5):
    """``(x, ln, mean, rstd)`` with ``x = y - g`` in y's dtype and ``ln = LayerNorm(x)`` over the last
    dim (weight, bias of shape (N,)), one pass: the coupling rebuild fused with F's first LayerNorm.
    Differentiable in y, g, weight and bias."""
    _check_sub_layer_norm_args(y, g, weight, bias, eps)
    return _sub_layer_norm(y, g, weight, bias, float(eps))


def _layer_norm_bwd_add_checked(dln, x, weight, mean, rstd, dres):
    """``(dx, dweight, dbias)``: the LayerNorm backward of ``ln = LayerNorm(x)`` (mean, rstd from the
    forward) with the residual gradient added, ``dx = dres + LN_bwd(dln)`` in dres's dtype."""
    _check_layer_norm_bwd_add_args(dln, x, weight, mean, rstd, dres)
    return _layer_norm_bwd_add(dln, x, weight, mean, rstd, dres)


sub_layer_norm = entry_point(
    "sub_layer_norm", _sub_layer_norm_checked, lambda y, g, weight, bias, eps=1e-5: check_eps(eps))
layer_norm_bwd_add = entry_point("layer_norm_bwd_add", _layer_norm_bwd_add_checked)
