"""Triton kernel of the coupling ops: out = a + alpha * b in a's dtype (see revkernels/ops/coupling.py).

One pass over dense data: `out` takes a's layout (torch.empty_like) and the kernel walks the
storage linearly, so it needs `a` and `b` dense with out's strides; an input laid out otherwise
is first copied into out's layout (one extra pass, only for unusual layouts).
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _coupling_axpy_kernel(out_ptr, a_ptr, b_ptr, alpha, numel, ACC_FP64: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    a = tl.load(a_ptr + offsets, mask=mask).to(acc_type)
    b = tl.load(b_ptr + offsets, mask=mask).to(acc_type)
    tl.store(out_ptr + offsets, (a + alpha * b).to(out_ptr.dtype.element_ty), mask=mask)


def coupling_axpy(a, b, alpha):
    """a + alpha * b in a's dtype, formed in fp32 (fp64 if either input is fp64), one pass."""
    out = torch.empty_like(a)  # dense; a's strides exactly when a is dense
    if out.numel() == 0:
        return out
    if a.stride() != out.stride():
        a = torch.empty_like(out).copy_(a)
    if b.stride() != out.stride():
        b = torch.empty_like(out, dtype=b.dtype).copy_(b)
    acc_fp64 = torch.float64 in (a.dtype, b.dtype)
    grid = (triton.cdiv(out.numel(), BLOCK),)
    _coupling_axpy_kernel[grid](out, a, b, float(alpha), out.numel(), ACC_FP64=acc_fp64, BLOCK=BLOCK)
    return out


def coupling_sub(y, f):
    return coupling_axpy(y, f, -1.0)


def coupling_add(a, b):
    return coupling_axpy(a, b, 1.0)
