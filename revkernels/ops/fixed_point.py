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
grid, the rounding's derivative taken as 1)::

    fixed_point_add / fixed_point_sub:  d f = ±(d view) in f's dtype     (d of the int stream: none)

The views' gradient to the previous stream's view is added by the exact-mode autograd engine
(`revkernels.engine.exact`), which holds both.
"""
import torch

from revkernels.ops._library import FLOAT_DTYPES, check_float_tensor, define_op, fill_missing_kernel

DEFAULT_BITS = 32
LIMIT = 2.0 ** 62  # |X| < LIMIT for every stored value: a sum of two never wraps


def check_bits(bits):
    """TypeError/ValueError naming `bits` unless it is an int in [1, 60]."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"revkernels: bits must be an int (fraction bits of the fixed-point streams), got "
                        f"{type(bits).__name__}")
    if not 1 <= bits <= 60:
        raise ValueError(f"revkernels: bits must be in [1, 60] (fraction bits of the int64 streams), got {bits}")


def _check_stream(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"revkernels: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int64:
        raise TypeError(f"revkernels: {name} must be an int64 fixed-point stream, got {x.dtype}")


def _check_view_dtype(dtype):
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"revkernels: dtype must be float32, float64, float16 or bfloat16, got {dtype}")


def _check_coupling(x, x_name, f, bits, dtype):
    _check_stream(x, x_name)
    check_float_tensor(f, "f")
    check_bits(bits)
    _check_view_dtype(dtype)
    if f.shape != x.shape:
        raise ValueError(f"revkernels: f must have the shape of {x_name} {tuple(x.shape)}, got {tuple(f.shape)}")
    if f.device != x.device:
        raise ValueError(f"revkernels: f must be on the device of {x_name} ({x.device}), got {f.device}")


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
    return (bad | (out.abs() >= LIMIT)).any() if out.numel() else torch.zeros((), dtype=torch.bool, device=out.device)


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


_from_float = define_op("fixed_point_from_float", "(Tensor x, int bits) -> (Tensor, Tensor, Tensor)")
_add = define_op("fixed_point_add", "(Tensor x, Tensor f, int bits, ScalarType dtype) -> (Tensor, Tensor, Tensor)")
_sub = define_op("fixed_point_sub", "(Tensor y, Tensor f, int bits, ScalarType dtype) -> (Tensor, Tensor, Tensor)")
_view = define_op("fixed_point_view", "(Tensor x, int bits, ScalarType dtype) -> Tensor")


def _from_float_checked(x, bits):
    check_float_tensor(x, "x")
    check_bits(bits)
    return fixed_point_from_float_reference(x, bits)


def _add_checked(x, f, bits, dtype):
    _check_coupling(x, "x", f, bits, dtype)
    return fixed_point_add_reference(x, f, bits, dtype)


def _sub_checked(y, f, bits, dtype):
    _check_coupling(y, "y", f, bits, dtype)
    return fixed_point_sub_reference(y, f, bits, dtype)


def _view_checked(x, bits, dtype):
    _check_stream(x, "x")
    check_bits(bits)
    _check_view_dtype(dtype)
    return fixed_point_view_reference(x, bits, dtype)


for _name, _kernel in (("fixed_point_from_float", _from_float_checked), ("fixed_point_add", _add_checked),
                       ("fixed_point_sub", _sub_checked), ("fixed_point_view", _view_checked)):
    fill_missing_kernel(_name, "CPU", _kernel)
    fill_missing_kernel(_name, "CUDA", _kernel)


@torch.library.register_fake("revkernels::fixed_point_from_float")
def _from_float_fake(x, bits):
    check_float_tensor(x, "x")
    check_bits(bits)
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.int64), x.new_empty((), dtype=torch.bool)


def _coupling_fake(x_name):
    def fake(x, f, bits, dtype):
        _check_coupling(x, x_name, f, bits, dtype)
        return torch.empty_like(x, dtype=dtype), torch.empty_like(x), x.new_empty((), dtype=torch.bool)

    return fake


torch.library.register_fake("revkernels::fixed_point_add", _coupling_fake("x"))
torch.library.register_fake("revkernels::fixed_point_sub", _coupling_fake("y"))


@torch.library.register_fake("revkernels::fixed_point_view")
def _view_fake(x, bits, dtype):
    _check_stream(x, "x")
    check_bits(bits)
    _check_view_dtype(dtype)
    return torch.empty_like(x, dtype=dtype)


def _setup_context(ctx, inputs, output):
    ctx.f_dtype = inputs[1].dtype


def _add_backward(ctx, d_view, d_out, d_overflow):
    return None, None if d_view is None else d_view.to(ctx.f_dtype), None, None


def _sub_backward(ctx, d_view, d_out, d_overflow):
    return None, None if d_view is None else (-d_view).to(ctx.f_dtype), None, None


torch.library.register_autograd("revkernels::fixed_point_add", _add_backward, setup_context=_setup_context)
torch.library.register_autograd("revkernels::fixed_point_sub", _sub_backward, setup_context=_setup_context)


def fixed_point_from_float(x, bits=DEFAULT_BITS):
    """``(view(X), X, overflow)``: `x` (float) on the grid 2^-bits as an int64 stream X with its
    float view in x's dtype, and whether a value did not fit (a 0-dim bool tensor). (The view comes
    first in every op's outputs: the float output leads, as torch's op checks sum the outputs.)"""
    return _from_float(x, bits)


def fixed_point_add(x, f, bits=DEFAULT_BITS, dtype=torch.float32):
    """``(view(Y), Y, overflow)``: the int64 stream `x` plus the branch output `f` rounded to the
    grid (Y = X + q(f)) with its float view in `dtype`, and whether a value did not fit."""
    return _add(x, f, bits, dtype)


def fixed_point_sub(y, f, bits=DEFAULT_BITS, dtype=torch.float32):
    """``(view(X), X, overflow)``: the rebuild X = Y - q(f) of `fixed_point_add`, exact."""
    return _sub(y, f, bits, dtype)


def fixed_point_view(x, bits=DEFAULT_BITS, dtype=torch.float32):
    """The float view dtype(fp32(X) · 2^-bits) of the int64 stream `x`."""
    return _view(x, bits, dtype)
