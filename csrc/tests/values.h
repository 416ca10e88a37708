// Value helpers shared by the torch-free kernel tests: bit patterns, conversion through double, and
// a NaN sentinel that marks elements a kernel has not written.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/scalar.h"

namespace rktest {

template <typename T> uint64_t bits_of(const T& v) {
  uint64_t u = 0;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}
template <typename T> double to_double(const T& v) { return revkernels::load<double>(&v); }
template <typename T> T from_double(double d) {
  T t;
  revkernels::store<double>(&t, d);
  return t;
}
template <typename T> T sentinel() { return from_double<T>(std::numeric_limits<double>::quiet_NaN()); }

}  // namespace rktest
