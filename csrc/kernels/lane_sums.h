// Long sums of the torch-free CPU kernels (a LayerNorm row, a BatchNorm channel): the terms are
// carried in kSumLanes independent acc_t partial sums (the loop vectorises without -ffast-math),
// folded pairwise and added into an fp64 total every kSumChunk terms per lane, so no acc_t running
// sum takes more than kSumChunk terms and the rounding error does not grow with the length. The
// vector kernels (cpu/vec_kernels.cpp) chunk their blocks of lanes alike.
#pragma once

#include <cmath>
#include <cstdint>

namespace revkernels {

constexpr int64_t kSumLanes = 8;
constexpr int64_t kSumChunk = 64;

// The shift of a mean's sum (a row's or channel's first value): the terms x - pivot of a constant
// row or channel are exact zeros and its mean is the value itself (a rounded mean would be an error
// of its own, times rstd, up to 1 / sqrt(eps)). 0 for a non-finite first value (inf - inf is NaN).
template <typename acc_t>
inline acc_t stats_pivot(acc_t first) {
  return std::isfinite(first) ? first : acc_t(0);
}

// total += the sum of the lanes (folded pairwise); the lanes reset to zero.
template <typename acc_t>
inline void flush_lanes(double& total, acc_t (&lanes)[kSumLanes]) {
  for (int64_t width = kSumLanes / 2; width > 0; width /= 2) {
    for (int64_t lane = 0; lane < width; ++lane) lanes[lane] += lanes[lane + width];
  }
  total += lanes[0];
  for (acc_t& lane : lanes) lane = acc_t(0);
}

// fn(i, lane) for i in [0, n), in blocks of kSumLanes with lane = the offset in the block;
// flush() after every kSumChunk blocks and at the end.
template <typename Fn, typename Flush>
inline void for_each_lane(int64_t n, Fn&& fn, Flush&& flush) {
  int64_t i = 0, blocks = 0;
  for (; i + kSumLanes <= n; i += kSumLanes) {
    for (int64_t lane = 0; lane < kSumLanes; ++lane) fn(i + lane, lane);
    if (++blocks == kSumChunk) {
      flush();
      blocks = 0;
    }
  }
  for (int64_t lane = 0; i < n; ++i, ++lane) fn(i, lane);
  flush();
}

// sum_{i < n} term(i), summed in acc_t lanes and fp64 chunks.
template <typename acc_t, typename Fn>
inline double lane_sum(int64_t n, Fn&& term) {
  double total = 0.0;
  acc_t lanes[kSumLanes] = {};
  for_each_lane(n, [&](int64_t i, int64_t lane) { lanes[lane] += term(i); }, [&] { flush_lanes(total, lanes); });
  return total;
}

}  // namespace revkernels
