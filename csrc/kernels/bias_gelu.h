// Torch-free bias + GELU kernels (math: revkernels/ops/bias_gelu.py), the MLP's fc1 epilogue and
// its backward fused with the bias-gradient reduction. x is viewed as `rows` rows of `n` elements
// (unit column stride, any row stride), bias as n elements.
//   forward   out    = gelu(x + bias)                   out contiguous, x's dtype
//   backward  dx     = dy * gelu'(x + bias)             dx contiguous, x's dtype
//             dbias  = sum over rows of dx              accumulated before dx is rounded
// Math in the accumulation type acc_t: float, or double when x or bias is double. dy has x's dtype.
// The GELU helpers are host/device functions, shared with the CUDA kernels in bias_gelu.cu.
#pragma once

#include <math.h>

#include <cstdint>
#include <type_traits>

#include "scalar.h"

namespace revkernels {

// torch.nn.functional.gelu's `approximate`: "none" (exact, erf) or "tanh".
enum class GeluApprox : int { None = 0, Tanh = 1 };

namespace gelu_math {

RK_HOST_DEVICE inline float erf_(float v) { return ::erff(v); }
RK_HOST_DEVICE inline double erf_(double v) { return ::erf(v); }
RK_HOST_DEVICE inline float exp_(float v) { return ::expf(v); }
RK_HOST_DEVICE inline double exp_(double v) { return ::exp(v); }

// sqrt(2/pi), 0.044715 (the tanh form), 1/sqrt(2) and 1/sqrt(2 pi) (the erf form).
template <typename acc_t> struct Constants {
  static constexpr acc_t kBeta = static_cast<acc_t>(0.79788456080286535587989211986876);
  static constexpr acc_t kKappa = static_cast<acc_t>(0.044715);
  static constexpr acc_t kSqrt1_2 = static_cast<acc_t>(0.70710678118654752440084436210485);
  static constexpr acc_t kInvSqrt2Pi = static_cast<acc_t>(0.39894228040143267793994605993438);
};

// sigmoid(2u) and sigmoid(-2u) = 1 - sigmoid(2u), both without cancellation or overflow:
// with e = exp(-2|u|) in (0, 1], sigmoid(2|u|) = 1 / (1 + e) and sigmoid(-2|u|) = e / (1 + e).
// (1 + tanh(u)) / 2 = sigmoid(2u) and (1 - tanh(u)) / 2 = sigmoid(-2u).
template <typename acc_t>
RK_HOST_DEVICE inline void sigmoid_pair(acc_t u, acc_t* plus, acc_t* minus) {
  const acc_t e = exp_(static_cast<acc_t>(-2) * (u < 0 ? -u : u));
  const acc_t big = static_cast<acc_t>(1) / (static_cast<acc_t>(1) + e);
  const acc_t small = e * big;
  *plus = u < 0 ? small : big;
  *minus = u < 0 ? big : small;
}

}  // namespace gelu_math

// gelu(z):  none  0.5 z (1 + erf(z / sqrt 2))
//           tanh  0.5 z (1 + tanh(u)),  u = sqrt(2/pi) (z + 0.044715 z^3);  = z sigmoid(2u)
template <typename acc_t>
RK_HOST_DEVICE inline acc_t gelu_value(acc_t z, GeluApprox approx) {
  using C = gelu_math::Constants<acc_t>;
  const acc_t half = static_cast<acc_t>(0.5);
  if (approx == GeluApprox::Tanh) {
    const acc_t u = C::kBeta * (z + C::kKappa * z * z * z);
    acc_t plus, minus;
    gelu_math::sigmoid_pair(u, &plus, &minus);
    return z * plus;
  }
  return half * z * (static_cast<acc_t>(1) + gelu_math::erf_(z * C::kSqrt1_2));
}

// gelu'(z): none  Phi(z) + z phi(z) = 0.5 (1 + erf(z / sqrt 2)) + z exp(-z^2 / 2) / sqrt(2 pi)
//           tanh  0.5 (1 + tanh u) + 0.5 z (1 - tanh^2 u) u'(z),  u' = sqrt(2/pi) (1 + 3 * 0.044715 z^2)
//                 = s + 2 z s (1 - s) u'(z),  s = sigmoid(2u)
template <typename acc_t>
RK_HOST_DEVICE inline acc_t gelu_derivative(acc_t z, GeluApprox approx) {
  using C = gelu_math::Constants<acc_t>;
  const acc_t one = static_cast<acc_t>(1);
  const acc_t half = static_cast<acc_t>(0.5);
  const acc_t z2 = z * z;
  if (approx == GeluApprox::Tanh) {
    const acc_t u = C::kBeta * (z + C::kKappa * z2 * z);
    const acc_t du = C::kBeta * (one + static_cast<acc_t>(3) * C::kKappa * z2);
    acc_t plus, minus;
    gelu_math::sigmoid_pair(u, &plus, &minus);
    return plus + static_cast<acc_t>(2) * z * plus * minus * du;
  }
  const acc_t cdf = half * (one + gelu_math::erf_(z * C::kSqrt1_2));
  const acc_t pdf = C::kInvSqrt2Pi * gelu_math::exp_(-half * z2);
  return cdf + z * pdf;
}

// Forward over rows [row_begin, row_end): out[r * n + j] = gelu(x[r * x_row_stride + j] + bias[j]).
template <typename acc_t, typename x_t, typename bias_t>
void bias_gelu_cpu(x_t* out, const x_t* x, int64_t x_row_stride, const bias_t* bias, int64_t n,
                   GeluApprox approx, int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    x_t* o = out + r * n;
    const x_t* xr = x + r * x_row_stride;
    // Separate loops per form keep the branch out of the inner loop.
    if (approx == GeluApprox::Tanh) {
      for (int64_t j = 0; j < n; ++j) {
        store<acc_t>(o + j, gelu_value<acc_t>(load<acc_t>(xr + j) + load<acc_t>(bias + j), GeluApprox::Tanh));
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        store<acc_t>(o + j, gelu_value<acc_t>(load<acc_t>(xr + j) + load<acc_t>(bias + j), GeluApprox::None));
      }
    }
  }
}

// Backward over rows [row_begin, row_end): writes dx for those rows and adds each column's sum of
// dx (in acc_t, before dx is rounded to x's dtype) to dbias_partial[j], j < n, row after row.
template <typename acc_t, typename x_t, typename bias_t>
void bias_gelu_bwd_cpu(x_t* dx, const x_t* dy, int64_t dy_row_stride, const x_t* x, int64_t x_row_stride,
                       const bias_t* bias, int64_t n, GeluApprox approx, int64_t row_begin, int64_t row_end,
                       acc_t* dbias_partial) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    x_t* d = dx + r * n;
    const x_t* dyr = dy + r * dy_row_stride;
    const x_t* xr = x + r * x_row_stride;
    if (approx == GeluApprox::Tanh) {
      for (int64_t j = 0; j < n; ++j) {
        const acc_t z = load<acc_t>(xr + j) + load<acc_t>(bias + j);
        const acc_t g = load<acc_t>(dyr + j) * gelu_derivative<acc_t>(z, GeluApprox::Tanh);
        store<acc_t>(d + j, g);
        dbias_partial[j] += g;
      }
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const acc_t z = load<acc_t>(xr + j) + load<acc_t>(bias + j);
        const acc_t g = load<acc_t>(dyr + j) * gelu_derivative<acc_t>(z, GeluApprox::None);
        store<acc_t>(d + j, g);
        dbias_partial[j] += g;
      }
    }
  }
}

// The second pass of dbias: dbias[j] = sum over c < chunks of partials[c * n + j], summed in chunk
// order (deterministic), for columns [col_begin, col_end); rounded once to bias's dtype.
template <typename acc_t, typename bias_t>
void bias_gelu_reduce_partials_cpu(bias_t* dbias, const acc_t* partials, int64_t chunks, int64_t n,
                                   int64_t col_begin, int64_t col_end) {
  for (int64_t j = col_begin; j < col_end; ++j) {
    acc_t sum = 0;
    for (int64_t c = 0; c < chunks; ++c) sum += partials[c * n + j];
    store<acc_t>(dbias + j, sum);
  }
}

// Rows per chunk of the backward: each chunk owns one row of fp32/fp64 partial sums. Depends on the
// shape only (not on the thread count), so the summation order, hence dbias, is reproducible.
inline int64_t bias_gelu_bwd_rows_per_chunk(int64_t rows, int64_t n) {
  constexpr int64_t kChunkElements = 32768;  // work per chunk
  constexpr int64_t kMaxChunks = 256;        // bounds the partial buffer: kMaxChunks * n
  const int64_t by_work = n > 0 ? (kChunkElements + n - 1) / n : rows;
  const int64_t by_count = (rows + kMaxChunks - 1) / kMaxChunks;
  const int64_t per_chunk = by_work > by_count ? by_work : by_count;
  return per_chunk > 0 ? per_chunk : 1;
}

}  // namespace revkernels
