"""Triton kernels of the LayerNorm ops with the coupling fused in (math: revkernels/ops/layer_norm.py).

Rows are the leading dims flattened; the last dim (width N) is normalised. Every input is read as
a (rows, N) view with unit stride along N and any row stride (0 for a broadcast row); a tensor
without such a view (a transposed last dim, leading dims that do not merge) is copied with
.contiguous() first. Outputs are contiguous.

sub_layer_norm: one program per row. Up to MAX_FUSED_N the whole row (BLOCK_N = next power of 2
of N) stays in registers: y and g are read once; x, ln, mean and rstd written once; the statistics
and ln come from x rounded to its dtype, so ln is the LayerNorm of the stored x. Wider rows take a
chunked kernel: one pass for the statistics (per-chunk mean and M2, merged as in Chan et al.) and
one to write x and ln, each forming x from y and g again (a program does not read back what it
stored: Triton does not order a store before a later load of another thread).

layer_norm_bwd_add: a grid of programs over blocks of rows (4 per SM up to BLOCK_N 2048, else 2).
Each keeps the fp32 (fp64) partial sums of dweight and dbias over its rows in registers and stores
them to a (programs, N) buffer, which a second kernel sums over programs in a fixed order
(deterministic; no atomics or locks).
Rows wider than MAX_FUSED_N_BWD (4096: the fused kernel spills registers at BLOCK_N 8192): a first
kernel writes each row's mean(dxhat) and mean(dxhat * xhat), then a 2-D grid (row blocks x column
chunks) writes dx and the partial sums chunk by chunk.

Block sizes, warps and programs were tuned by benchmarks/sweep_triton_configs.py (bf16, widths
768/1024/3072/4096; kernel launches timed with do_bench): the forward takes 4 warps up to width
1024 and 16 at 4096; the backward 8 warps (fewer for blocks under 1024) and 4 programs per SM up to
BLOCK_N 2048, else 2.
"""

import torch
import triton
import triton.language as tl

from revkernels.triton._device import sm_count
from revkernels.triton._stats import stats_pivot

MAX_FUSED_N = 8192  # widest row kept whole in registers by the forward
MAX_FUSED_N_BWD = 4096  # widest row kept whole by the backward (BLOCK_N 8192 spills registers)
CHUNK_N = 2048  # chunk width of the kernels for wider rows
PARTIAL_BLOCK_P = 16  # partial rows summed per step of the reduction
PARTIAL_BLOCK_N = 256  # columns per program of the reduction


@triton.jit
def _sub_layer_norm_fwd_kernel(x_ptr, ln_ptr, mean_ptr, rstd_ptr, y_ptr, y_row_stride, g_ptr, g_row_stride,
                               w_ptr, b_ptr, eps, n, ACC_FP64: tl.constexpr, BLOCK_N: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    y = tl.load(y_ptr + row * y_row_stride + cols, mask=mask, other=0.0).to(acc_type)
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(acc_type)
    x = (y - g).to(x_ptr.dtype.element_ty)  # rounded once; everything below uses this x
    tl.store(x_ptr + row * n + cols, x, mask=mask)
    x = x.to(acc_type)
    # The mean sums x - x[0] (x[0] if finite, else 0): a constant row's is exact (a sum of the values
    # rounds, and the rounding, over sqrt(eps), was ln: 5e-3 off)
    pivot = stats_pivot(tl.sum(tl.where(cols == 0, x, 0.0), axis=0))
    mean = pivot + tl.sum(tl.where(mask, x - pivot, 0.0), axis=0) / n
    diff = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(acc_type)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(acc_type)
    tl.store(ln_ptr + row * n + cols, (diff * rstd * w + b).to(ln_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _sub_layer_norm_fwd_chunked_kernel(x_ptr, ln_ptr, mean_ptr, rstd_ptr, y_ptr, y_row_stride, g_ptr, g_row_stride,
                                       w_ptr, b_ptr, eps, n, ACC_FP64: tl.constexpr, BLOCK_N: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    row = tl.program_id(0).to(tl.int64)
    y_row = y_ptr + row * y_row_stride
    g_row = g_ptr + row * g_row_stride
    # Pass 1: count, mean and M2 (sum of squared deviations) of x - x[0], merged chunk by chunk
    # (shifted by the row's first value if finite: a constant row's mean is exact, and each chunk's
    # mean is formed from small values). The mean written is the plain sum's: the merged mean
    # subtracts means, which is NaN after an infinite value (the sum's is +-inf, as the reference's).
    first = (tl.load(y_row).to(acc_type) - tl.load(g_row).to(acc_type)).to(x_ptr.dtype.element_ty).to(acc_type)
    pivot = stats_pivot(first)
    count = tl.zeros((), dtype=acc_type)
    mean = tl.zeros((), dtype=acc_type)
    m2 = tl.zeros((), dtype=acc_type)
    total_sum = tl.zeros((), dtype=acc_type)
    for start in range(0, n, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(acc_type)
        g = tl.load(g_row + cols, mask=mask, other=0.0).to(acc_type)
        x = (y - g).to(x_ptr.dtype.element_ty).to(acc_type) - pivot
        chunk_count = tl.sum(mask.to(acc_type), axis=0)
        chunk_sum = tl.sum(tl.where(mask, x, 0.0), axis=0)
        total_sum += chunk_sum
        chunk_mean = chunk_sum / chunk_count
        diff = tl.where(mask, x - chunk_mean, 0.0)
        total = count + chunk_count
        delta = chunk_mean - mean
        mean += delta * (chunk_count / total)
        m2 += tl.sum(diff * diff, axis=0) + delta * delta * (count * chunk_count / total)
        count = total
    mean = pivot + total_sum / n
    rstd = 1.0 / tl.sqrt(m2 / n + eps)
    # Pass 2: x and ln.
    for start in range(0, n, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(acc_type)
        g = tl.load(g_row + cols, mask=mask, other=0.0).to(acc_type)
        x = (y - g).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * n + cols, x, mask=mask)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(acc_type)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(acc_type)
        ln = (x.to(acc_type) - mean) * rstd * w + b
        tl.store(ln_ptr + row * n + cols, ln.to(ln_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _row_xhat(x_ptr, x_row_stride, dln_ptr, dln_row_stride, mean_ptr, rstd_ptr, row, cols, mask,
              ACC_FP64: tl.constexpr):
    """(xhat, dln, rstd) of one row's columns `cols` for the backward kernels (0 where masked)."""
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(acc_type)
    d = tl.load(dln_ptr + row * dln_row_stride + cols, mask=mask, other=0.0).to(acc_type)
    mean = tl.load(mean_ptr + row).to(acc_type)
    rstd = tl.load(rstd_ptr + row).to(acc_type)
    return tl.where(mask, (x - mean) * rstd, 0.0), d, rstd


@triton.jit
def _layer_norm_bwd_add_kernel(dx_ptr, dw_partial_ptr, db_partial_ptr, dln_ptr, dln_row_stride, x_ptr, x_row_stride,
                               w_ptr, mean_ptr, rstd_ptr, dres_ptr, dres_row_stride, n, rows, rows_per_program,
                               ACC_FP64: tl.constexpr, BLOCK_N: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(acc_type)
    dw = tl.zeros((BLOCK_N,), dtype=acc_type)
    db = tl.zeros((BLOCK_N,), dtype=acc_type)
    row_begin = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, rows)
    for row in range(row_begin, row_end):
        xhat, d, rstd = _row_xhat(x_ptr, x_row_stride, dln_ptr, dln_row_stride, mean_ptr, rstd_ptr, row, cols, mask,
                                  ACC_FP64)
        dxhat = d * w
        mean_dxhat = tl.sum(dxhat, axis=0) / n
        mean_dxhat_xhat = tl.sum(dxhat * xhat, axis=0) / n
        res = tl.load(dres_ptr + row * dres_row_stride + cols, mask=mask, other=0.0).to(acc_type)
        dx = res + rstd * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)
        tl.store(dx_ptr + row * n + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += d * xhat
        db += d
    tl.store(dw_partial_ptr + pid * n + cols, dw, mask=mask)
    tl.store(db_partial_ptr + pid * n + cols, db, mask=mask)


@triton.jit
def _layer_norm_bwd_row_stats_kernel(stats_ptr, dln_ptr, dln_row_stride, x_ptr, x_row_stride, w_ptr, mean_ptr,
                                     rstd_ptr, n, ACC_FP64: tl.constexpr, BLOCK_N: tl.constexpr):
    # stats[row] = (mean(dxhat), mean(dxhat * xhat)) for rows wider than one block.
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    row = tl.program_id(0).to(tl.int64)
    mean = tl.load(mean_ptr + row).to(acc_type)
    rstd = tl.load(rstd_ptr + row).to(acc_type)
    sum_dxhat = tl.zeros((BLOCK_N,), dtype=acc_type)
    sum_dxhat_xhat = tl.zeros((BLOCK_N,), dtype=acc_type)
    for start in range(0, n, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(acc_type)
        d = tl.load(dln_ptr + row * dln_row_stride + cols, mask=mask, other=0.0).to(acc_type)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(acc_type)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        sum_dxhat += d * w
        sum_dxhat_xhat += d * w * xhat
    tl.store(stats_ptr + 2 * row, tl.sum(sum_dxhat, axis=0) / n)
    tl.store(stats_ptr + 2 * row + 1, tl.sum(sum_dxhat_xhat, axis=0) / n)


@triton.jit
def _layer_norm_bwd_add_chunked_kernel(dx_ptr, dw_partial_ptr, db_partial_ptr, stats_ptr, dln_ptr, dln_row_stride,
                                       x_ptr, x_row_stride, w_ptr, mean_ptr, rstd_ptr, dres_ptr, dres_row_stride, n,
                                       rows, rows_per_program, ACC_FP64: tl.constexpr, BLOCK_N: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(acc_type)
    dw = tl.zeros((BLOCK_N,), dtype=acc_type)
    db = tl.zeros((BLOCK_N,), dtype=acc_type)
    row_begin = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, rows)
    for row in range(row_begin, row_end):
        xhat, d, rstd = _row_xhat(x_ptr, x_row_stride, dln_ptr, dln_row_stride, mean_ptr, rstd_ptr, row, cols, mask,
                                  ACC_FP64)
        mean_dxhat = tl.load(stats_ptr + 2 * row)
        mean_dxhat_xhat = tl.load(stats_ptr + 2 * row + 1)
        res = tl.load(dres_ptr + row * dres_row_stride + cols, mask=mask, other=0.0).to(acc_type)
        dx = res + rstd * (d * w - mean_dxhat - xhat * mean_dxhat_xhat)
        tl.store(dx_ptr + row * n + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += d * xhat
        db += d
    tl.store(dw_partial_ptr + pid * n + cols, dw, mask=mask)
    tl.store(db_partial_ptr + pid * n + cols, db, mask=mask)


@triton.jit
def _sum_partials_kernel(dw_ptr, db_ptr, partial_ptr, num_partials, n, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    # partial: (2, num_partials, n); program (i, 0) sums dweight's columns block i, (i, 1) dbias's.
    which = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    base = partial_ptr + which.to(tl.int64) * num_partials * n
    total = tl.zeros((BLOCK_N,), dtype=partial_ptr.dtype.element_ty)
    for start in range(0, num_partials, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts[:, None] < num_partials) & col_mask[None, :]
        total += tl.sum(tl.load(base + parts[:, None] * n + cols[None, :], mask=mask, other=0.0), axis=0)
    if which == 0:
        tl.store(dw_ptr + cols, total.to(dw_ptr.dtype.element_ty), mask=col_mask)
    else:
        tl.store(db_ptr + cols, total.to(db_ptr.dtype.element_ty), mask=col_mask)


def _as_rows(t, n):
    """A (rows, n) view of t with unit stride along n, or a contiguous copy when there is none."""
    rows = t.reshape(-1, n)  # a view whenever the leading dims merge
    if rows.stride(1) != 1 and n > 1:
        rows = rows.contiguous()
    return rows


def _num_warps(block_n):
    """Warps of the forward kernels."""
    return min(max(block_n // 256, 1), 16)


def _bwd_num_warps(block_n):
    """Warps of the backward kernels (fused, and the chunked ones for their chunk width)."""
    return min(8, max(1, block_n // 128))


def _bwd_programs_per_sm(block_n):
    """Row programs per SM of the backward, by the row's block width (next power of 2 of N)."""
    return 4 if block_n <= 2048 else 2


def _num_row_programs(rows, device, per_sm):
    """Programs of the backward: per_sm per SM on a GPU, a few under the interpreter."""
    if device.type == "cuda":
        return min(rows, per_sm * sm_count(device))
    return min(rows, 4)


def sub_layer_norm(y, g, weight, bias, eps, max_fused_n=MAX_FUSED_N, chunk_n=CHUNK_N):
    """(x, ln, mean, rstd): x = y - g in y's dtype, ln = LayerNorm(x) over the last dim; mean and
    rstd in fp32 (fp64 when y or g is fp64). Rows wider than max_fused_n take the chunked kernel."""
    n = y.shape[-1]
    acc_fp64 = torch.float64 in (y.dtype, g.dtype)
    acc_dtype = torch.float64 if acc_fp64 else torch.float32
    x = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    ln = torch.empty_like(x)
    mean = torch.empty(y.shape[:-1], dtype=acc_dtype, device=y.device)
    rstd = torch.empty_like(mean)
    rows = mean.numel()
    if rows == 0:
        return x, ln, mean, rstd
    y_rows, g_rows = _as_rows(y, n), _as_rows(g, n)
    weight, bias = weight.contiguous(), bias.contiguous()
    block_n = triton.next_power_of_2(n)
    if block_n <= max_fused_n:
        kernel = _sub_layer_norm_fwd_kernel
    else:
        kernel, block_n = _sub_layer_norm_fwd_chunked_kernel, min(chunk_n, block_n)
    kernel[(rows,)](x, ln, mean, rstd, y_rows, y_rows.stride(0), g_rows, g_rows.stride(0), weight, bias, float(eps),
                    n, ACC_FP64=acc_fp64, BLOCK_N=block_n, num_warps=_num_warps(block_n))
    return x, ln, mean, rstd


def layer_norm_bwd_add(dln, x, weight, mean, rstd, dres, max_fused_n=MAX_FUSED_N_BWD, chunk_n=CHUNK_N):
    """(dx, dweight, dbias): dx = dres + LayerNorm backward(dln) in dres's dtype; dweight, dbias
    summed over rows in fp32 (fp64 when x or dres is fp64) and returned in weight's dtype. Rows
    wider than max_fused_n take the chunked kernels."""
    n = x.shape[-1]
    acc_fp64 = torch.float64 in (x.dtype, dres.dtype)
    acc_dtype = torch.float64 if acc_fp64 else torch.float32
    dx = torch.empty(x.shape, dtype=dres.dtype, device=x.device)
    dweight = torch.empty(n, dtype=weight.dtype, device=x.device)
    dbias = torch.empty(n, dtype=weight.dtype, device=x.device)
    rows = mean.numel()
    if rows == 0:
        return dx, dweight.zero_(), dbias.zero_()
    dln_rows, x_rows, dres_rows = _as_rows(dln, n), _as_rows(x, n), _as_rows(dres, n)
    weight, mean, rstd = weight.contiguous(), mean.contiguous(), rstd.contiguous()
    block_n = triton.next_power_of_2(n)
    # Programs per SM by the whole row's width, also on the chunked path (whose 2-D grid
    # multiplies them by the chunks of a row).
    programs = _num_row_programs(rows, x.device, _bwd_programs_per_sm(block_n))
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    partials = torch.empty(2, programs, n, dtype=acc_dtype, device=x.device)
    if block_n <= max_fused_n:
        _layer_norm_bwd_add_kernel[(programs,)](
            dx, partials[0], partials[1], dln_rows, dln_rows.stride(0), x_rows, x_rows.stride(0), weight, mean, rstd,
            dres_rows, dres_rows.stride(0), n, rows, rows_per_program,
            ACC_FP64=acc_fp64, BLOCK_N=block_n, num_warps=_bwd_num_warps(block_n))
    else:
        block_n = min(chunk_n, block_n)
        stats = torch.empty(rows, 2, dtype=acc_dtype, device=x.device)
        _layer_norm_bwd_row_stats_kernel[(rows,)](
            stats, dln_rows, dln_rows.stride(0), x_rows, x_rows.stride(0), weight, mean, rstd, n,
            ACC_FP64=acc_fp64, BLOCK_N=block_n, num_warps=_bwd_num_warps(block_n))
        _layer_norm_bwd_add_chunked_kernel[(programs, triton.cdiv(n, block_n))](
            dx, partials[0], partials[1], stats, dln_rows, dln_rows.stride(0), x_rows, x_rows.stride(0), weight, mean,
            rstd, dres_rows, dres_rows.stride(0), n, rows, rows_per_program,
            ACC_FP64=acc_fp64, BLOCK_N=block_n, num_warps=_bwd_num_warps(block_n))
    _sum_partials_kernel[(triton.cdiv(n, PARTIAL_BLOCK_N), 2)](
        dweight, dbias, partials, programs, n, BLOCK_P=PARTIAL_BLOCK_P, BLOCK_N=PARTIAL_BLOCK_N)
    return dx, dweight, dbias
