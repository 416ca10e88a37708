// Torch-free LayerNorm kernels with the coupling fused in (math and semantics:
// revkernels/ops/layer_norm.py):
//   sub_layer_norm      x = y - g rounded once to x's dtype, then ln = (x - mean) * rstd * w + b
//                       of that rounded x, with mean and rstd per row
//   layer_norm_bwd_add  dx = dres + rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
//                       xhat = (x - mean) * rstd, dxhat = dln * w; plus the sums over a range of
//                       rows of dln * xhat (dweight) and dln (dbias)
// The data are rows of n elements: input row r starts at r * row_stride (any stride, 0 for a
// broadcast row) and its elements are adjacent; outputs are dense (row r at r * n). weight, bias,
// mean and rstd come in the accumulation type acc_t (float, or double when the data are double):
// the op glue converts these n- or rows-sized vectors, which costs nothing next to the rows.
// Kernels take a row range [row_begin, row_end) so the glue can split rows across threads.
#pragma once

#include <cmath>
#include <cstdint>

#include "lane_sums.h"
#include "scalar.h"

namespace revkernels {

// Rows [row_begin, row_end) of x = y - g and ln = LayerNorm(x) * weight + bias; mean and rstd
// (1 / sqrt(biased variance + eps)) per row. The statistics and ln are computed from the stored,
// rounded x, so ln is exactly the LayerNorm of the x the op returns. Two passes for the variance
// (the row is in cache), which avoids the cancellation of E[x^2] - mean^2. The mean sums x - x[0]:
// a constant row sums exact zeros, so its mean is exact and its variance zero (a sum
// of the values themselves rounds, and the rounding, over sqrt(eps), was ln: 5e-3 off).
template <typename acc_t, typename x_t, typename g_t>
void sub_layer_norm_cpu(x_t* x, x_t* ln, acc_t* mean, acc_t* rstd, const x_t* y, int64_t y_row_stride,
                        const g_t* g, int64_t g_row_stride, const acc_t* weight, const acc_t* bias, acc_t eps,
                        int64_t n, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const x_t* yr = y + r * y_row_stride;
    const g_t* gr = g + r * g_row_stride;
    x_t* xr = x + r * n;
    x_t* lr = ln + r * n;
    for (int64_t i = 0; i < n; ++i) store<acc_t>(xr + i, load<acc_t>(yr + i) - load<acc_t>(gr + i));
    const double count = static_cast<double>(n);
    const acc_t pivot = stats_pivot(load<acc_t>(xr));  // (lane_sums.h)
    const acc_t mu = static_cast<acc_t>(
        pivot + lane_sum<acc_t>(n, [&](int64_t i) { return load<acc_t>(xr + i) - pivot; }) / count);
    const acc_t var = static_cast<acc_t>(lane_sum<acc_t>(n, [&](int64_t i) {
                                           const acc_t d = load<acc_t>(xr + i) - mu;
                                           return d * d;
                                         }) / count);
    const acc_t rs = acc_t(1) / std::sqrt(var + eps);
    for (int64_t i = 0; i < n; ++i) store<acc_t>(lr + i, (load<acc_t>(xr + i) - mu) * rs * weight[i] + bias[i]);
    mean[r] = mu;
    rstd[r] = rs;
  }
}

// Rows [row_begin, row_end) of dx = dres + LayerNorm backward(dln), and this range's partial sums
// dweight_partial[i] = sum_r dln[r, i] * xhat[r, i], dbias_partial[i] = sum_r dln[r, i]
// (overwritten, not accumulated into; zero for an empty range).
template <typename acc_t, typename dres_t, typename x_t>
void layer_norm_bwd_add_cpu(dres_t* dx, acc_t* dweight_partial, acc_t* dbias_partial, const x_t* dln,
                            int64_t dln_row_stride, const x_t* x, int64_t x_row_stride, const acc_t* weight,
                            const acc_t* mean, const acc_t* rstd, const dres_t* dres, int64_t dres_row_stride,
                            int64_t n, int64_t row_begin, int64_t row_end) {
  for (int64_t i = 0; i < n; ++i) {
    dweight_partial[i] = acc_t(0);
    dbias_partial[i] = acc_t(0);
  }
  const double count = static_cast<double>(n);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const x_t* dr = dln + r * dln_row_stride;
    const x_t* xr = x + r * x_row_stride;
    const dres_t* res = dres + r * dres_row_stride;
    dres_t* out = dx + r * n;
    const acc_t mu = mean[r], rs = rstd[r];
    // Pass 1: the row means of dxhat and dxhat * xhat, and the dweight/dbias partial sums.
    acc_t sum_dxhat[kSumLanes] = {}, sum_dxhat_xhat[kSumLanes] = {};
    double total_dxhat = 0.0, total_dxhat_xhat = 0.0;
    for_each_lane(
        n,
        [&](int64_t i, int64_t lane) {
          const acc_t xhat = (load<acc_t>(xr + i) - mu) * rs;
          const acc_t d = load<acc_t>(dr + i);
          const acc_t dxhat = d * weight[i];
          sum_dxhat[lane] += dxhat;
          sum_dxhat_xhat[lane] += dxhat * xhat;
          dweight_partial[i] += d * xhat;
          dbias_partial[i] += d;
        },
        [&] {
          flush_lanes(total_dxhat, sum_dxhat);
          flush_lanes(total_dxhat_xhat, sum_dxhat_xhat);
        });
    const acc_t mean_dxhat = static_cast<acc_t>(total_dxhat / count);
    const acc_t mean_dxhat_xhat = static_cast<acc_t>(total_dxhat_xhat / count);
    // Pass 2: dx, with the residual gradient added before the one rounding to dres_t.
    for (int64_t i = 0; i < n; ++i) {
      const acc_t xhat = (load<acc_t>(xr + i) - mu) * rs;
      const acc_t dxhat = load<acc_t>(dr + i) * weight[i];
      store<acc_t>(out + i, load<acc_t>(res + i) + rs * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat));
    }
  }
}

// Columns [col_begin, col_end) of out[i] = sum_{p < num_partials} partials[p * n + i], summed in
// acc_t in the order p = 0, 1, ... (deterministic) and rounded once to out_t.
template <typename acc_t, typename out_t>
void reduce_partials_cpu(out_t* out, const acc_t* partials, int64_t num_partials, int64_t n, int64_t col_begin,
                         int64_t col_end) {
  constexpr int64_t kTile = 64;  // a tile of column sums stays in registers while p walks the partials
  for (int64_t c0 = col_begin; c0 < col_end; c0 += kTile) {
    const int64_t width = (col_end - c0) < kTile ? (col_end - c0) : kTile;
    acc_t sums[kTile] = {};
    for (int64_t p = 0; p < num_partials; ++p) {
      const acc_t* row = partials + p * n + c0;
      for (int64_t i = 0; i < width; ++i) sums[i] += row[i];
    }
    for (int64_t i = 0; i < width; ++i) store<acc_t>(out + c0 + i, sums[i]);
  }
}

}  // namespace revkernels
