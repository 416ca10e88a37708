r"""GEMM-side rebuild: ``x = y - (a @ W^T + b)`` as one GEMM call.

In a reversible block whose residual function ends in a linear layer (attention's output
projection, the MLP's second layer), the rebuild ``x = y - F(.)`` does not need F's output as a
tensor: the GEMM takes ``y`` as its accumulator (BLAS ``C <- beta*C + alpha*A@B`` with beta = 1,
alpha = -1), so the output projection and the subtraction are one kernel::

    x = addmm(y - b, a, W^T, beta=1, alpha=-1)        (y - b: the bias folded into the accumulator)

except for a 16-bit accumulator with a bias: there ``y - b`` would be rounded to 16 bits before the
GEMM adds to it, so the op computes ``y - addmm(b, a, W^T)`` instead, F.linear's single rounding of
``a @ W^T + b`` followed by the subtraction's (a folded bias could lose more than twice the
composition's error where y and b nearly cancel). The accumulator has the promoted dtype of y and
the GEMM, bias or not (a 16-bit y with fp32 a and W accumulates in fp32: the product is not
rounded to 16 bits), and ``y - b`` is formed in the wider of that dtype and b's (a bf16 y and b are
not rounded to bf16 before an fp32 GEMM adds to them). Where it is a tensor of the op's own
(``y - b``, or y converted), the GEMM accumulates into it in place (``addmm_``; addmm would copy it
into a new output first); otherwise it is y itself, which addmm leaves alone.

Shapes: y (..., N), a (..., K), W (N, K), b (N,) or None, K or N possibly 0 (as for F.linear); x
has y's shape and dtype and is contiguous, whatever y's layout; y, a, W and b are float16, bfloat16,
float32 or float64. Under autocast the GEMM runs in the autocast dtype like ``F.linear`` would (not
with a float64 a or W, which autocast leaves alone) while an fp32 stream stays the fp32 accumulator
(on CUDA, ``addmm(..., out_dtype=float32)``; CPU BLAS has no mixed-dtype GEMM, so there the product
is formed in the autocast dtype and subtracted in fp32).

VJP (linear in every input)::

    dy = g     da = -g @ W     dW = -g^T a     db = -sum_rows(g)

with the GEMMs in the promoted dtype of a and W (the forward's), each result cast to its input's
dtype: an fp32 a with a bf16 W gets a da of fp32 accuracy.

Kernels: one cuBLAS / CPU BLAS ``addmm`` per call (the bias is subtracted from y in the same pass
that makes the accumulator), so there is no device-specific code: the op is a composite of ATen
calls, registered for every device (``csrc/ops/linear_sub.cpp``, its autograd formula in
``csrc/ops/linear_sub_autograd.cpp``; without the compiled library, the Python versions below).

Entry point: ``linear_sub`` is the op itself when the compiled library is loaded (C++ checks and
autograd); without it, a Python function that checks the arguments first.
"""
import math

import torch

from revkernels.ops._library import (check_float_tensor, define_op, entry_point, fill_missing_kernel,
                                     register_autograd_fallback)

_linear_sub = define_op("linear_sub", "(Tensor y, Tensor a, Tensor weight, Tensor? bias=None) -> Tensor")


def _accumulate_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def linear_sub_reference(y, a, weight, bias=None):
    """Pure-PyTorch ``y - F.linear(a, weight, bias)`` formed in fp32 (fp64 if any input is fp64) and
    rounded to y's dtype."""
    acc = _accumulate_dtype(y, a, weight, bias)
    return (y.to(acc) - torch.nn.functional.linear(a.to(acc), weight.to(acc), None if bias is None else bias.to(acc))).to(y.dtype)


def _check_linear_sub_args(y, a, weight, bias):
    for t, name in ((y, "y"), (a, "a"), (weight, "weight")) + (((bias, "bias"),) if bias is not None else ()):
        check_float_tensor(t, name)
    if weight.dim() != 2:
        raise ValueError(f"revkernels: weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    if a.dim() < 1 or a.shape[-1] != k:
        raise ValueError(f"revkernels: a must have last dim {k} (weight's in_features), got shape {tuple(a.shape)}")
    if y.shape != (*a.shape[:-1], n):
        raise ValueError(f"revkernels: y must have shape {(*a.shape[:-1], n)} (a's leading dims, weight's out_features), got {tuple(y.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"revkernels: bias must have shape ({n},), got {tuple(bias.shape)}")
    for t, name in ((a, "a"), (weight, "weight"), (bias, "bias")):
        if t is not None and t.device != y.device:
            raise ValueError(f"revkernels: {name} must be on the device of y ({y.device}), got {t.device}")


def _gemm_dtype(y, a, weight):
    # autocast's dtype as F.linear would use it: not for a float64 operand, which autocast leaves alone
    if torch.is_autocast_enabled(a.device.type) and torch.float64 not in (a.dtype, weight.dtype):
        return torch.get_autocast_dtype(a.device.type)
    return torch.promote_types(a.dtype, weight.dtype)


def _linear_sub_impl(y, a, weight, bias=None):
    _check_linear_sub_args(y, a, weight, bias)
    gemm_dtype = _gemm_dtype(y, a, weight)
    n, k = weight.shape
    rows = math.prod(a.shape[:-1])  # k or n may be 0: no -1
    a2d, w = a.reshape(rows, k).to(gemm_dtype), weight.to(gemm_dtype)
    acc = y.reshape(rows, n)  # addmm reads its accumulator and writes a new tensor: y is not modified
    acc_dtype = torch.promote_types(y.dtype, gemm_dtype)
    with torch.autocast(a.device.type, enabled=False):
        if bias is not None and acc_dtype in (torch.bfloat16, torch.float16):  # see the module docstring
            out = acc.to(acc_dtype) - torch.addmm(bias.to(gemm_dtype), a2d, w.t())
            return _contiguous_in(out.reshape(y.shape), y.dtype)
        # The accumulator in acc_dtype, bias or not (a 16-bit y, fp32 GEMM: no 16-bit rounding of the
        # product); y - b formed in the wider of acc_dtype and b's dtype, not in y's and b's.
        if bias is None:
            acc = acc.to(acc_dtype)
        else:
            sub = torch.promote_types(acc_dtype, bias.dtype)
            acc = (acc.to(sub) - bias.to(sub)).to(acc_dtype)
        own_acc = bias is not None or y.dtype != acc_dtype  # y - b, or y converted: not y itself
        if acc.dtype == gemm_dtype and own_acc:
            out = acc.addmm_(a2d, w.t(), beta=1, alpha=-1)  # this call's own tensor: no copy
        elif acc.dtype == gemm_dtype:
            out = torch.addmm(acc, a2d, w.t(), beta=1, alpha=-1)
        elif acc.is_cuda and acc.dtype == torch.float32:
            # bf16/fp16 GEMM accumulating into the fp32 stream: cuBLAS with an fp32 C matrix.
            out = torch.addmm(acc, a2d, w.t(), out_dtype=torch.float32, beta=1, alpha=-1)
        else:  # CPU BLAS has no mixed-dtype GEMM: subtract the product in the wider dtype
            out = acc - torch.mm(a2d, w.t()).to(acc.dtype)
    return _contiguous_in(out.reshape(y.shape), y.dtype)


def _contiguous_in(t, dtype):
    # t in dtype, contiguous (the result's layout whatever y's: the fake kernel's), copied at most once.
    return t.to(dtype) if t.is_contiguous() else torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)


fill_missing_kernel("linear_sub", "CompositeExplicitAutograd", _linear_sub_impl)


@torch.library.register_fake("revkernels::linear_sub")
def _linear_sub_fake(y, a, weight, bias=None):
    _check_linear_sub_args(y, a, weight, bias)
    return y.new_empty(y.shape)  # contiguous whatever y's layout, as the kernel's result


def _setup_context(ctx, inputs, output):
    y, a, weight, bias = inputs
    ctx.save_for_backward(a, weight)
    ctx.y_dtype = y.dtype
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    a, weight = ctx.saved_tensors
    rows = math.prod(a.shape[:-1])  # k or n may be 0: no -1
    g = grad.reshape(rows, weight.shape[0])
    da = dweight = dbias = None
    gemm = torch.promote_types(a.dtype, weight.dtype)  # the forward's GEMM dtype (see csrc/ops/linear_sub_autograd.cpp)
    if ctx.needs_input_grad[1]:
        da = (-g.to(gemm) @ weight.to(gemm)).reshape(a.shape).to(a.dtype)
    if ctx.needs_input_grad[2]:
        dweight = (-g.to(gemm).t() @ a.reshape(rows, a.shape[-1]).to(gemm)).to(weight.dtype)
    if ctx.has_bias and ctx.needs_input_grad[3]:
        dbias = (-g.to(_accumulate_dtype(g)).sum(0)).to(ctx.bias_dtype)
    return grad.to(ctx.y_dtype), da, dweight, dbias


register_autograd_fallback("linear_sub", _backward, _setup_context)


def _linear_sub_checked(y, a, weight, bias=None):
    """``y - (a @ weight^T + bias)`` in y's dtype, as one GEMM with y as the accumulator."""
    _check_linear_sub_args(y, a, weight, bias)
    return _linear_sub(y, a, weight, bias)


linear_sub = entry_point("linear_sub", _linear_sub_checked)
