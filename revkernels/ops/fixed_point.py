r"""Fixed-point coupling ops: the exact mode's streams (``ReversibleSequential(exact=True)``).

In exact mode the two streams between blocks are int64 tensors X holding x = X · 2^-b (b the
fraction bits, 32 by default). The branches F and G see the stream's float view; their output is
rounded to the grid and added as an integer, so the coupling is an exact integer addition and the
rebuild subtracts exactly what the forward added::

    q(f)     = round_half_even(f · 2^b)                (exact in f's float dtype; f = 0 where flagged)
    view(X)  = dtype(fp32(X) · 2^-b)                   (fp64(X) for a float64 view; fp32(X) and
                                                        fp64(X) are X correctly rounded)

    forward   Y1 = X1 + q(F(view(X2)))                 rebuild   X2 = Y2 - q(G(view(Y1)))
              Y2 = X2 + q(G(view(Y1)))                           X1 = Y1 - q(F(view(X2)))

so the rebuild returns the forward's inputs bit for bit whenever F and G recompute the same bits
from the same input (which the engines arrange: replayed randomness, the forward's autocast).

Overflow: every value kept has |X| < 2^62, so no sum of two of them wraps. An op flags its call
(the third output, a 0-dim bool tensor on the input's device) when a branch value has
``not |f · 2^b| < 2^62`` (too large, inf or NaN) or a result has |Y| >= 2^62; the run raises,
naming the block, before any wrapped value is used.

Ops (``torch.ops.revkernels.*``)::

    fixed_point_from_float(x, bits) -> (view(X), X, overflow)      X = q(x), view in x's dtype
    fixed_point_add(x, f, bits, dtype) -> (view(Y), Y, overflow)   Y = X + q(f)
    fixed_point_sub(y, f, bits, dtype) -> (view(X), X, overflow)   X = Y - q(f)
    fixed_point_view(x, bits, dtype) -> view(X)

VJP (straight-through: the gradient of the same network with each branch output rounded to the
grid, the rounding's derivative taken as 1; ``csrc/ops/fixed_point_autograd.cpp``, or the Python
formula below without the compiled library)::

    fixed_point_add / fixed_point_sub:  d f = ±(d view) in f's dtype     (d of the int stream: none)

The views' gradient to the previous stream's view is added by the exact-mode autograd engine
(`revkernels.nn.exact`), which holds both.

Kernels: C++ on CPU (``csrc/cpu/vec_kernels.cpp``: AVX-512 vectors, the scalar kernel elsewhere;
semantics ``csrc/kernels/fixed_point.h``); on CUDA Triton (``revkernels/triton/fixed_point.py``, above 2^24
elements under the default backend) or CUDA C++ (``csrc/kernels/fixed_point.cu``, below; see
``set_cuda_backend``); without a compiled CPU kernel, the references below. Inputs may be
non-contiguous or expanded; the outputs take the layout of torch.empty_like(first tensor argument).

Entry points: the ops themselves when the compiled library is loaded (C++ checks and autograd;
`bits` and `dtype` checked in Python first, as the schema parser would take ``bits=True`` for 1);
without it, Python functions that check the arguments first.
"""
import torch

from revkernels.ops._library import (check_float_dtype, check_float_tensor, check_same_shape_and_device, check_tensor,
                                     define_op, entry_point, fill_missing_kernel, register_autograd_fallback,
                                     register_cuda_kernel)

DEFAULT_BITS = 32  # (also the schemas' default: csrc/ops/fixed_point.cpp)
LIMIT = 2.0 ** 62  # |X| < LIMIT for every stored value: a sum of two never wraps


def check_bits(bits):
    """TypeError/ValueError naming `bits` unless it is an int in [1, 60]."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"revkernels: bits must be an int (fraction bits of the fixed-point streams), got "
                        f"{type(bits).__name__}")
    if not 1 <= bits <= 60:
        raise ValueError(f"revkernels: bits must be in [1, 60] (fraction bits of the int64 streams), got {bits}")


def _check_stream(x, name):
    check_tensor(x, name)
    if x.dtype != torch.int64:
        raise TypeError(f"revkernels: {name} must be an int64 fixed-point stream, got {x.dtype}")


def _check_coupling(x, x_name, f, bits, dtype):
    _check_stream(x, x_name)
    check_float_tensor(f, "f")
    check_bits(bits)
    check_float_dtype(dtype, "dtype")
    check_same_shape_and_device(x, x_name, f, "f")


def quantize_reference(f, bits):
    """``(q(f), bad)``: f · 2^b rounded half to even as int64, 0 where `bad` (not |f · 2^b| < 2^62)."""
    scaled = (f if f.dtype == torch.float64 else f.float()) * 2.0 ** bits  # a power of two: exact
    bad = ~(scaled.abs() < LIMIT)
    return torch.where(bad, 0, torch.round(scaled)).to(torch.int64), bad


def fixed_point_view_reference(x, bits, dtype):
    """view(X) = dtype(fp32(X) · 2^-b) (fp64 for a float64 view)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.to(wide) * 2.0 ** -bits).to(dtype)


def _flag(bad, out):
    # (compared as int64: against the float LIMIT, out would be rounded to fp32 first, flagging
    # values from 2^62 - 2^37 up; and abs() wraps at -2^63)
    limit = 1 << 62
    if not out.numel():
        return torch.zeros((), dtype=torch.bool, device=out.device)
    return (bad | (out >= limit) | (out <= -limit)).any()


def fixed_point_from_float_reference(x, bits):
    """``(view(q(x)) in x's dtype, q(x), overflow)``."""
    fixed, bad = quantize_reference(x, bits)
    return fixed_point_view_reference(fixed, bits, x.dtype), fixed, _flag(bad, fixed)


def fixed_point_add_reference(x, f, bits, dtype):
    """``(view(Y), Y, overflow)`` with Y = X + q(f)."""
    step, bad = quantize_reference(f, bits)
    out = x + step
    return fixed_point_view_reference(out, bits, dtype), out, _flag(bad, out)


def fixed_point_sub_reference(y, f, bits, dtype):
    """``(view(X), X, overflow)`` with X = Y - q(f)."""
    step, bad = quantize_reference(f, bits)
    out = y - step
    return fixed_point_view_reference(out, bits, dtype), out, _flag(bad, out)


_from_float = define_op("fixed_point_from_float", "(Tensor x, int bits=32) -> (Tensor, Tensor, Tensor)")
_add = define_op("fixed_point_add",
                 "(Tensor x, Tensor f, int bits=32, ScalarType dtype=float) -> (Tensor, Tensor, Tensor)")
_sub = define_op("fixed_point_sub",
                 "(Tensor y, Tensor f, int bits=32, ScalarType dtype=float) -> (Tensor, Tensor, Tensor)")
_view = define_op("fixed_point_view", "(Tensor x, int bits=32, ScalarType dtype=float) -> Tensor")


# The Python kernels (fallback, Triton, fake) run the Python checks first (the C++ kernels' checks,
# with the same messages) and declare the schemas' defaults.
def _check_from_float(x, bits):
    check_float_tensor(x, "x")
    check_bits(bits)


def _check_view(x, bits, dtype):
    _check_stream(x, "x")
    check_bits(bits)
    check_float_dtype(dtype, "dtype")


def _in_layout_of(first, outputs):
    """`outputs` (the reference's) copied into the layout of torch.empty_like(`first`), as the
    kernels return them (the flag as it is)."""
    view, stream, flag = outputs
    return torch.empty_like(first, dtype=view.dtype).copy_(view), torch.empty_like(first, dtype=torch.int64).copy_(
        stream), flag


def _from_float_checked(x, bits=DEFAULT_BITS):
    _check_from_float(x, bits)
    return _in_layout_of(x, fixed_point_from_float_reference(x, bits))


def _add_checked(x, f, bits=DEFAULT_BITS, dtype=torch.float32):
    _check_coupling(x, "x", f, bits, dtype)
    return _in_layout_of(x, fixed_point_add_reference(x, f, bits, dtype))


def _sub_checked(y, f, bits=DEFAULT_BITS, dtype=torch.float32):
    _check_coupling(y, "y", f, bits, dtype)
    return _in_layout_of(y, fixed_point_sub_reference(y, f, bits, dtype))


def _view_checked(x, bits=DEFAULT_BITS, dtype=torch.float32):
    _check_view(x, bits, dtype)
    return torch.empty_like(x, dtype=dtype).copy_(fixed_point_view_reference(x, bits, dtype))


for _name, _kernel in (("fixed_point_from_float", _from_float_checked), ("fixed_point_add", _add_checked),
                       ("fixed_point_sub", _sub_checked), ("fixed_point_view", _view_checked)):
    fill_missing_kernel(_name, "CPU", _kernel)


def _triton():
    from revkernels.triton import fixed_point

    return fixed_point


def _from_float_triton(x, bits=DEFAULT_BITS):
    _check_from_float(x, bits)
    kernel = _triton()
    return kernel.fixed_point(kernel.FROM_FLOAT, None, x, bits, x.dtype)


def _add_triton(x, f, bits=DEFAULT_BITS, dtype=torch.float32):
    _check_coupling(x, "x", f, bits, dtype)
    kernel = _triton()
    return kernel.fixed_point(kernel.ADD, x, f, bits, dtype)


def _sub_triton(y, f, bits=DEFAULT_BITS, dtype=torch.float32):
    _check_coupling(y, "y", f, bits, dtype)
    kernel = _triton()
    return kernel.fixed_point(kernel.SUB, y, f, bits, dtype)


def _view_triton(x, bits=DEFAULT_BITS, dtype=torch.float32):
    _check_view(x, bits, dtype)
    kernel = _triton()
    return kernel.fixed_point(kernel.VIEW, x, None, bits, dtype)[0]


register_cuda_kernel("fixed_point_from_float", _from_float_triton)
register_cuda_kernel("fixed_point_add", _add_triton)
register_cuda_kernel("fixed_point_sub", _sub_triton)
register_cuda_kernel("fixed_point_view", _view_triton)


# The fake (meta) kernels run the Python checks: a call mixing a meta tensor with a real one
# dispatches here and must fail as the device kernels would.
@torch.library.register_fake("revkernels::fixed_point_from_float")
def _from_float_fake(x, bits=DEFAULT_BITS):
    _check_from_float(x, bits)
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.int64), x.new_empty((), dtype=torch.bool)


def _coupling_fake(x_name):
    def fake(x, f, bits=DEFAULT_BITS, dtype=torch.float32):
        _check_coupling(x, x_name, f, bits, dtype)
        return torch.empty_like(x, dtype=dtype), torch.empty_like(x), x.new_empty((), dtype=torch.bool)

    return fake


torch.library.register_fake("revkernels::fixed_point_add", _coupling_fake("x"))
torch.library.register_fake("revkernels::fixed_point_sub", _coupling_fake("y"))


@torch.library.register_fake("revkernels::fixed_point_view")
def _view_fake(x, bits=DEFAULT_BITS, dtype=torch.float32):
    _check_view(x, bits, dtype)
    return torch.empty_like(x, dtype=dtype)


def _setup_context(ctx, inputs, output):
    ctx.f_dtype = inputs[1].dtype


def _add_backward(ctx, d_view, d_out, d_overflow):
    return None, None if d_view is None else d_view.to(ctx.f_dtype), None, None


def _sub_backward(ctx, d_view, d_out, d_overflow):
    return None, None if d_view is None else (-d_view).to(ctx.f_dtype), None, None


register_autograd_fallback("fixed_point_add", _add_backward, _setup_context)
register_autograd_fallback("fixed_point_sub", _sub_backward, _setup_context)


def _check_scalars(bits=DEFAULT_BITS, dtype=torch.float32):
    check_bits(bits)
    check_float_dtype(dtype, "dtype")


def fixed_point_from_float(x, bits=DEFAULT_BITS):
    """``(view(X), X, overflow)``: `x` (float) on the grid 2^-bits as an int64 stream X with its
    float view in x's dtype, and whether a value did not fit (a 0-dim bool tensor). (The view comes
    first in every op's outputs: the float output leads, as torch's op checks sum the outputs.)"""
    _check_from_float(x, bits)
    return _from_float(x, bits)


def fixed_point_add(x, f, bits=DEFAULT_BITS, dtype=torch.float32):
    """``(view(Y), Y, overflow)``: the int64 stream `x` plus the branch output `f` rounded to the
    grid (Y = X + q(f)) with its float view in `dtype`, and whether a value did not fit."""
    _check_coupling(x, "x", f, bits, dtype)
    return _add(x, f, bits, dtype)


def fixed_point_sub(y, f, bits=DEFAULT_BITS, dtype=torch.float32):
    """``(view(X), X, overflow)``: the rebuild X = Y - q(f) of `fixed_point_add`, exact."""
    _check_coupling(y, "y", f, bits, dtype)
    return _sub(y, f, bits, dtype)


def fixed_point_view(x, bits=DEFAULT_BITS, dtype=torch.float32):
    """The float view dtype(fp32(X) · 2^-bits) of the int64 stream `x`."""
    _check_view(x, bits, dtype)
    return _view(x, bits, dtype)


# With the compiled library, the entry points are the ops (after the Python checks of bits and
# dtype); without it, the functions above.
fixed_point_from_float = entry_point("fixed_point_from_float", fixed_point_from_float,
                                     lambda x, bits=DEFAULT_BITS: check_bits(bits))
fixed_point_add = entry_point("fixed_point_add", fixed_point_add, lambda x, f, *a, **k: _check_scalars(*a, **k))
fixed_point_sub = entry_point("fixed_point_sub", fixed_point_sub, lambda y, f, *a, **k: _check_scalars(*a, **k))
fixed_point_view = entry_point("fixed_point_view", fixed_point_view, lambda x, *a, **k: _check_scalars(*a, **k))
