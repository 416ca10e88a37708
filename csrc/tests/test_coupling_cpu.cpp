// Unit test of the torch-free CPU coupling kernel revkernels::coupling_axpy_cpu (kernels/coupling.h)
// against a naive loop in double: every layout kind the op glue can hand it (dense, transposed,
// broadcast, non-dense, zero-dim), uneven [begin, end) splits, and mixed out/b dtypes.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/coupling.h"
#include "tests/check.h"
#include "tests/values.h"

using namespace rktest;

namespace {

using namespace revkernels;



struct Case {
  const char* name;
  CouplingLayout layout;
  int64_t numel = 1;
  int64_t a_span = 1, b_span = 1;  // elements each input buffer needs
};

Case make_case(const char* name, std::initializer_list<int64_t> sizes, std::initializer_list<int64_t> a_strides,
               std::initializer_list<int64_t> b_strides) {
  Case c{name, {}};
  c.layout.ndim = static_cast<int>(sizes.size());
  for (int d = 0; d < c.layout.ndim; ++d) {
    c.layout.sizes[d] = sizes.begin()[d];
    c.layout.a_strides[d] = a_strides.begin()[d];
    c.layout.b_strides[d] = b_strides.begin()[d];
    c.numel *= c.layout.sizes[d];
    c.a_span += (c.layout.sizes[d] - 1) * c.layout.a_strides[d];
    c.b_span += (c.layout.sizes[d] - 1) * c.layout.b_strides[d];
  }
  return c;
}

// Offsets of element `linear` (row-major over the layout) in a and b.
void offsets(const CouplingLayout& layout, int64_t linear, int64_t* a_off, int64_t* b_off) {
  *a_off = *b_off = 0;
  for (int d = layout.ndim - 1; d >= 0; --d) {
    const int64_t i = linear % layout.sizes[d];
    linear /= layout.sizes[d];
    *a_off += i * layout.a_strides[d];
    *b_off += i * layout.b_strides[d];
  }
}

// Runs the kernel through dispatch_float_pair, as the op glue does, checking the dispatched types.
template <typename out_t, typename b_t>
void run_kernel(out_t* out, const out_t* a, const b_t* b, double alpha, const CouplingLayout& layout,
                int64_t begin, int64_t end) {
  constexpr bool acc_double = std::is_same_v<out_t, double> || std::is_same_v<b_t, double>;
  using want_acc = std::conditional_t<acc_double, double, float>;
  dispatch_float_pair(Traits<out_t>::kind, Traits<b_t>::kind, [&](auto acc_tag, auto out_tag, auto b_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    if constexpr (std::is_same_v<typename decltype(out_tag)::type, out_t> &&
                  std::is_same_v<typename decltype(b_tag)::type, b_t>) {
      RK_CHECK((std::is_same_v<acc_t, want_acc>), "out %s, b %s: dispatched the wrong accumulation type",
               Traits<out_t>::name, Traits<b_t>::name);
      coupling_axpy_cpu<acc_t>(out, a, b, static_cast<acc_t>(alpha), layout, begin, end);
    } else {
      RK_CHECK(false, "out %s, b %s: dispatched other data types", Traits<out_t>::name, Traits<b_t>::name);
    }
  });
}

template <typename out_t, typename b_t>
void check_case(const Case& c, double alpha, std::mt19937_64& rng) {
  // Random non-zero values over a few binades, so rounding in every format is exercised.
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  std::uniform_int_distribution<int> exponent(-6, 6);
  auto random_value = [&] { return (rng() & 1 ? -1 : 1) * std::ldexp(mantissa(rng), exponent(rng)); };
  std::vector<out_t> a(c.a_span);
  std::vector<b_t> b(c.b_span);
  for (auto& v : a) v = from_double<out_t>(random_value());
  for (auto& v : b) v = from_double<b_t>(random_value());

  // Reference: the sum in double, rounded to the accumulation type (float unless either input is
  // double), then stored in out's dtype. For float data, rounding the double sum to float is the
  // correctly rounded float sum (53 >= 2 * 24 + 2), i.e. what the kernel's float arithmetic gives.
  constexpr bool acc_double = std::is_same_v<out_t, double> || std::is_same_v<b_t, double>;
  std::vector<out_t> want(c.numel);
  for (int64_t i = 0; i < c.numel; ++i) {
    int64_t ao, bo;
    offsets(c.layout, i, &ao, &bo);
    double sum = to_double(a[ao]) + alpha * to_double(b[bo]);
    if (!acc_double) sum = static_cast<float>(sum);
    want[i] = from_double<out_t>(sum);
  }
  auto compare = [&](const std::vector<out_t>& got, int64_t begin, int64_t end, const char* how) {
    for (int64_t i = 0; i < c.numel; ++i) {
      const bool inside = begin <= i && i < end;
      const uint64_t expect = inside ? bits_of(want[i]) : bits_of(sentinel<out_t>());
      RK_CHECK(bits_of(got[i]) == expect,
               "%s, out %s, b %s, alpha %g, %s [%" PRId64 ", %" PRId64 "): element %" PRId64
               " = %.17g, expected %.17g%s",
               c.name, Traits<out_t>::name, Traits<b_t>::name, alpha, how, begin, end, i, to_double(got[i]),
               to_double(inside ? want[i] : sentinel<out_t>()), inside ? "" : " (outside the range: untouched)");
    }
  };

  // One call over everything.
  std::vector<out_t> out(c.numel, sentinel<out_t>());
  run_kernel(out.data(), a.data(), b.data(), alpha, c.layout, 0, c.numel);
  compare(out, 0, c.numel, "full call");

  // Uneven chunks (some empty) in a shuffled order, as threads would run them.
  for (int trial = 0; trial < 4; ++trial) {
    std::vector<int64_t> cuts{0, c.numel};
    std::uniform_int_distribution<int64_t> cut(0, c.numel);
    for (int k = 0; k < 1 + trial * 3; ++k) cuts.push_back(cut(rng));
    std::sort(cuts.begin(), cuts.end());
    std::vector<size_t> order(cuts.size() - 1);
    for (size_t k = 0; k < order.size(); ++k) order[k] = k;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<out_t> split(c.numel, sentinel<out_t>());
    for (size_t k : order) run_kernel(split.data(), a.data(), b.data(), alpha, c.layout, cuts[k], cuts[k + 1]);
    compare(split, 0, c.numel, "chunked call");
  }

  // A single chunk writes its range and nothing else (end < begin too: a no-op).
  std::uniform_int_distribution<int64_t> pos(0, c.numel);
  for (int trial = 0; trial < 6; ++trial) {
    const int64_t begin = pos(rng), end = pos(rng);
    std::vector<out_t> part(c.numel, sentinel<out_t>());
    run_kernel(part.data(), a.data(), b.data(), alpha, c.layout, begin, end);
    compare(part, begin, end, "one chunk");
  }
}

template <typename out_t, typename b_t>
void check_types(const std::vector<Case>& cases, std::mt19937_64& rng) {
  for (const Case& c : cases) {
    for (double alpha : {-1.0, 1.0}) check_case<out_t, b_t>(c, alpha, rng);
  }
}

}  // namespace

int main() {
  const std::vector<Case> cases = {
      make_case("contiguous 1-D", {1000}, {1}, {1}),
      make_case("strided 1-D", {257}, {3}, {2}),
      make_case("2-D, a transposed", {37, 53}, {1, 37}, {53, 1}),
      make_case("2-D, b transposed", {37, 53}, {53, 1}, {1, 37}),
      make_case("2-D, both transposed", {37, 53}, {1, 37}, {1, 37}),
      make_case("2-D, b broadcast (stride 0) in the inner dim", {8, 9}, {9, 1}, {1, 0}),
      make_case("3-D, b broadcast (stride 0) in the middle", {4, 5, 6}, {30, 6, 1}, {6, 0, 1}),
      make_case("3-D, a broadcast in the inner dim", {4, 5, 6}, {5, 1, 0}, {30, 6, 1}),
      make_case("3-D, a padded rows, b broadcast outer", {3, 7, 9}, {70, 10, 1}, {0, 9, 1}),
      make_case("4-D permuted", {3, 4, 5, 2}, {1, 30, 6, 3}, {40, 10, 2, 1}),
      make_case("size-1 inner dim", {6, 1}, {1, 7}, {1, 0}),
      make_case("ndim 0 (one element)", {}, {}, {}),
  };
  std::mt19937_64 rng(7);
  check_types<float, float>(cases, rng);
  check_types<double, double>(cases, rng);
  check_types<Half, Half>(cases, rng);
  check_types<BFloat16, BFloat16>(cases, rng);
  check_types<BFloat16, float>(cases, rng);
  check_types<float, Half>(cases, rng);
  check_types<float, BFloat16>(cases, rng);
  check_types<Half, float>(cases, rng);
  check_types<BFloat16, Half>(cases, rng);
  check_types<double, float>(cases, rng);
  check_types<float, double>(cases, rng);
  check_types<Half, double>(cases, rng);
  return rktest::finish("test_coupling_cpu");
}
