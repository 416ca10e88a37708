r"""Coupling ops: the elementwise steps of an additive coupling, one pass each.

Two-stream additive coupling (docs/design.md, "The math")::

    forward   y1 = x1 + F(x2)          inverse (rebuild)   x2 = y2 - G(y1)
              y2 = x2 + G(y1)                              x1 = y1 - F(x2)

    backward  dy1' = dy1 + (dG/dy1)^T dy2     (gradient add)
              dx2  = dy2 + (dF/dx2)^T dy1'
              dx1  = dy1'

Ops (``torch.ops.revkernels.*``)::

    coupling_sub(y, f) -> y - f     the rebuild x = y - F(.)
    coupling_add(a, b) -> a + b     the gradient add dx = dy + vjp

Both return a new tensor with the dtype and memory layout of the first argument. The second may
have another float dtype (a bf16 F output against an fp32 residual stream); the result is formed in
fp32 (fp64 when either input is fp64) and rounded once, so ``coupling_sub(y, f)`` inverts
``y = x + f`` to within one rounding of the stream dtype. Inputs may be non-contiguous or expanded.
Kernels: C++ on CPU (``csrc/cpu/vec_kernels.cpp``, semantics ``csrc/kernels/coupling.h``; calls larger
than the last-level cache write their output with streaming stores); on CUDA Triton (``revkernels/triton/coupling.py``,
above 2^24 elements under the default backend) or CUDA C++ (``csrc/kernels/coupling.cu``, below; see
``set_cuda_backend``); without a compiled CPU kernel, the reference below.

VJP (linear, so the backward needs nothing saved; ``csrc/ops/coupling_autograd.cpp``, or the
Python formula below without the compiled library)::

    coupling_sub:  d y = g,   d f = -g         coupling_add:  d a = g,   d b = g

(d f and d b in the second input's dtype).

Entry points: ``coupling_sub`` / ``coupling_add`` are the ops themselves when the compiled library
is loaded (C++ checks and autograd); without it, Python functions that check the arguments first.
"""
import torch

from revkernels.ops._library import (check_float_tensor, check_same_shape_and_device, define_op, entry_point,
                                     fill_missing_kernel, register_autograd_fallback, register_cuda_kernel)


def _accumulate_dtype(a, b):
    return torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32


def coupling_sub_reference(y, f):
    """Pure-PyTorch ``y - f`` in y's dtype, formed in fp32 (fp64 if either is fp64)."""
    acc = _accumulate_dtype(y, f)
    return (y.to(acc) - f.to(acc)).to(y.dtype)


def coupling_add_reference(a, b):
    """Pure-PyTorch ``a + b`` in a's dtype, formed in fp32 (fp64 if either is fp64)."""
    acc = _accumulate_dtype(a, b)
    return (a.to(acc) + b.to(acc)).to(a.dtype)


_coupling_sub = define_op("coupling_sub", "(Tensor y, Tensor f) -> Tensor")
_coupling_add = define_op("coupling_add", "(Tensor a, Tensor b) -> Tensor")


def _check_pair(a, a_name, b, b_name):
    check_float_tensor(a, a_name)
    check_float_tensor(b, b_name)
    check_same_shape_and_device(a, a_name, b, b_name)


def _checked_reference(reference, a_name, b_name):
    """The CPU kernel without the compiled library: the C++ kernels' checks, then `reference`,
    returned in the layout of torch.empty_like(first argument) as the kernels return it."""
    def op(a, b):
        _check_pair(a, a_name, b, b_name)
        out = torch.empty_like(a)
        out.copy_(reference(a, b))
        return out

    return op


fill_missing_kernel("coupling_sub", "CPU", _checked_reference(coupling_sub_reference, "y", "f"))
fill_missing_kernel("coupling_add", "CPU", _checked_reference(coupling_add_reference, "a", "b"))


def _coupling_sub_triton(y, f):
    from revkernels.triton.coupling import coupling_sub as kernel

    _check_pair(y, "y", f, "f")
    return kernel(y, f)


def _coupling_add_triton(a, b):
    from revkernels.triton.coupling import coupling_add as kernel

    _check_pair(a, "a", b, "b")
    return kernel(a, b)


register_cuda_kernel("coupling_sub", _coupling_sub_triton)
register_cuda_kernel("coupling_add", _coupling_add_triton)


# The fake (meta) kernels run the Python checks: a call mixing a meta tensor with a real one
# dispatches here and must fail as the device kernels would.
@torch.library.register_fake("revkernels::coupling_sub")
def _coupling_sub_fake(y, f):
    _check_pair(y, "y", f, "f")
    return torch.empty_like(y)


@torch.library.register_fake("revkernels::coupling_add")
def _coupling_add_fake(a, b):
    _check_pair(a, "a", b, "b")
    return torch.empty_like(a)


def _setup_context(ctx, inputs, output):
    ctx.second_dtype = inputs[1].dtype


def _coupling_sub_backward(ctx, grad):
    return grad, (-grad).to(ctx.second_dtype)


def _coupling_add_backward(ctx, grad):
    return grad, grad.to(ctx.second_dtype)


register_autograd_fallback("coupling_sub", _coupling_sub_backward, _setup_context)
register_autograd_fallback("coupling_add", _coupling_add_backward, _setup_context)


def _coupling_sub_checked(y, f):
    """``y - f`` in y's dtype, one pass (the coupling rebuild ``x = y - F(.)``)."""
    _check_pair(y, "y", f, "f")
    return _coupling_sub(y, f)


def _coupling_add_checked(a, b):
    """``a + b`` in a's dtype, one pass (the coupling gradient add ``dx = dy + vjp``)."""
    _check_pair(a, "a", b, "b")
    return _coupling_add(a, b)


coupling_sub = entry_point("coupling_sub", _coupling_sub_checked)
coupling_add = entry_point("coupling_add", _coupling_add_checked)
