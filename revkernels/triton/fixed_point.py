"""Triton kernel of the fixed-point ops (semantics: revkernels/ops/fixed_point.py), one pass:

    q(f) = round_half_even(f * 2^b) as int64 (0 where not |f * 2^b| < 2^62: flagged)
    from_float X = q(f)     add Y = X + q(f)     sub X = Y - q(f)     view(X) = dtype(fp32(X) * 2^-b)

with fp64 in place of fp32 for fp64 data (f) and a float64 view. The round half to even is formed
from a truncating conversion and the exact remainder (no libdevice call: the same code runs under
the Triton interpreter). The outputs take the first tensor argument's layout (torch.empty_like) and
the kernel walks the storage linearly, so an input laid out otherwise is first copied into that
layout (one extra pass, only for unusual layouts). A program that met an overflow stores True to
the 0-dim flag (every such store writes the same value).
"""
import torch
import triton
import triton.language as tl

BLOCK = 2048
FROM_FLOAT, ADD, SUB, VIEW = 0, 1, 2, 3


@triton.jit
def _round_half_even(scaled):
    """round_half_even(scaled) as int64, for |scaled| < 2^62."""
    t = scaled.to(tl.int64)  # toward zero; t is a value of scaled's dtype (exact either way)
    rest = scaled - t.to(scaled.dtype)  # exact, in (-1, 1), the sign of scaled
    size = tl.abs(rest)
    up = (size > 0.5) | ((size == 0.5) & ((t & 1) != 0))
    return tl.where(up, tl.where(rest < 0, t - 1, t + 1), t)


@triton.jit
def _fixed_point_kernel(out_ptr, view_ptr, x_ptr, f_ptr, flag_ptr, up, down, numel, OP: tl.constexpr,
                        F_FP64: tl.constexpr, VIEW_FP64: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    if OP == 3:  # VIEW
        r = tl.load(x_ptr + offsets, mask=mask, other=0)
    else:
        scaled = tl.load(f_ptr + offsets, mask=mask, other=0.0).to(tl.float64 if F_FP64 else tl.float32) * up
        fits = tl.abs(scaled) < 4611686018427387904.0  # 2^62; false for NaN
        r = _round_half_even(tl.where(fits, scaled, 0.0))
        if OP == 1:  # ADD
            r = tl.load(x_ptr + offsets, mask=mask, other=0) + r
        elif OP == 2:  # SUB
            r = tl.load(x_ptr + offsets, mask=mask, other=0) - r
        bad = ((fits == 0) | (r >= 4611686018427387904) | (r <= -4611686018427387904)) & mask
        tl.store(out_ptr + offsets, r, mask=mask)
        any_bad = tl.max(bad.to(tl.int32), axis=0) > 0
        tl.store(flag_ptr, any_bad, mask=any_bad)
    view = r.to(tl.float64 if VIEW_FP64 else tl.float32) * down
    tl.store(view_ptr + offsets, view.to(view_ptr.dtype.element_ty), mask=mask)


def fixed_point(op, x, f, bits, dtype):
    """``(view, stream, overflow)`` of `op` (FROM_FLOAT: x unused, the view in f's dtype; VIEW: f
    unused, stream and overflow None) on checked arguments."""
    first = f if op == FROM_FLOAT else x
    view = torch.empty_like(first, dtype=f.dtype if op == FROM_FLOAT else dtype)  # dense
    out = None if op == VIEW else torch.empty_like(first, dtype=torch.int64)
    flag = None if op == VIEW else torch.zeros((), dtype=torch.bool, device=first.device)
    if view.numel() == 0:
        return view, out, flag
    if x is not None and x.stride() != view.stride():
        x = torch.empty_like(view, dtype=x.dtype).copy_(x)
    if f is not None and f.stride() != view.stride():
        f = torch.empty_like(view, dtype=f.dtype).copy_(f)
    grid = (triton.cdiv(view.numel(), BLOCK),)
    # (a tensor argument must be one; the unused ones get the view, never read)
    _fixed_point_kernel[grid](view if out is None else out, view, view if x is None else x, view if f is None else f,
                              view if flag is None else flag, float(2.0 ** bits), float(2.0 ** -bits), view.numel(),
                              OP=op, F_FP64=f is not None and f.dtype == torch.float64,
                              VIEW_FP64=view.dtype == torch.float64, BLOCK=BLOCK)
    return view, out, flag
