// Torch-free fixed-point coupling kernels: the exact mode's int64 streams (math and semantics:
// revkernels/ops/fixed_point.py), one pass per call. With b the fraction bits:
//   q(f)     = round_half_even(f * 2^b) as int64, formed in f's accumulation type (double for
//              double data, float otherwise: f * 2^b is exact there); 0 where not |f * 2^b| < 2^62
//              (too large, inf or NaN), which flags the call
//   view(X)  = view_t(float(X) * 2^-b) (double(X) for a double view); float(X) and double(X) are X
//              correctly rounded, as one int64 -> float conversion rounds (never through double)
//   from_float  X = q(f), view in f's dtype      add  Y = X + q(f)      sub  X = Y - q(f)
//   view        view(X) only (no stream written, no flag)
// A result with |Y| >= 2^62 flags the call too. The sums wrap as two's complement (inputs with
// |X| < 2^62, the streams' invariant, never do). Iteration as the coupling kernels (coupling.h):
// `out` and `view` dense in the iteration order, `x` (the layout's a strides) and `f` (its b
// strides) strided views of the same shape.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "coupling.h"

#if defined(__x86_64__) && !defined(__CUDACC__)
#include <emmintrin.h>
#endif

namespace revkernels {

enum class FixedPointOp : int { FromFloat = 0, Add = 1, Sub = 2, View = 3 };

constexpr int kFixedPointMinBits = 1;
constexpr int kFixedPointMaxBits = 60;
constexpr int64_t kFixedPointLimit = int64_t(1) << 62;  // |X| < this for every value kept

// 2^bits and 2^-bits in float and double (exact: bits is in [1, 60]), and the limit 2^62 in both.
struct FixedPointScales {
  float up_f, down_f;
  double up_d, down_d;
};

RK_HOST_DEVICE inline double pow2_double(int e) {  // 2^e for e in double's normal exponent range
  const uint64_t u = static_cast<uint64_t>(1023 + e) << 52;
  double d;
  memcpy(&d, &u, sizeof(d));
  return d;
}

RK_HOST_DEVICE inline FixedPointScales fixed_point_scales(int bits) {
  return {bits_float(static_cast<uint32_t>(127 + bits) << 23), bits_float(static_cast<uint32_t>(127 - bits) << 23),
          pow2_double(bits), pow2_double(-bits)};
}

// The accumulation type of a branch value of type f_t: double for double, float otherwise.
template <typename f_t>
using fixed_point_acc_t = std::conditional_t<std::is_same_v<f_t, double>, double, float>;

template <typename acc_t>
RK_HOST_DEVICE inline acc_t fixed_point_up(const FixedPointScales& s) {
  if constexpr (std::is_same_v<acc_t, double>) {
    return s.up_d;
  } else {
    return s.up_f;
  }
}

// round_half_even(v) as int64, for |v| < 2^62 (on the host in the current rounding mode: to
// nearest even, as torch.round's std::nearbyint rounds; x86-64 converts inline, llrint is a call).
template <typename acc_t>
RK_HOST_DEVICE inline int64_t round_to_int64(acc_t v) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<acc_t, double>) {
    return __double2ll_rn(v);
  } else {
    return __float2ll_rn(v);
  }
#elif defined(__x86_64__) && !defined(__CUDACC__)
  if constexpr (std::is_same_v<acc_t, double>) {
    return _mm_cvtsd_si64(_mm_set_sd(v));
  } else {
    return _mm_cvtss_si64(_mm_set_ss(v));
  }
#else
  return static_cast<int64_t>(std::llrint(v));
#endif
}

// q(*f); sets `bad` (and returns 0) where not |f * 2^b| < 2^62.
template <typename f_t>
RK_HOST_DEVICE inline int64_t fixed_point_quantize(const f_t* f, const FixedPointScales& s, bool& bad) {
  using acc_t = fixed_point_acc_t<f_t>;
  const acc_t scaled = load<acc_t>(f) * fixed_point_up<acc_t>(s);  // a power of two: exact
  const bool fits = (scaled < 0 ? -scaled : scaled) < static_cast<acc_t>(kFixedPointLimit);  // false for NaN
  bad = !fits;
  return fits ? round_to_int64(scaled) : 0;
}

// view(x) stored to *p.
template <typename view_t>
RK_HOST_DEVICE inline void fixed_point_store_view(view_t* p, int64_t x, const FixedPointScales& s) {
  if constexpr (std::is_same_v<view_t, double>) {
    *p = static_cast<double>(x) * s.down_d;
  } else {
    store<float>(p, static_cast<float>(x) * s.down_f);  // int64 -> float rounds once
  }
}

// Whether |x| >= 2^62 (INT64_MIN included).
RK_HOST_DEVICE inline bool fixed_point_out_of_range(int64_t x) {
  return x >= kFixedPointLimit || x <= -kFixedPointLimit;
}

// One element of `op`: writes *out (not for View) and *view; returns whether it overflowed. `x` is
// unused by FromFloat, `f` and `out` by View.
template <FixedPointOp op, typename f_t, typename view_t>
RK_HOST_DEVICE inline bool fixed_point_element(int64_t* out, view_t* view, const int64_t* x, const f_t* f,
                                               const FixedPointScales& s) {
  if constexpr (op == FixedPointOp::View) {
    fixed_point_store_view(view, *x, s);
    return false;
  } else {
    bool bad = false;
    const int64_t q = fixed_point_quantize(f, s, bad);
    int64_t r = q;
    if constexpr (op == FixedPointOp::Add) {
      r = static_cast<int64_t>(static_cast<uint64_t>(*x) + static_cast<uint64_t>(q));  // wraps, never UB
    } else if constexpr (op == FixedPointOp::Sub) {
      r = static_cast<int64_t>(static_cast<uint64_t>(*x) - static_cast<uint64_t>(q));
    }
    *out = r;
    fixed_point_store_view(view, r, s);
    return bad || fixed_point_out_of_range(r);
  }
}

// Calls fn(std::integral_constant<FixedPointOp, op>, TypeTag<f_t>, TypeTag<view_t>) for the
// runtime `op` and dtypes. View takes no branch value (f_t float); FromFloat's view is in f's dtype
// (view_kind ignored). Returns fn's result.
template <typename Fn>
auto dispatch_fixed_point(FixedPointOp op, ScalarKind f_kind, ScalarKind view_kind, Fn&& fn) {
  using FromFloatOp = std::integral_constant<FixedPointOp, FixedPointOp::FromFloat>;
  using AddOp = std::integral_constant<FixedPointOp, FixedPointOp::Add>;
  using SubOp = std::integral_constant<FixedPointOp, FixedPointOp::Sub>;
  using ViewOp = std::integral_constant<FixedPointOp, FixedPointOp::View>;
  switch (op) {
    case FixedPointOp::FromFloat:
      return dispatch_float_type(f_kind, [&](auto f_tag) { return fn(FromFloatOp{}, f_tag, f_tag); });
    case FixedPointOp::View:
      return dispatch_float_type(view_kind, [&](auto view_tag) { return fn(ViewOp{}, TypeTag<float>{}, view_tag); });
    case FixedPointOp::Add:
    case FixedPointOp::Sub:
      break;
  }
  return dispatch_float_type(f_kind, [&](auto f_tag) {
    return dispatch_float_type(view_kind, [&](auto view_tag) {
      return op == FixedPointOp::Add ? fn(AddOp{}, f_tag, view_tag) : fn(SubOp{}, f_tag, view_tag);
    });
  });
}

// Whether the layout is one unit-stride run (the op glue merges the dims of inputs laid out as the
// outputs into one, or none for a single element).
RK_HOST_DEVICE inline bool is_one_dense_run(const CouplingLayout& layout) {
  return layout.ndim == 0 || (layout.ndim == 1 && layout.a_strides[0] == 1 && layout.b_strides[0] == 1);
}

// Elements [begin, end) of the iteration space (a linear index into `out` and `view`); returns
// whether one of them overflowed.
template <FixedPointOp op, typename f_t, typename view_t>
bool fixed_point_cpu(int64_t* out, view_t* view, const int64_t* x, const f_t* f, int bits,
                     const CouplingLayout& layout, int64_t begin, int64_t end) {
  const FixedPointScales s = fixed_point_scales(bits);
  const int nd = layout.ndim;
  const int64_t a_inner = nd > 0 ? layout.a_strides[nd - 1] : 0;
  const int64_t b_inner = nd > 0 ? layout.b_strides[nd - 1] : 0;
  bool flag = false;
  for_each_layout_run(layout, begin, end, [&](int64_t linear, int64_t a_off, int64_t b_off, int64_t run) {
    int64_t* o = op == FixedPointOp::View ? nullptr : out + linear;
    view_t* v = view + linear;
    const int64_t* px = op == FixedPointOp::FromFloat ? nullptr : x + a_off;
    const f_t* pf = op == FixedPointOp::View ? nullptr : f + b_off;
    bool run_flag = false;
    for (int64_t i = 0; i < run; ++i) {
      run_flag |= fixed_point_element<op>(o == nullptr ? nullptr : o + i, v + i,
                                          px == nullptr ? nullptr : px + i * a_inner,
                                          pf == nullptr ? nullptr : pf + i * b_inner, s);
    }
    flag = flag || run_flag;
  });
  return flag;
}

}  // namespace revkernels
