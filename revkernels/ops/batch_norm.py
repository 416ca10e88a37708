r"""Training-mode BatchNorm with the ReLU fused in: the BN+ReLU pairs (and the last BN) of the
reversible ResNet residual functions, run by their forward and their recompute alike.

The data x has shape (N, C, *spatial); per channel c the statistics are taken over the batch and
all spatial positions, M = N * prod(spatial) elements. weight and bias have shape (C,).

Forward (``torch.ops.revkernels.batch_norm_act``)::

    batch_norm_act(x, weight, bias, eps, relu) -> (out, mean, rstd)
        mean_c = sum_{n,s} x_{n,c,s} / M
        rstd_c = 1 / sqrt(sum_{n,s} (x_{n,c,s} - mean_c)^2 / M + eps)   (biased variance, as
                                                                       torch's training-mode BN)
        y      = (x - mean_c) * rstd_c * weight_c + bias_c
        out    = relu(y) if relu else y                                 in x's dtype (relu as
                                                                       torch.relu: NaN stays NaN)

Statistics and math are fp32 (fp64 for fp64 x); mean and rstd (shape (C,)) are returned in that
type. Every kernel sums x minus the channel's first value (0 where that is not finite), so a
constant channel's mean is exact and its out is the bias. weight and bias may have any float
dtype. The running statistics are not the op's business:
`revkernels.nn.BatchNormAct2d` updates them from mean and rstd (unbiased variance
``(1 / rstd^2 - eps) * M / (M - 1)``).

Backward (``torch.ops.revkernels.batch_norm_act_bwd``), the VJP of the forward::

    batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, relu) -> (dx, dweight, dbias)
        xhat    = (x - mean_c) * rstd_c
        dy      = 0 where y <= 0 else dout, if relu     (y recomputed from x, mean, rstd, weight, bias
                                                         exactly as the forward formed it; a NaN y
                                                         passes dout, as torch.relu's backward)
        dweight = sum_{n,s} dy * xhat                    per channel
        dbias   = sum_{n,s} dy
        dx      = rstd_c * weight_c * (dy - dbias_c / M - xhat * dweight_c / M)

dx is in x's dtype; dout must have x's dtype and shape (any layout). dweight and dbias are
accumulated in fp32 (fp64 for fp64 x), in a fixed order (deterministic: no atomics), and returned
in weight's and bias's dtype respectively (each rounded once).

VJP of batch_norm_act (registered; mean and rstd are not differentiable), with grad dout of out::

    (dx, dweight, dbias) = batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, relu)
    d x = dx,   d weight = dweight,   d bias = dbias

The formula is C++ (``csrc/ops/batch_norm_autograd.cpp``), or registered from Python without the
compiled library. batch_norm_act_bwd itself has no autograd formula; a backward with
``create_graph=True`` (a double backward, a gradient penalty) takes the same VJP through ATen's
differentiable ``native_batch_norm_backward`` (after ReLU's mask, from y recomputed as above)
instead, so batch_norm_act is differentiable twice.

Entry points: ``batch_norm_act`` / ``batch_norm_act_bwd`` are the ops themselves when the compiled
library is loaded (C++ checks and autograd); without it, Python functions that check the arguments
first.

Kernels: C++ on CPU (``csrc/kernels/batch_norm.h``: one thread per channel range, two passes for the
statistics; a channel's sums are chunked, partial sums of at most 64 terms per lane added in fp64,
so their error does not grow with M); Triton on CUDA (``revkernels/triton/batch_norm.py``: each
channel's reduction split over programs, partial statistics merged with Chan's formula, then an
elementwise apply); without a compiled CPU kernel, the references below.
Layouts: x (and dout) are read as they are when NCHW-contiguous or channels_last (4-d) /
channels_last_3d (5-d), and copied with ``.contiguous()`` otherwise; out and dx are allocated with
``empty_like`` of the tensor the kernel reads (so a channels_last x gives a channels_last out).
"""

import torch

from revkernels.ops._library import (check_eps, check_float_tensor, define_op, entry_point, fill_missing_kernel,
                                     register_autograd_fallback, register_cuda_kernel)


def _accumulate_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _is_channels_last(t):
    return ((t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
            or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)))


def laid_out(t):
    """t as the kernels read it: itself when NCHW-contiguous or channels_last, else a contiguous copy."""
    if t.is_contiguous() or _is_channels_last(t):
        return t
    return t.contiguous()


def _channel_shape(x):
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


def _reduce_dims(x):
    return [0] + list(range(2, x.dim()))


def batch_norm_act_reference(x, weight, bias, eps, relu):
    """Pure-PyTorch (out, mean, rstd) of ``batch_norm_act`` in fp32 (fp64 for fp64 x); out in x's
    dtype, laid out as the kernels lay it out."""
    acc = _accumulate_dtype(x)
    xa = x.to(acc)
    dims, shape = _reduce_dims(x), _channel_shape(x)
    mean = xa.mean(dims)
    rstd = torch.rsqrt(xa.var(dims, correction=0) + eps)
    y = (xa - mean.view(shape)) * rstd.view(shape) * weight.to(acc).view(shape) + bias.to(acc).view(shape)
    if relu:
        y = torch.relu(y)
    out = torch.empty_like(laid_out(x))
    out.copy_(y)
    return out, mean, rstd


def batch_norm_act_bwd_reference(dout, x, weight, bias, mean, rstd, relu):
    """Pure-PyTorch (dx, dweight, dbias) of ``batch_norm_act_bwd`` by the explicit formulas, in fp32
    (fp64 for fp64 x)."""
    acc = _accumulate_dtype(x)
    dims, shape = _reduce_dims(x), _channel_shape(x)
    count = x.numel() // x.shape[1]
    mu, rs = mean.to(acc).view(shape), rstd.to(acc).view(shape)
    w, b = weight.to(acc).view(shape), bias.to(acc).view(shape)
    xa = x.to(acc)
    dy = dout.to(acc)
    if relu:
        dy = torch.where((xa - mu) * rs * w + b <= 0, torch.zeros((), dtype=acc), dy)  # torch.relu's backward
    xhat = (xa - mu) * rs
    dbias = dy.sum(dims)
    dweight = (dy * xhat).sum(dims)
    dx_full = rs * w * (dy - dbias.view(shape) / count - xhat * dweight.view(shape) / count)
    dx = torch.empty_like(laid_out(x))
    dx.copy_(dx_full)
    return dx, dweight.to(weight.dtype), dbias.to(bias.dtype)


# --- argument checks (the C++ kernels repeat them; these also guard the Triton path) -------------

def _channels(x, name):
    if x.dim() < 2:
        raise ValueError(f"revkernels: {name} must have shape (N, C, *spatial), got {x.dim()} dims")
    if x.shape[1] == 0:
        raise ValueError(f"revkernels: {name} must have at least one channel (dim 1)")
    return x.shape[1]


def _check_channel_vector(p, name, c, data_name):
    check_float_tensor(p, name)
    if p.shape != (c,):
        raise ValueError(f"revkernels: {name} must have shape ({c},), the channels of {data_name}, "
                         f"got {tuple(p.shape)}")


def _check_same_device(tensors, ref, ref_name):
    for t, name in tensors:
        if t.device != ref.device:
            raise ValueError(f"revkernels: {name} must be on the device of {ref_name} ({ref.device}), got {t.device}")


def _check_relu(relu):
    if not isinstance(relu, bool):
        raise TypeError(f"revkernels: relu must be a bool, got {type(relu).__name__}")


def _check_batch_norm_act_args(x, weight, bias, eps, relu):
    check_float_tensor(x, "x")
    c = _channels(x, "x")
    _check_channel_vector(weight, "weight", c, "x")
    _check_channel_vector(bias, "bias", c, "x")
    check_eps(eps)
    _check_relu(relu)
    _check_same_device([(weight, "weight"), (bias, "bias")], x, "x")


def _check_batch_norm_act_bwd_args(dout, x, weight, bias, mean, rstd, relu):
    check_float_tensor(dout, "dout")
    check_float_tensor(x, "x")
    if dout.dtype != x.dtype:
        raise TypeError(f"revkernels: dout must have the dtype of x ({x.dtype}), got {dout.dtype}")
    c = _channels(x, "x")
    if dout.shape != x.shape:
        raise ValueError(f"revkernels: dout must have the shape of x {tuple(x.shape)}, got {tuple(dout.shape)}")
    for t, name in ((weight, "weight"), (bias, "bias"), (mean, "mean"), (rstd, "rstd")):
        _check_channel_vector(t, name, c, "x")
    _check_relu(relu)
    _check_same_device([(dout, "dout"), (weight, "weight"), (bias, "bias"), (mean, "mean"), (rstd, "rstd")], x, "x")


_batch_norm_act = define_op(
    "batch_norm_act",
    "(Tensor x, Tensor weight, Tensor bias, float eps=1e-05, bool relu=True) -> (Tensor out, Tensor mean, Tensor rstd)")
_batch_norm_act_bwd = define_op(
    "batch_norm_act_bwd",
    "(Tensor dout, Tensor x, Tensor weight, Tensor bias, Tensor mean, Tensor rstd, bool relu=True) "
    "-> (Tensor dx, Tensor dweight, Tensor dbias)")


# Kernels registered in Python get the same argument checks as the C++ ones (a direct
# torch.ops.revkernels call bypasses the entry points below).
def _batch_norm_act_checked_reference(x, weight, bias, eps=1e-5, relu=True):
    _check_batch_norm_act_args(x, weight, bias, eps, relu)
    return batch_norm_act_reference(x, weight, bias, eps, relu)


def _batch_norm_act_bwd_checked_reference(dout, x, weight, bias, mean, rstd, relu=True):
    _check_batch_norm_act_bwd_args(dout, x, weight, bias, mean, rstd, relu)
    return batch_norm_act_bwd_reference(dout, x, weight, bias, mean, rstd, relu)


fill_missing_kernel("batch_norm_act", "CPU", _batch_norm_act_checked_reference)
fill_missing_kernel("batch_norm_act_bwd", "CPU", _batch_norm_act_bwd_checked_reference)


# --- CUDA: Triton ----------------------------------------------------------------------------------

def _batch_norm_act_triton(x, weight, bias, eps=1e-5, relu=True):
    from revkernels.triton.batch_norm import batch_norm_act as kernel

    _check_batch_norm_act_args(x, weight, bias, eps, relu)
    return kernel(x, weight, bias, eps, relu)


def _batch_norm_act_bwd_triton(dout, x, weight, bias, mean, rstd, relu=True):
    from revkernels.triton.batch_norm import batch_norm_act_bwd as kernel

    _check_batch_norm_act_bwd_args(dout, x, weight, bias, mean, rstd, relu)
    return kernel(dout, x, weight, bias, mean, rstd, relu)


register_cuda_kernel("batch_norm_act", _batch_norm_act_triton)
register_cuda_kernel("batch_norm_act_bwd", _batch_norm_act_bwd_triton)


# --- fake (meta) implementations -------------------------------------------------------------------

@torch.library.register_fake("revkernels::batch_norm_act")
def _batch_norm_act_fake(x, weight, bias, eps=1e-5, relu=True):
    _check_batch_norm_act_args(x, weight, bias, eps, relu)  # a meta argument must not slip past the checks
    out = torch.empty_like(laid_out(x))
    mean = torch.empty(x.shape[1], dtype=_accumulate_dtype(x), device=x.device)
    return out, mean, torch.empty_like(mean)


@torch.library.register_fake("revkernels::batch_norm_act_bwd")
def _batch_norm_act_bwd_fake(dout, x, weight, bias, mean, rstd, relu=True):
    _check_batch_norm_act_bwd_args(dout, x, weight, bias, mean, rstd, relu)
    c = x.shape[1]
    return (torch.empty_like(laid_out(x)), torch.empty(c, dtype=weight.dtype, device=x.device),
            torch.empty(c, dtype=bias.dtype, device=x.device))


# --- autograd ----------------------------------------------------------------------------------------

def _batch_norm_act_setup_context(ctx, inputs, output):
    x, weight, bias, eps, relu = inputs
    out, mean, rstd = output
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.relu, ctx.eps = relu, eps
    ctx.mark_non_differentiable(mean, rstd)


def _batch_norm_act_backward(ctx, dout, dmean, drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: a differentiable VJP (see csrc/ops/batch_norm_autograd.cpp)
        dx, dweight, dbias = _differentiable_vjp(dout, x, weight, bias, mean, rstd, ctx.eps, ctx.relu)
    else:
        dx, dweight, dbias = _batch_norm_act_bwd(dout.to(x.dtype), x, weight, bias, mean, rstd, ctx.relu)
    return (dx if ctx.needs_input_grad[0] else None, dweight if ctx.needs_input_grad[1] else None,
            dbias if ctx.needs_input_grad[2] else None, None, None)


def _differentiable_vjp(dout, x, weight, bias, mean, rstd, eps, relu):
    acc, shape = mean.dtype, (1, -1) + (1,) * (x.dim() - 2)
    xa, wa = x.to(acc), weight.to(acc)
    dy = dout.to(acc)
    if relu:
        with torch.no_grad():
            y = (xa - mean.view(shape)) * rstd.view(shape) * wa.view(shape) + bias.to(acc).view(shape)
        dy = dy * (y.gt(0) | y.isnan()).to(acc)
    dx, dweight, dbias = torch.ops.aten.native_batch_norm_backward(dy, xa, wa, None, None, mean, rstd, True, eps,
                                                                   [True, True, True])
    return dx.to(x.dtype), dweight.to(weight.dtype), dbias.to(bias.dtype)


register_autograd_fallback("batch_norm_act", _batch_norm_act_backward, _batch_norm_act_setup_context)


# --- entry points ----------------------------------------------------------------------------------

def _batch_norm_act_checked(x, weight, bias, eps=1e-5, relu=True):
    """``(out, mean, rstd)``: training-mode BatchNorm of x (N, C, *spatial) with batch statistics per
    channel, affine (weight, bias of shape (C,)), then ReLU if `relu`; out in x's dtype, mean and
    rstd in fp32 (fp64 for fp64 x). Differentiable in x, weight and bias."""
    _check_batch_norm_act_args(x, weight, bias, eps, relu)
    return _batch_norm_act(x, weight, bias, float(eps), relu)


def _batch_norm_act_bwd_checked(dout, x, weight, bias, mean, rstd, relu=True):
    """``(dx, dweight, dbias)``: the VJP of ``batch_norm_act`` (mean, rstd from its forward)."""
    _check_batch_norm_act_bwd_args(dout, x, weight, bias, mean, rstd, relu)
    return _batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, relu)


def _check_batch_norm_act_scalars(x, weight, bias, eps=1e-5, relu=True):
    check_eps(eps)
    _check_relu(relu)


batch_norm_act = entry_point("batch_norm_act", _batch_norm_act_checked, _check_batch_norm_act_scalars)
batch_norm_act_bwd = entry_point("batch_norm_act_bwd", _batch_norm_act_bwd_checked,
                                 lambda dout, x, weight, bias, mean, rstd, relu=True: _check_relu(relu))
