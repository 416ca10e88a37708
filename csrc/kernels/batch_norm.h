// Torch-free training-mode BatchNorm (+ ReLU) kernels (math and semantics:
// revkernels/ops/batch_norm.py):
//   batch_norm_act      per channel c: mean, rstd = 1 / sqrt(biased var + eps) over the batch and
//                       spatial positions; out = act((x - mean) * rstd * w + b), act = ReLU or identity
//   batch_norm_act_bwd  dy = dout masked by (pre-activation > 0) when relu, xhat = (x - mean) * rstd;
//                       dweight = sum(dy * xhat), dbias = sum(dy),
//                       dx = rstd * w * (dy - dbias / M - xhat * dweight / M),  M = N * S
// The data are viewed as (N, C, S) (S = the spatial dims flattened) with any strides (BnView):
// NCHW-contiguous is (C*S, S, 1), channels_last (C*S, 1, C). weight, bias, mean and rstd come in
// the accumulation type acc_t (float, or double for double data). Kernels take a channel range
// [c_begin, c_end) so the glue can split channels across threads; each channel is reduced by one
// thread in a fixed order, so results do not depend on the thread count.
#pragma once

#include <cmath>
#include <cstdint>

#include "lane_sums.h"
#include "scalar.h"

namespace revkernels {

struct BnView {
  int64_t n = 0, s = 0;                                // batch size and spatial size (C is the range)
  int64_t n_stride = 0, c_stride = 0, s_stride = 0;    // element strides of the (N, C, S) view
};

// Channel sums are carried in lanes over the elements in memory order and flushed into an fp64
// total every kSumChunk terms per lane (lane_sums.h), across samples: the error does not grow with M.
template <typename acc_t, typename Fn>
inline double bn_channel_sum(const BnView& v, Fn&& term) {
  double total = 0.0;
  acc_t lanes[kSumLanes] = {};
  int64_t terms = 0;  // per lane, since the last flush
  auto flush = [&] {
    flush_lanes(total, lanes);
    terms = 0;
  };
  for (int64_t i = 0; i < v.n; ++i) {
    int64_t j = 0;
    for (; j + kSumLanes <= v.s; j += kSumLanes) {
      for (int64_t lane = 0; lane < kSumLanes; ++lane) lanes[lane] += term(i, j + lane);
      if (++terms == kSumChunk) flush();
    }
    if (j < v.s) {
      for (int64_t lane = 0; j < v.s; ++j, ++lane) lanes[lane] += term(i, j);
      if (++terms == kSumChunk) flush();
    }
  }
  flush();
  return total;
}

// Pre-activation of one element: (x - mean) * rstd * w + b, as the forward and backward form it.
template <typename acc_t>
inline acc_t bn_affine(acc_t x, acc_t mu, acc_t rs, acc_t w, acc_t b) {
  return (x - mu) * rs * w + b;
}

// Channels [c_begin, c_end): mean, rstd and out = act(normalised * w + b). Two passes for the
// variance (sum of squared deviations from the mean), which avoids E[x^2] - mean^2's cancellation.
template <typename acc_t, typename x_t>
void batch_norm_act_cpu(x_t* out, acc_t* mean, acc_t* rstd, const x_t* x, const BnView& xv, const BnView& ov,
                        const acc_t* weight, const acc_t* bias, acc_t eps, bool relu, int64_t c_begin,
                        int64_t c_end) {
  const double count = static_cast<double>(xv.n * xv.s);
  for (int64_t c = c_begin; c < c_end; ++c) {
    const x_t* xc = x + c * xv.c_stride;
    auto at = [&](int64_t i, int64_t j) { return load<acc_t>(xc + i * xv.n_stride + j * xv.s_stride); };
    const acc_t pivot = count > 0 ? stats_pivot(at(0, 0)) : acc_t(0);  // (lane_sums.h)
    const acc_t mu = static_cast<acc_t>(
        pivot + bn_channel_sum<acc_t>(xv, [&](int64_t i, int64_t j) { return at(i, j) - pivot; }) / count);
    const acc_t var = static_cast<acc_t>(bn_channel_sum<acc_t>(xv, [&](int64_t i, int64_t j) {
                                           const acc_t d = at(i, j) - mu;
                                           return d * d;
                                         }) / count);
    const acc_t rs = acc_t(1) / std::sqrt(var + eps);
    const acc_t w = weight[c], b = bias[c];
    x_t* oc = out + c * ov.c_stride;
    for (int64_t i = 0; i < xv.n; ++i) {
      for (int64_t j = 0; j < xv.s; ++j) {
        acc_t y = bn_affine(at(i, j), mu, rs, w, b);
        if (relu && y <= acc_t(0)) y = acc_t(0);  // a NaN stays NaN, as in torch.relu
        store<acc_t>(oc + i * ov.n_stride + j * ov.s_stride, y);
      }
    }
    mean[c] = mu;
    rstd[c] = rs;
  }
}

// Channels [c_begin, c_end) of the backward: dx, and dweight[c] / dbias[c] (the channel sums,
// in acc_t). The ReLU mask is recomputed from x, mean, rstd, weight and bias exactly as the forward
// formed the pre-activation.
template <typename acc_t, typename x_t>
void batch_norm_act_bwd_cpu(x_t* dx, acc_t* dweight, acc_t* dbias, const x_t* dout, const BnView& dv,
                            const x_t* x, const BnView& xv, const BnView& dxv, const acc_t* weight,
                            const acc_t* bias, const acc_t* mean, const acc_t* rstd, bool relu, int64_t c_begin,
                            int64_t c_end) {
  const double count = static_cast<double>(xv.n * xv.s);
  for (int64_t c = c_begin; c < c_end; ++c) {
    const x_t* xc = x + c * xv.c_stride;
    const x_t* dc = dout + c * dv.c_stride;
    const acc_t mu = mean[c], rs = rstd[c], w = weight[c], b = bias[c];
    auto xhat_at = [&](int64_t i, int64_t j) { return (load<acc_t>(xc + i * xv.n_stride + j * xv.s_stride) - mu) * rs; };
    auto dy_at = [&](int64_t i, int64_t j) {
      const acc_t d = load<acc_t>(dc + i * dv.n_stride + j * dv.s_stride);
      if (!relu) return d;
      const acc_t y = bn_affine(load<acc_t>(xc + i * xv.n_stride + j * xv.s_stride), mu, rs, w, b);
      return y <= acc_t(0) ? acc_t(0) : d;  // as torch's threshold_backward: a NaN y passes d
    };
    const double sum_dy = bn_channel_sum<acc_t>(xv, dy_at);
    const double sum_dy_xhat =
        bn_channel_sum<acc_t>(xv, [&](int64_t i, int64_t j) { return dy_at(i, j) * xhat_at(i, j); });
    const acc_t mean_dy = static_cast<acc_t>(sum_dy / count);
    const acc_t mean_dy_xhat = static_cast<acc_t>(sum_dy_xhat / count);
    const acc_t scale = rs * w;
    x_t* oc = dx + c * dxv.c_stride;
    for (int64_t i = 0; i < xv.n; ++i) {
      for (int64_t j = 0; j < xv.s; ++j) {
        store<acc_t>(oc + i * dxv.n_stride + j * dxv.s_stride,
                     scale * (dy_at(i, j) - mean_dy - xhat_at(i, j) * mean_dy_xhat));
      }
    }
    dweight[c] = static_cast<acc_t>(sum_dy_xhat);
    dbias[c] = static_cast<acc_t>(sum_dy);
  }
}

}  // namespace revkernels
