r"""Bias + GELU ops: the MLP's fc1 epilogue, and its backward fused with the bias-gradient reduction.

x has shape (..., N) (rows = x.numel() / N), bias (N,). With z = x + bias (broadcast over rows)::

    forward   y  = gelu(z)                       in x's dtype
    backward  dx = dy * gelu'(z)                 in x's dtype
              dbias[j] = sum over all rows of dx[..., j]   in bias's dtype

GELU exactly as torch.nn.functional.gelu defines it (``approximate``)::

    "none"  gelu(z)  = z Phi(z) = 0.5 z (1 + erf(z / sqrt 2))
            gelu'(z) = Phi(z) + z phi(z) = 0.5 (1 + erf(z / sqrt 2)) + z exp(-z^2 / 2) / sqrt(2 pi)

    "tanh"  gelu(z)  = 0.5 z (1 + tanh u),   u = sqrt(2 / pi) (z + 0.044715 z^3)
            gelu'(z) = 0.5 (1 + tanh u) + 0.5 z (1 - tanh^2 u) u',   u' = sqrt(2 / pi) (1 + 3 * 0.044715 z^2)

The kernels evaluate the tanh form through s = (1 + tanh u) / 2 = sigmoid(2u):
gelu(z) = z s and gelu'(z) = s + 2 z s (1 - s) u', with s and 1 - s = sigmoid(-2u) formed from
exp(-2|u|) (no overflow, no cancellation in 1 - tanh^2 u).

Ops (``torch.ops.revkernels.*``)::

    bias_gelu(x, bias, approximate="none") -> y
    bias_gelu_bwd(dy, x, bias, approximate="none") -> (dx, dbias)

Precision: z, gelu and gelu' are formed in fp32 (fp64 when x or bias is fp64) and each output is
rounded once, so z is never rounded to a 16-bit dtype. dbias sums the unrounded fp32 dx: per-chunk
(per-program, per-block) partial sums in fp32, then a second pass over the partials in a fixed
order (reproducible; it does not depend on the thread count or scheduling). bias may have another
float dtype than x (an fp32 bias with bf16 activations); dy must have x's dtype and shape.
Outputs are contiguous. x and dy may be non-contiguous: the kernels read them as (rows, N) with
unit column stride and any row stride (a view for contiguous or row-sliced tensors), and other
layouts are copied to contiguous first.

Kernels: C++ on CPU (``csrc/kernels/bias_gelu.h``); on CUDA Triton (``revkernels/triton/bias_gelu.py``,
above 2^24 elements under the default backend) or CUDA C++ (``csrc/kernels/bias_gelu.cu``, below; see
``set_cuda_backend``); without a compiled CPU kernel, the references below.

Autograd: bias_gelu's VJP is bias_gelu_bwd (grads for x and bias; none for ``approximate``), in C++
(``csrc/ops/bias_gelu_autograd.cpp``), or from Python without the compiled library. bias_gelu_bwd
itself has no autograd formula; a backward with ``create_graph=True`` (a double backward) takes
the same VJP through ATen's differentiable ``gelu_backward`` instead, so bias_gelu is
differentiable twice.

Entry points: ``bias_gelu`` / ``bias_gelu_bwd`` are the ops themselves when the compiled library is
loaded (C++ checks and autograd); without it, Python functions that check the arguments first.
"""
import torch
import torch.nn.functional as F

from revkernels.ops._library import (FLOAT_DTYPES, check_float_tensor, define_op, entry_point, fill_missing_kernel,
                                     register_autograd_fallback, register_cuda_kernel)

APPROXIMATIONS = ("none", "tanh")


def _accumulate_dtype(x, bias):
    return torch.float64 if torch.float64 in (x.dtype, bias.dtype) else torch.float32


def bias_gelu_reference(x, bias, approximate="none"):
    """Pure-PyTorch ``gelu(x + bias)`` in x's dtype (contiguous), formed in fp32 (fp64 if either is fp64)."""
    acc = _accumulate_dtype(x, bias)
    return F.gelu(x.to(acc) + bias.to(acc), approximate=approximate).to(x.dtype).contiguous()


def bias_gelu_bwd_reference(dy, x, bias, approximate="none"):
    """Pure-PyTorch ``(dx, dbias)``: dx = dy * gelu'(x + bias) in x's dtype (contiguous), dbias the
    sum of the unrounded dx over all rows, in bias's dtype; formed in fp32 (fp64 if either is fp64)."""
    acc = _accumulate_dtype(x, bias)
    g = torch.ops.aten.gelu_backward(dy.to(acc), x.to(acc) + bias.to(acc), approximate=approximate)
    n = x.shape[-1]
    dbias = g.reshape(-1, n).sum(0) if n > 0 else g.new_zeros(0)
    return g.to(x.dtype).contiguous(), dbias.to(bias.dtype)


def _check_args(dy, x, bias, approximate):
    """The checks of the C++ glue, in Python: x (..., N), bias (N,), dy like x; one device."""
    check_float_tensor(x, "x")
    check_float_tensor(bias, "bias")
    if not isinstance(approximate, str):
        raise TypeError(f"revkernels: approximate must be a str, got {type(approximate).__name__}")
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"revkernels: approximate must be 'none' or 'tanh', got {approximate!r}")
    if x.dim() < 1:
        raise ValueError("revkernels: x must have shape (..., N), got a 0-d tensor")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(f"revkernels: bias must have shape (N,) = ({x.shape[-1]},) for x of shape "
                         f"{tuple(x.shape)}, got {tuple(bias.shape)}")
    if bias.device != x.device:
        raise ValueError(f"revkernels: bias must be on the device of x ({x.device}), got {bias.device}")
    if dy is not None:
        check_float_tensor(dy, "dy")
        if dy.dtype != x.dtype:
            raise TypeError(f"revkernels: dy must have the dtype of x ({x.dtype}), got {dy.dtype}")
        if dy.shape != x.shape:
            raise ValueError(f"revkernels: dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
        if dy.device != x.device:
            raise ValueError(f"revkernels: dy must be on the device of x ({x.device}), got {dy.device}")


_bias_gelu = define_op("bias_gelu", '(Tensor x, Tensor bias, str approximate="none") -> Tensor')
_bias_gelu_bwd = define_op(
    "bias_gelu_bwd", '(Tensor dy, Tensor x, Tensor bias, str approximate="none") -> (Tensor dx, Tensor dbias)')


# Kernels registered in Python get the same argument checks as the C++ ones (a direct
# torch.ops.revkernels call bypasses the entry points below).
def _bias_gelu_checked_reference(x, bias, approximate="none"):
    _check_args(None, x, bias, approximate)
    return bias_gelu_reference(x, bias, approximate)


def _bias_gelu_bwd_checked_reference(dy, x, bias, approximate="none"):
    _check_args(dy, x, bias, approximate)
    return bias_gelu_bwd_reference(dy, x, bias, approximate)


fill_missing_kernel("bias_gelu", "CPU", _bias_gelu_checked_reference)
fill_missing_kernel("bias_gelu_bwd", "CPU", _bias_gelu_bwd_checked_reference)


def _bias_gelu_triton(x, bias, approximate="none"):
    from revkernels.triton.bias_gelu import bias_gelu as kernel

    _check_args(None, x, bias, approximate)
    return kernel(x, bias, approximate)


def _bias_gelu_bwd_triton(dy, x, bias, approximate="none"):
    from revkernels.triton.bias_gelu import bias_gelu_bwd as kernel

    _check_args(dy, x, bias, approximate)
    return kernel(dy, x, bias, approximate)


register_cuda_kernel("bias_gelu", _bias_gelu_triton)
register_cuda_kernel("bias_gelu_bwd", _bias_gelu_bwd_triton)


def _check_fake(dy, x, bias, approximate):
    # The C++ glue's checks, with the exception types it raises (ValueError / TypeError).
    for t, name in ((x, "x"), (bias, "bias")) + (() if dy is None else ((dy, "dy"),)):
        torch._check_type(t.dtype in FLOAT_DTYPES,
                          lambda: f"revkernels: {name} must be float32, float64, float16 or bfloat16, got {t.dtype}")
    torch._check_value(approximate in APPROXIMATIONS,
                       lambda: f"revkernels: approximate must be 'none' or 'tanh', got {approximate!r}")
    torch._check_value(x.dim() >= 1, lambda: "revkernels: x must have shape (..., N), got a 0-d tensor")
    torch._check_value(bias.dim() == 1 and bias.shape[0] == x.shape[-1],
                       lambda: f"revkernels: bias must have shape (N,) = ({x.shape[-1]},), got {tuple(bias.shape)}")
    torch._check_value(bias.device == x.device,
                       lambda: f"revkernels: bias must be on the device of x ({x.device}), got {bias.device}")
    if dy is not None:
        torch._check_type(dy.dtype == x.dtype,
                          lambda: f"revkernels: dy must have the dtype of x ({x.dtype}), got {dy.dtype}")
        torch._check_value(dy.shape == x.shape,
                           lambda: f"revkernels: dy must have the shape of x {tuple(x.shape)}, got {tuple(dy.shape)}")
        torch._check_value(dy.device == x.device,
                           lambda: f"revkernels: dy must be on the device of x ({x.device}), got {dy.device}")


@torch.library.register_fake("revkernels::bias_gelu")
def _bias_gelu_fake(x, bias, approximate="none"):
    _check_fake(None, x, bias, approximate)
    return x.new_empty(x.shape)  # contiguous


@torch.library.register_fake("revkernels::bias_gelu_bwd")
def _bias_gelu_bwd_fake(dy, x, bias, approximate="none"):
    _check_fake(dy, x, bias, approximate)
    return x.new_empty(x.shape), bias.new_empty(bias.shape[0])


def _setup_context(ctx, inputs, output):
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _bias_gelu_backward(ctx, grad):
    x, bias = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: the reference is differentiable (ATen's gelu_backward)
        dx, dbias = bias_gelu_bwd_reference(grad.to(x.dtype), x, bias, ctx.approximate)
    else:
        dx, dbias = torch.ops.revkernels.bias_gelu_bwd(grad.to(x.dtype), x, bias, ctx.approximate)
    return (dx if ctx.needs_input_grad[0] else None), (dbias if ctx.needs_input_grad[1] else None), None


register_autograd_fallback("bias_gelu", _bias_gelu_backward, _setup_context)


def _bias_gelu_checked(x, bias, approximate="none"):
    """``gelu(x + bias)`` in x's dtype, one pass (the MLP's fc1 epilogue); x (..., N), bias (N,)."""
    _check_args(None, x, bias, approximate)
    return _bias_gelu(x, bias, approximate)


def _bias_gelu_bwd_checked(dy, x, bias, approximate="none"):
    """``(dx, dbias)`` with dx = dy * gelu'(x + bias) in x's dtype and dbias = dx summed over all rows
    (in fp32) in bias's dtype, one pass over dy and x."""
    _check_args(dy, x, bias, approximate)
    return _bias_gelu_bwd(dy, x, bias, approximate)


bias_gelu = entry_point("bias_gelu", _bias_gelu_checked)
bias_gelu_bwd = entry_point("bias_gelu_bwd", _bias_gelu_bwd_checked)
