"""Triton kernels of the bias + GELU ops (math: revkernels/ops/bias_gelu.py).

x (..., N) is handled as a (rows, N) matrix with unit column stride and one row stride: a view of
x where one exists (contiguous, or rows sliced out of a wider buffer), else a contiguous copy.
Programs tile (rows, N) in 2-D, BLOCK_M x BLOCK_N; outputs are contiguous.

Tile shapes were tuned by benchmarks/sweep_triton_configs.py (bf16, widths 768/1024/3072/4096;
kernel launches timed with do_bench), 4 warps throughout (8 were slower): forward 4096-element
tiles up to 256 columns wide; backward 4096-element tiles up to 128 columns wide (256 was slower),
at most 256 row programs.

- forward: out = gelu(x + bias), one tile per program.
- backward: dx = dy * gelu'(x + bias), and dbias in two passes: program (m, n) walks its own range
  of rows (rows_per_program, a multiple of BLOCK_M) for its columns, writing dx and adding its
  tiles (fp32, before rounding) into a tile-shaped accumulator, whose column sums it stores in
  row m of a partial-sum buffer (one reduction over rows per program, not per tile); a
  second kernel sums the partial rows in order. The split depends only on the shape, so dbias
  is reproducible.

Math in fp32 (fp64 when x or bias is fp64). erf is tl.math.erf (the interpreter supports it);
the tanh form is written with exp: (1 + tanh u) / 2 = sigmoid(2u), evaluated as 1 / (1 + e) or
e / (1 + e) with e = exp(-2|u|) <= 1, which neither overflows nor cancels.
"""
import torch
import triton
import triton.language as tl

FWD_TILE = 4096  # elements per program tile of the forward
FWD_MAX_BLOCK_N = 256  # widest forward tile (columns)
BWD_TILE = 4096  # elements per program tile of the backward (one step of its row loop)
BWD_MAX_BLOCK_N = 128  # widest backward tile (columns)
NUM_WARPS = 4  # forward and backward tiles (8 were slower)
MAX_ROW_PROGRAMS = 256  # bounds the dbias partial buffer: MAX_ROW_PROGRAMS x N
REDUCE_BLOCK = 256

# Constants are written as Python float literals: Triton materialises a scalar operand in the
# tensor's dtype, so they keep full precision in the fp64 kernels too.
#   0.7071067811865476 = 1 / sqrt(2)    0.3989422804014327 = 1 / sqrt(2 pi)
#   0.7978845608028654 = sqrt(2 / pi)   0.044715, 0.134145 = 3 * 0.044715 (the tanh form)


@triton.jit
def _sigmoid_pair(u):
    # (sigmoid(2u), sigmoid(-2u)) without overflow or cancellation.
    e = tl.exp(-2.0 * tl.abs(u))
    big = 1.0 / (1.0 + e)
    small = e * big
    return tl.where(u < 0, small, big), tl.where(u < 0, big, small)


@triton.jit
def _gelu(z, TANH: tl.constexpr):
    if TANH:
        plus, minus = _sigmoid_pair(0.7978845608028654 * (z + 0.044715 * z * z * z))
        result = z * plus
    else:
        result = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    return result


@triton.jit
def _gelu_derivative(z, TANH: tl.constexpr):
    z2 = z * z
    if TANH:
        plus, minus = _sigmoid_pair(0.7978845608028654 * (z + 0.044715 * z2 * z))
        result = plus + 2.0 * z * plus * minus * (0.7978845608028654 * (1.0 + 0.134145 * z2))
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        result = cdf + z * (0.3989422804014327 * tl.exp(-0.5 * z2))
    return result


@triton.jit
def _bias_gelu_kernel(out_ptr, x_ptr, bias_ptr, rows, n, x_row_stride, TANH: tl.constexpr, ACC_FP64: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    r = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    c = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = c < n
    mask = (r < rows)[:, None] & c_mask[None, :]
    b = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(acc_type)
    x = tl.load(x_ptr + r[:, None] * x_row_stride + c[None, :], mask=mask, other=0.0).to(acc_type)
    y = _gelu(x + b[None, :], TANH)
    tl.store(out_ptr + r[:, None] * n + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(dx_ptr, partial_ptr, dy_ptr, x_ptr, bias_ptr, rows, n, dy_row_stride, x_row_stride,
                          rows_per_program, TANH: tl.constexpr, ACC_FP64: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    pid_m = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_mask = c < n
    b = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(acc_type)
    # Tile-shaped accumulator, reduced over rows once at the end: a cross-warp reduction per
    # iteration would cost more than the loads it overlaps.
    column_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=acc_type)
    for start in range(0, rows_per_program, BLOCK_M):
        r = pid_m * rows_per_program + start + tl.arange(0, BLOCK_M)
        mask = (r < rows)[:, None] & c_mask[None, :]
        x = tl.load(x_ptr + r[:, None] * x_row_stride + c[None, :], mask=mask, other=0.0).to(acc_type)
        dy = tl.load(dy_ptr + r[:, None] * dy_row_stride + c[None, :], mask=mask, other=0.0).to(acc_type)
        g = dy * _gelu_derivative(x + b[None, :], TANH)
        tl.store(dx_ptr + r[:, None] * n + c[None, :], g.to(dx_ptr.dtype.element_ty), mask=mask)
        column_acc += tl.where(mask, g, 0.0)
    tl.store(partial_ptr + pid_m * n + c, tl.sum(column_acc, axis=0), mask=c_mask)


@triton.jit
def _reduce_partials_kernel(dbias_ptr, partial_ptr, chunks, n, ACC_FP64: tl.constexpr, BLOCK: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c_mask = c < n
    total = tl.zeros([BLOCK], dtype=acc_type)
    for k in range(0, chunks):
        total += tl.load(partial_ptr + k * n + c, mask=c_mask, other=0.0)
    tl.store(dbias_ptr + c, total.to(dbias_ptr.dtype.element_ty), mask=c_mask)


def _rows_view(t, n):
    """t as (rows, n) with unit column stride: a view where one exists, else a contiguous copy."""
    rows = t.reshape(-1, n)
    if n > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def _blocks(rows, n, tile, max_block_n):
    """(BLOCK_M, BLOCK_N): up to max_block_n columns, then rows to fill tile elements (no more than exist)."""
    block_n = min(max_block_n, max(16, triton.next_power_of_2(n)))
    block_m = max(1, min(tile // block_n, triton.next_power_of_2(rows)))
    return block_m, block_n


def _fwd_blocks(rows, n):
    return _blocks(rows, n, FWD_TILE, FWD_MAX_BLOCK_N)


def _bwd_blocks(rows, n):
    return _blocks(rows, n, BWD_TILE, BWD_MAX_BLOCK_N)


def _is_tanh(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"revkernels: approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate == "tanh"


def bias_gelu(x, bias, approximate="none"):
    """gelu(x + bias) in x's dtype (contiguous), x (..., N), bias (N,). Arguments are assumed checked."""
    tanh = _is_tanh(approximate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    n = x.shape[-1]
    x2 = _rows_view(x, n)
    rows = x2.shape[0]
    bias = bias.contiguous()
    block_m, block_n = _fwd_blocks(rows, n)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
    _bias_gelu_kernel[grid](out, x2, bias, rows, n, x2.stride(0), TANH=tanh,
                            ACC_FP64=torch.float64 in (x.dtype, bias.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
                            num_warps=NUM_WARPS)
    return out


def bias_gelu_bwd(dy, x, bias, approximate="none"):
    """(dx, dbias): dx = dy * gelu'(x + bias) in x's dtype (contiguous), dbias = column sums of dx
    (accumulated in fp32, fp64 for fp64) in bias's dtype. Arguments are assumed checked."""
    tanh = _is_tanh(approximate)
    n = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n == 0:
        return dx, torch.empty(0, dtype=bias.dtype, device=bias.device)
    rows = x.numel() // n
    if rows == 0:
        return dx, torch.zeros(n, dtype=bias.dtype, device=bias.device)
    x2, dy2 = _rows_view(x, n), _rows_view(dy, n)
    bias = bias.contiguous()
    acc_fp64 = torch.float64 in (x.dtype, bias.dtype)
    block_m, block_n = _bwd_blocks(rows, n)
    # Row programs: enough for parallelism, at most MAX_ROW_PROGRAMS partial rows.
    chunks = min(triton.cdiv(rows, block_m), MAX_ROW_PROGRAMS)
    rows_per_program = triton.cdiv(triton.cdiv(rows, chunks), block_m) * block_m
    chunks = triton.cdiv(rows, rows_per_program)
    partials = torch.empty((chunks, n), dtype=torch.float64 if acc_fp64 else torch.float32, device=x.device)
    _bias_gelu_bwd_kernel[(chunks, triton.cdiv(n, block_n))](
        dx, partials, dy2, x2, bias, rows, n, dy2.stride(0), x2.stride(0), rows_per_program,
        TANH=tanh, ACC_FP64=acc_fp64, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=NUM_WARPS)
    dbias = torch.empty(n, dtype=bias.dtype, device=bias.device)
    _reduce_partials_kernel[(triton.cdiv(n, REDUCE_BLOCK),)](dbias, partials, chunks, n, ACC_FP64=acc_fp64,
                                                             BLOCK=REDUCE_BLOCK)
    return dx, dbias
