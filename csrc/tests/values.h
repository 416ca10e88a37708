// Value helpers shared by the torch-free kernel tests: each storage type's dtype facts, bit
// patterns, conversion through double, and a NaN sentinel that marks elements a kernel has not written.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/scalar.h"

namespace rktest {

// ulp: the spacing at 1 (relative precision); rounding: half of it; subnormal: half the smallest
// subnormal spacing (the absolute rounding error near zero).
template <typename T> struct Traits;
#define RK_TRAITS(T, KIND, ULP, SUBNORMAL)                                  \
  template <> struct Traits<T> {                                            \
    static constexpr revkernels::ScalarKind kind = revkernels::ScalarKind::KIND; \
    static constexpr const char* name = #T;                                 \
    static constexpr double ulp = ULP;                                      \
    static constexpr double rounding = ULP / 2;                             \
    static constexpr double subnormal = SUBNORMAL;                          \
  };
RK_TRAITS(float, Float32, 0x1p-23, 0x1p-150)
RK_TRAITS(double, Float64, 0x1p-52, 0x1p-1074)
RK_TRAITS(revkernels::Half, Float16, 0x1p-10, 0x1p-25)
RK_TRAITS(revkernels::BFloat16, BFloat16, 0x1p-7, 0x1p-134)
#undef RK_TRAITS

template <typename T> uint64_t bits_of(const T& v) {
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T> bool same_bits(const T& a, const T& b) { return bits_of(a) == bits_of(b); }
template <typename T> double to_double(const T& v) { return revkernels::load<double>(&v); }
template <typename T> T from_double(double d) {
  T t;
  revkernels::store<double>(&t, d);
  return t;
}
template <typename T> T sentinel() { return from_double<T>(std::numeric_limits<double>::quiet_NaN()); }

}  // namespace rktest
