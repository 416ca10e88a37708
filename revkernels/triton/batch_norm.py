"""Triton kernels of the training-mode BatchNorm (+ ReLU) ops (math: revkernels/ops/batch_norm.py).

The data (N, C, *spatial) are read as an (N, C, S) view, S the spatial dims flattened, with the
strides of an NCHW-contiguous (C*S, S, 1) or channels_last (C*S, 1, C) tensor; any other layout is
copied with .contiguous() first. out and dx are allocated like the tensor read (same layout).
Per channel the reduction runs over m in [0, M), M = N * S, element m being (n, s) = divmod(m, S).

A channel's reduction is split over programs: the grid is (channel blocks, chunks), each program
handling a tile of BLOCK_C channels x BLOCK_M positions per step over its chunk of m. The tile is
one channel wide when positions are adjacent in memory (NCHW) and up to 32 channels wide when
channels are (channels_last, or S == 1), so loads stay coalesced in both layouts. With C = 64 and
M = 256*56*56 the grid has 64 x ~8 programs, not 64.

Three kernels per op, no atomics (deterministic):

batch_norm_act: (1) each program writes its chunk's per-channel mean and M2 (sum of squared
deviations) of x minus the channel's first value (a constant channel's statistics are exact),
merged block by block as in Chan et al.; (2) a small kernel merges the chunks'
partials per channel in a fixed order (mean = sum(count_k * mean_k) / M, M2 = sum(M2_k +
count_k * (mean_k - mean)^2)) and writes mean and rstd; (3) each program of the first grid writes
out = act((x - mean) * rstd * w + b) over its chunk.

batch_norm_act_bwd: (1) each program writes its chunk's per-channel sums of dy and dy * xhat
(dy = dout masked by the ReLU, the pre-activation recomputed as the forward formed it); (2) a small
kernel sums the chunks' partials in a fixed order and writes dweight, dbias and the unrounded sums;
(3) each program writes dx over its chunk.
"""
import torch
import triton
import triton.language as tl

from revkernels.triton._device import sm_count
from revkernels.triton._stats import stats_pivot

TILE = 2048  # elements of a BLOCK_C x BLOCK_M tile
MAX_BLOCK_C = 32  # channels of a tile when channels are adjacent in memory
PROGRAMS_PER_SM = 8
PARTIAL_BLOCK_P = 16  # chunk partials merged per step
FINALIZE_BLOCK_C = 64  # channels per program of the merge kernels


@triton.jit
def _channel_block(BLOCK_C: tl.constexpr, C):
    """The channels of this program (grid axis 0) and their mask."""
    chans = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    return chans, chans < C


@triton.jit
def _chunk_range(chunk_len, M):
    """[m_begin, m_end): the reduction positions of this program's chunk (grid axis 1)."""
    m_begin = tl.program_id(1).to(tl.int64) * chunk_len
    return m_begin, tl.minimum(m_begin + chunk_len, M)


@triton.jit
def _tile_offsets(start, m_end, S, chans, cmask, sn, sc, ss, BLOCK_M: tl.constexpr):
    """Element offsets (strides sn, sc, ss of the (N, C, S) view) and mask of the BLOCK_C x BLOCK_M
    tile of positions [start, start + BLOCK_M)."""
    ms = start + tl.arange(0, BLOCK_M)
    n = ms // S
    offs = chans[:, None] * sc + (n * sn + (ms - n * S) * ss)[None, :]
    return offs, cmask[:, None] & (ms < m_end)[None, :]


@triton.jit
def _channel_affine(mean_ptr, rstd_ptr, w_ptr, b_ptr, chans, cmask, ACC_FP64: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    mean = tl.load(mean_ptr + chans, mask=cmask, other=0.0).to(acc_type)
    rstd = tl.load(rstd_ptr + chans, mask=cmask, other=0.0).to(acc_type)
    w = tl.load(w_ptr + chans, mask=cmask, other=0.0).to(acc_type)
    b = tl.load(b_ptr + chans, mask=cmask, other=0.0).to(acc_type)
    return mean, rstd, w, b


@triton.jit
def _xhat_and_masked_dy(x, dy, mean, rstd, w, b, RELU: tl.constexpr):
    """xhat, and dy with the ReLU's mask (the pre-activation formed exactly as the forward's)."""
    xhat = (x - mean[:, None]) * rstd[:, None]
    if RELU:
        dy = tl.where(xhat * w[:, None] + b[:, None] <= 0, 0.0, dy)  # a NaN passes dy, as in torch
    return xhat, dy


@triton.jit
def _channel_pivot(x_ptr, xc, chans, cmask, ACC_FP64: tl.constexpr):
    """Each channel's first value (n = 0, s = 0; 0 if it is not finite): the statistics are formed
    from x - pivot, so a constant channel's mean is exact and its variance zero (block means of the
    values themselves round, and the merge carried the rounding into the variance: rstd 4.5e-2 off
    for a constant channel of 12345.678)."""
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    return stats_pivot(tl.load(x_ptr + chans * xc, mask=cmask, other=0.0).to(acc_type))


@triton.jit
def _bn_fwd_stats_kernel(partial_ptr, x_ptr, xn, xc, xs, C, S, M, chunk_len, num_chunks,
                         ACC_FP64: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr):
    # partial: (2, num_chunks, C): this chunk's mean and M2 per channel, of x - pivot. M2 merges the
    # blocks' (mean, M2); the mean stored is the plain sum's (the merged mean subtracts means: NaN
    # after an infinite value, where the sum's is +-inf, as the reference's).
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    k = tl.program_id(1)
    chans, cmask = _channel_block(BLOCK_C, C)
    pivot = _channel_pivot(x_ptr, xc, chans, cmask, ACC_FP64)
    m_begin, m_end = _chunk_range(chunk_len, M)
    count = tl.zeros((), dtype=acc_type)
    mean = tl.zeros((BLOCK_C,), dtype=acc_type)
    m2 = tl.zeros((BLOCK_C,), dtype=acc_type)
    total_sum = tl.zeros((BLOCK_C,), dtype=acc_type)
    for start in range(m_begin, m_end, BLOCK_M):
        offs, mask = _tile_offsets(start, m_end, S, chans, cmask, xn, xc, xs, BLOCK_M)
        x = tl.where(mask, tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_type) - pivot[:, None], 0.0)
        blk_count = tl.minimum(m_end - start, BLOCK_M).to(acc_type)
        blk_sum = tl.sum(x, axis=1)
        total_sum += blk_sum
        blk_mean = blk_sum / blk_count
        diff = tl.where(mask, x - blk_mean[:, None], 0.0)
        total = count + blk_count
        delta = blk_mean - mean
        mean += delta * (blk_count / total)
        m2 += tl.sum(diff * diff, axis=1) + delta * delta * (count * blk_count / total)
        count = total
    tl.store(partial_ptr + k * C + chans, total_sum / tl.maximum(count, 1.0), mask=cmask)
    tl.store(partial_ptr + (num_chunks + k) * C + chans, m2, mask=cmask)


@triton.jit
def _chunk_means(partial_ptr, p0, chans, cmask, C, M, chunk_len, num_chunks, ACC_FP64: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    """Chunks [p0, p0 + BLOCK_P): their indices, element counts, mask and per-channel means."""
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    parts = p0 + tl.arange(0, BLOCK_P)
    pmask = parts < num_chunks
    cnt = tl.where(pmask, tl.minimum(chunk_len, M - parts.to(tl.int64) * chunk_len), 0).to(acc_type)
    mask = pmask[:, None] & cmask[None, :]
    pm = tl.load(partial_ptr + parts[:, None] * C + chans[None, :], mask=mask, other=0.0)
    return parts, cnt, mask, pm


@triton.jit
def _bn_fwd_finalize_kernel(mean_ptr, rstd_ptr, partial_ptr, x_ptr, xc, eps, C, M, chunk_len, num_chunks,
                            ACC_FP64: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    # Merges the chunks' (mean, M2) of x - pivot in chunk order: mean = sum(count_k * mean_k) / M,
    # M2 = sum(M2_k + count_k * (mean_k - mean)^2); writes pivot + mean and rstd.
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    chans = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    cmask = chans < C
    weighted = tl.zeros((BLOCK_C,), dtype=acc_type)
    for p0 in range(0, num_chunks, BLOCK_P):
        parts, cnt, mask, pm = _chunk_means(partial_ptr, p0, chans, cmask, C, M, chunk_len, num_chunks, ACC_FP64,
                                            BLOCK_P)
        weighted += tl.sum(cnt[:, None] * pm, axis=0)
    mean = weighted / M
    pivot = _channel_pivot(x_ptr, xc, chans, cmask, ACC_FP64)
    m2 = tl.zeros((BLOCK_C,), dtype=acc_type)
    for p0 in range(0, num_chunks, BLOCK_P):
        parts, cnt, mask, pm = _chunk_means(partial_ptr, p0, chans, cmask, C, M, chunk_len, num_chunks, ACC_FP64,
                                            BLOCK_P)
        pm2 = tl.load(partial_ptr + (num_chunks + parts[:, None]) * C + chans[None, :], mask=mask, other=0.0)
        d = pm - mean[None, :]
        m2 += tl.sum(tl.where(mask, pm2 + cnt[:, None] * d * d, 0.0), axis=0)
    tl.store(mean_ptr + chans, pivot + mean, mask=cmask)
    tl.store(rstd_ptr + chans, 1.0 / tl.sqrt(m2 / M + eps), mask=cmask)


@triton.jit
def _bn_fwd_apply_kernel(out_ptr, on, oc, os, mean_ptr, rstd_ptr, x_ptr, xn, xc, xs, w_ptr, b_ptr, C, S, M,
                         chunk_len, RELU: tl.constexpr, ACC_FP64: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_M: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    chans, cmask = _channel_block(BLOCK_C, C)
    mean, rstd, w, b = _channel_affine(mean_ptr, rstd_ptr, w_ptr, b_ptr, chans, cmask, ACC_FP64)
    m_begin, m_end = _chunk_range(chunk_len, M)
    for start in range(m_begin, m_end, BLOCK_M):
        offs, mask = _tile_offsets(start, m_end, S, chans, cmask, xn, xc, xs, BLOCK_M)
        out_offs, _ = _tile_offsets(start, m_end, S, chans, cmask, on, oc, os, BLOCK_M)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_type)
        y = (x - mean[:, None]) * rstd[:, None] * w[:, None] + b[:, None]
        if RELU:
            y = tl.where(y <= 0, 0.0, y)  # a NaN stays NaN, as in torch.relu
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bn_bwd_sums_kernel(partial_ptr, d_ptr, dn, dc, ds, x_ptr, xn, xc, xs, w_ptr, b_ptr, mean_ptr, rstd_ptr,
                        C, S, M, chunk_len, num_chunks, RELU: tl.constexpr, ACC_FP64: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr):
    # partial: (2, num_chunks, C): this chunk's sums of dy and dy * xhat per channel.
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    k = tl.program_id(1)
    chans, cmask = _channel_block(BLOCK_C, C)
    mean, rstd, w, b = _channel_affine(mean_ptr, rstd_ptr, w_ptr, b_ptr, chans, cmask, ACC_FP64)
    sum_dy = tl.zeros((BLOCK_C, BLOCK_M), dtype=acc_type)
    sum_dy_xhat = tl.zeros((BLOCK_C, BLOCK_M), dtype=acc_type)
    m_begin, m_end = _chunk_range(chunk_len, M)
    for start in range(m_begin, m_end, BLOCK_M):
        offs, mask = _tile_offsets(start, m_end, S, chans, cmask, xn, xc, xs, BLOCK_M)
        d_offs, _ = _tile_offsets(start, m_end, S, chans, cmask, dn, dc, ds, BLOCK_M)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_type)
        dy = tl.load(d_ptr + d_offs, mask=mask, other=0.0).to(acc_type)
        xhat, dy = _xhat_and_masked_dy(x, dy, mean, rstd, w, b, RELU)
        sum_dy += dy
        sum_dy_xhat += dy * xhat  # dy is 0 outside the mask
    tl.store(partial_ptr + k * C + chans, tl.sum(sum_dy, axis=1), mask=cmask)
    tl.store(partial_ptr + (num_chunks + k) * C + chans, tl.sum(sum_dy_xhat, axis=1), mask=cmask)


@triton.jit
def _bn_bwd_finalize_kernel(sums_ptr, dw_ptr, db_ptr, partial_ptr, C, num_chunks, BLOCK_C: tl.constexpr,
                            BLOCK_P: tl.constexpr):
    # Sums the chunks' partials in chunk order; writes dweight, dbias (weight's, bias's dtype) and the
    # unrounded sums (2, C) for the apply kernel.
    chans = (tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    cmask = chans < C
    sum_dy = tl.zeros((BLOCK_C,), dtype=partial_ptr.dtype.element_ty)
    sum_dy_xhat = tl.zeros((BLOCK_C,), dtype=partial_ptr.dtype.element_ty)
    for p0 in range(0, num_chunks, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        mask = (parts < num_chunks)[:, None] & cmask[None, :]
        sum_dy += tl.sum(tl.load(partial_ptr + parts[:, None] * C + chans[None, :], mask=mask, other=0.0), axis=0)
        sum_dy_xhat += tl.sum(tl.load(partial_ptr + (num_chunks + parts[:, None]) * C + chans[None, :], mask=mask,
                                      other=0.0), axis=0)
    tl.store(sums_ptr + chans, sum_dy, mask=cmask)
    tl.store(sums_ptr + C + chans, sum_dy_xhat, mask=cmask)
    tl.store(dw_ptr + chans, sum_dy_xhat.to(dw_ptr.dtype.element_ty), mask=cmask)
    tl.store(db_ptr + chans, sum_dy.to(db_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _bn_bwd_apply_kernel(dx_ptr, dxn, dxc, dxs, sums_ptr, d_ptr, dn, dc, ds, x_ptr, xn, xc, xs, w_ptr, b_ptr,
                         mean_ptr, rstd_ptr, C, S, M, chunk_len, RELU: tl.constexpr, ACC_FP64: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_M: tl.constexpr):
    acc_type = tl.float64 if ACC_FP64 else tl.float32
    chans, cmask = _channel_block(BLOCK_C, C)
    mean_dy = tl.load(sums_ptr + chans, mask=cmask, other=0.0) / M
    mean_dy_xhat = tl.load(sums_ptr + C + chans, mask=cmask, other=0.0) / M
    mean, rstd, w, b = _channel_affine(mean_ptr, rstd_ptr, w_ptr, b_ptr, chans, cmask, ACC_FP64)
    scale = rstd * w
    m_begin, m_end = _chunk_range(chunk_len, M)
    for start in range(m_begin, m_end, BLOCK_M):
        offs, mask = _tile_offsets(start, m_end, S, chans, cmask, xn, xc, xs, BLOCK_M)
        d_offs, _ = _tile_offsets(start, m_end, S, chans, cmask, dn, dc, ds, BLOCK_M)
        dx_offs, _ = _tile_offsets(start, m_end, S, chans, cmask, dxn, dxc, dxs, BLOCK_M)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(acc_type)
        dy = tl.load(d_ptr + d_offs, mask=mask, other=0.0).to(acc_type)
        xhat, dy = _xhat_and_masked_dy(x, dy, mean, rstd, w, b, RELU)
        dx = scale[:, None] * (dy - mean_dy[:, None] - xhat * mean_dy_xhat[:, None])
        tl.store(dx_ptr + dx_offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _is_channels_last(t):
    return ((t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))
            or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)))


def _laid_out(t):
    return t if t.is_contiguous() or _is_channels_last(t) else t.contiguous()


def _view_strides(t):
    """(n, c, s) element strides of the (N, C, S) view of a tensor laid out by _laid_out."""
    c = t.shape[1]
    s = t.numel() // max(1, t.shape[0] * c)
    if t.is_contiguous():
        return c * s, s, 1
    return c * s, 1, c


def _launch_config(x, c, m, block_m, chunks):
    """(BLOCK_C, BLOCK_M, chunk_len, num_chunks) for channels C and reduction length M."""
    _, xc, _ = _view_strides(x)
    block_c = min(triton.next_power_of_2(c), MAX_BLOCK_C) if xc == 1 else 1
    if block_m is None:
        block_m = max(16, min(TILE // block_c, triton.next_power_of_2(m)))
    channel_blocks = triton.cdiv(c, block_c)
    if chunks is None:
        if x.device.type == "cuda":
            chunks = triton.cdiv(PROGRAMS_PER_SM * sm_count(x.device), channel_blocks)
        else:
            chunks = 4  # under the interpreter: a few, so the merge is exercised
    chunks = max(1, min(chunks, triton.cdiv(m, block_m)))
    chunk_len = triton.cdiv(triton.cdiv(m, chunks), block_m) * block_m
    return block_c, block_m, chunk_len, triton.cdiv(m, chunk_len)


def batch_norm_act(x, weight, bias, eps, relu, block_m=None, chunks=None):
    """(out, mean, rstd) of training-mode BatchNorm (+ ReLU) over (N, C, *spatial); out in x's
    dtype and layout, mean and rstd in fp32 (fp64 for fp64 x). block_m and chunks override the
    launch configuration (tests)."""
    acc_fp64 = x.dtype == torch.float64
    acc_dtype = torch.float64 if acc_fp64 else torch.float32
    x = _laid_out(x)
    c = x.shape[1]
    m = x.numel() // c
    out = torch.empty_like(x)
    mean = torch.empty(c, dtype=acc_dtype, device=x.device)
    rstd = torch.empty_like(mean)
    if m == 0:
        return out, mean.fill_(float("nan")), rstd.fill_(float("nan"))
    weight, bias = weight.contiguous(), bias.contiguous()
    block_c, block_m, chunk_len, num_chunks = _launch_config(x, c, m, block_m, chunks)
    s = m // x.shape[0]
    xn, xc, xs = _view_strides(x)
    partials = torch.empty(2, num_chunks, c, dtype=acc_dtype, device=x.device)
    grid = (triton.cdiv(c, block_c), num_chunks)
    _bn_fwd_stats_kernel[grid](partials, x, xn, xc, xs, c, s, m, chunk_len, num_chunks,
                               ACC_FP64=acc_fp64, BLOCK_C=block_c, BLOCK_M=block_m)
    _bn_fwd_finalize_kernel[(triton.cdiv(c, FINALIZE_BLOCK_C),)](
        mean, rstd, partials, x, xc, float(eps), c, m, chunk_len, num_chunks, ACC_FP64=acc_fp64, BLOCK_C=FINALIZE_BLOCK_C,
        BLOCK_P=PARTIAL_BLOCK_P)
    _bn_fwd_apply_kernel[grid](out, xn, xc, xs, mean, rstd, x, xn, xc, xs, weight, bias, c, s, m, chunk_len,
                               RELU=bool(relu), ACC_FP64=acc_fp64, BLOCK_C=block_c, BLOCK_M=block_m)
    return out, mean, rstd


def batch_norm_act_bwd(dout, x, weight, bias, mean, rstd, relu, block_m=None, chunks=None):
    """(dx, dweight, dbias): the VJP of batch_norm_act; dx in x's dtype and layout, dweight and
    dbias summed in fp32 (fp64 for fp64 x) and returned in weight's and bias's dtype."""
    acc_fp64 = x.dtype == torch.float64
    acc_dtype = torch.float64 if acc_fp64 else torch.float32
    x, dout = _laid_out(x), _laid_out(dout)
    c = x.shape[1]
    m = x.numel() // c
    dx = torch.empty_like(x)
    dweight = torch.empty(c, dtype=weight.dtype, device=x.device)
    dbias = torch.empty(c, dtype=bias.dtype, device=x.device)
    if m == 0:
        return dx, dweight.zero_(), dbias.zero_()
    weight, bias, mean, rstd = weight.contiguous(), bias.contiguous(), mean.contiguous(), rstd.contiguous()
    block_c, block_m, chunk_len, num_chunks = _launch_config(x, c, m, block_m, chunks)
    s = m // x.shape[0]
    xn, xc, xs = _view_strides(x)
    dn, dc, ds = _view_strides(dout)
    partials = torch.empty(2, num_chunks, c, dtype=acc_dtype, device=x.device)
    grid = (triton.cdiv(c, block_c), num_chunks)
    _bn_bwd_sums_kernel[grid](partials, dout, dn, dc, ds, x, xn, xc, xs, weight, bias, mean, rstd,
                              c, s, m, chunk_len, num_chunks, RELU=bool(relu), ACC_FP64=acc_fp64,
                              BLOCK_C=block_c, BLOCK_M=block_m)
    sums = torch.empty(2, c, dtype=acc_dtype, device=x.device)
    _bn_bwd_finalize_kernel[(triton.cdiv(c, FINALIZE_BLOCK_C),)](
        sums, dweight, dbias, partials, c, num_chunks, BLOCK_C=FINALIZE_BLOCK_C, BLOCK_P=PARTIAL_BLOCK_P)
    _bn_bwd_apply_kernel[grid](dx, xn, xc, xs, sums, dout, dn, dc, ds, x, xn, xc, xs, weight, bias, mean, rstd,
                               c, s, m, chunk_len, RELU=bool(relu), ACC_FP64=acc_fp64, BLOCK_C=block_c,
                               BLOCK_M=block_m)
    return dx, dweight, dbias
