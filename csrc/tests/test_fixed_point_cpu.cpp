// Unit test of the torch-free fixed-point kernels (kernels/fixed_point.h) against independent
// arithmetic: q(f) = round_half_even(f * 2^b) formed in double with floor and an explicit tie rule
// (every 16-bit value exhaustively, random fp32 / fp64 bit patterns, the specials); view(X) from X
// rounded to 24 (53) bits with integer arithmetic; the overflow flag at |Y| = 2^62 and for a branch
// value at 2^62; and fixed_point_cpu over every layout kind the op glue can hand it, in uneven
// [begin, end) chunks (each writes its range only; the call's flag is the OR of the chunks').
#include <algorithm>
#include <array>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/fixed_point.h"
#include "tests/check.h"
#include "tests/values.h"

using namespace rktest;

namespace {

using namespace revkernels;

constexpr int kBits[] = {1, 10, 32, 60};

// (q, bad) of the value v of type T, independently: v * 2^bits is exact in double for every T
// (float's and the 16-bit formats' values times 2^60 stay far inside double's range).
template <typename T>
std::pair<int64_t, bool> quantize_exact(double v, int bits) {
  double scaled = std::ldexp(v, bits);
  if constexpr (!std::is_same_v<T, double>) {
    // Formed in float: a product beyond float's range is inf there (and flagged either way).
    if (std::fabs(scaled) > std::numeric_limits<float>::max()) scaled = std::copysign(INFINITY, scaled);
  }
  if (!(std::fabs(scaled) < 0x1p62)) return {0, true};
  const double low = std::floor(scaled), rest = scaled - low;  // exact: |scaled| < 2^62
  auto q = static_cast<int64_t>(low);
  if (rest > 0.5 || (rest == 0.5 && (q & 1) != 0)) ++q;
  return {q, false};
}

// n rounded to `precision` significant bits, half to even (integer arithmetic only).
int64_t rounded_to_bits(int64_t n, int precision) {
  const uint64_t magnitude = n < 0 ? 0 - static_cast<uint64_t>(n) : static_cast<uint64_t>(n);
  int length = 0;
  while (length < 64 && (magnitude >> length) != 0) ++length;
  const int drop = length - precision;
  if (drop <= 0) return n;
  uint64_t q = magnitude >> drop;
  const uint64_t rest = magnitude & ((uint64_t(1) << drop) - 1), half = uint64_t(1) << (drop - 1);
  if (rest > half || (rest == half && (q & 1) != 0)) ++q;
  const double value = std::ldexp(static_cast<double>(q), drop);  // q has at most precision + 1 bits: exact
  return static_cast<int64_t>(n < 0 ? -value : value);  // (never 2^63: inputs here stay below 2^62)
}

// view(n) in view_t, from n rounded once to float's (double's) precision and scaled exactly.
template <typename view_t>
view_t view_exact(int64_t n, int bits) {
  const int precision = std::is_same_v<view_t, double> ? 53 : 24;
  return from_double<view_t>(std::ldexp(static_cast<double>(rounded_to_bits(n, precision)), -bits));
}

template <typename T>
void check_quantize_value(T value, int bits) {
  const FixedPointScales s = fixed_point_scales(bits);
  bool bad = false;
  const int64_t q = fixed_point_quantize(&value, s, bad);
  const auto [want, want_bad] = quantize_exact<T>(to_double(value), bits);
  RK_CHECK(q == want && bad == want_bad, "%s %.17g, bits %d: q = %" PRId64 " (bad %d), expected %" PRId64 " (bad %d)",
           Traits<T>::name, to_double(value), bits, q, int(bad), want, int(want_bad));
}

template <typename T>
T from_bits(uint64_t u) {
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}

void check_quantize(std::mt19937_64& rng) {
  for (int bits : kBits) {
    for (uint32_t u = 0; u < 0x10000; ++u) {  // every 16-bit value
      check_quantize_value(from_bits<Half>(u), bits);
      check_quantize_value(from_bits<BFloat16>(u), bits);
    }
    for (int i = 0; i < 100000; ++i) {  // random fp32 / fp64 bit patterns (every exponent, NaNs, infs)
      check_quantize_value(from_bits<float>(rng() & 0xFFFFFFFFu), bits);
      check_quantize_value(from_bits<double>(rng()), bits);
    }
    // Ties (k + 1/2) * 2^-bits round to even; the values around 2^62 / 2^bits.
    for (double k : {0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 1048575.5, -1048576.5}) {
      check_quantize_value(static_cast<float>(std::ldexp(k, -bits)), bits);
      check_quantize_value(std::ldexp(k, -bits), bits);
    }
    const double edge = std::ldexp(1.0, 62 - bits);
    for (double v : {edge, -edge, std::nextafter(edge, 0.0), -std::nextafter(edge, 0.0)}) check_quantize_value(v, bits);
    for (float v : {static_cast<float>(edge), std::nextafter(static_cast<float>(edge), 0.0f)}) check_quantize_value(v, bits);
  }
}

template <typename view_t>
void check_view_values(const std::vector<int64_t>& values) {
  for (int bits : kBits) {
    const FixedPointScales s = fixed_point_scales(bits);
    for (int64_t n : values) {
      view_t got;
      fixed_point_store_view(&got, n, s);
      const view_t want = view_exact<view_t>(n, bits);
      RK_CHECK(same_bits(got, want), "view<%s>(%" PRId64 ", bits %d) = %.17g, expected %.17g", Traits<view_t>::name, n,
               bits, to_double(got), to_double(want));
    }
  }
}

void check_views(std::mt19937_64& rng) {
  // 2^60 + 2^36 + 1 is nearest 2^60 + 2^37 in float; through double (2^60 + 2^36, a tie) it would be 2^60.
  std::vector<int64_t> values = {0, 1, -1, 3, (int64_t(1) << 60) + (int64_t(1) << 36) + 1,
                                 -((int64_t(1) << 60) + (int64_t(1) << 36) + 1), (int64_t(1) << 53) + 1,
                                 (int64_t(1) << 24) + 1, (int64_t(1) << 62) - 1, -(int64_t(1) << 62) + 1};
  for (int i = 0; i < 20000; ++i) {
    const int shift = static_cast<int>(rng() % 62);
    values.push_back(static_cast<int64_t>(rng() >> (2 + shift)) * (rng() & 1 ? -1 : 1));
  }
  check_view_values<float>(values);
  check_view_values<double>(values);
  check_view_values<Half>(values);
  check_view_values<BFloat16>(values);
}

// Elements at the limit: flagged at |Y| >= 2^62 only; q = 0 where the branch value is flagged.
void check_flags() {
  const int64_t limit = kFixedPointLimit;
  const int bits = 32;
  const FixedPointScales s = fixed_point_scales(bits);
  const float one = 0x1p-32f;  // q = 1
  struct Case {
    FixedPointOp op;
    int64_t x;
    float f;
    int64_t want;
    bool flagged;
  };
  const Case cases[] = {
      {FixedPointOp::Add, limit - 1, one, limit, true},        {FixedPointOp::Add, limit - 2, one, limit - 1, false},
      {FixedPointOp::Sub, -limit + 1, one, -limit, true},      {FixedPointOp::Sub, -limit + 2, one, -limit + 1, false},
      {FixedPointOp::Add, 5, INFINITY, 5, true},               {FixedPointOp::Sub, 5, -INFINITY, 5, true},
      {FixedPointOp::Add, 5, NAN, 5, true},                    {FixedPointOp::FromFloat, 0, 0x1p30f, 0, true},
      {FixedPointOp::FromFloat, 0, 0x1.fffffep29f, int64_t(0xFFFFFF) << 38, false},
  };
  for (const Case& c : cases) {
    int64_t out = 0;
    float view = 0;
    bool flagged = false;
    if (c.op == FixedPointOp::Add) flagged = fixed_point_element<FixedPointOp::Add>(&out, &view, &c.x, &c.f, s);
    if (c.op == FixedPointOp::Sub) flagged = fixed_point_element<FixedPointOp::Sub>(&out, &view, &c.x, &c.f, s);
    if (c.op == FixedPointOp::FromFloat) {
      flagged = fixed_point_element<FixedPointOp::FromFloat>(&out, &view, nullptr, &c.f, s);
    }
    RK_CHECK(out == c.want && flagged == c.flagged, "op %d, x %" PRId64 ", f %g: %" PRId64 " (flag %d), expected %" PRId64
             " (flag %d)", int(c.op), c.x, double(c.f), out, int(flagged), c.want, int(c.flagged));
  }
}

// A layout of the iteration space: per dim {size, x stride, f stride}, outermost first.
struct Case {
  const char* name;
  CouplingLayout layout;
  int64_t numel = 1, x_span = 1, f_span = 1;  // (the spans: the elements each input buffer needs)
};

Case make_case(const char* name, std::vector<std::array<int64_t, 3>> dims) {
  Case c{name, {}};
  c.layout.ndim = static_cast<int>(dims.size());
  for (size_t d = 0; d < dims.size(); ++d) {
    const auto [size, x_stride, f_stride] = dims[d];
    c.layout.sizes[d] = size;
    c.layout.a_strides[d] = x_stride;
    c.layout.b_strides[d] = f_stride;
    c.numel *= size;
    c.x_span += (size - 1) * x_stride;
    c.f_span += (size - 1) * f_stride;
  }
  return c;
}

// [0, n) cut into chunks of random sizes (some empty), in a random order: as threads would run it.
std::vector<std::pair<int64_t, int64_t>> random_chunks(int64_t n, int64_t largest, std::mt19937_64& rng) {
  std::vector<std::pair<int64_t, int64_t>> chunks;
  std::uniform_int_distribution<int64_t> size(0, largest);
  for (int64_t begin = 0; begin < n;) {
    const int64_t end = std::min(n, begin + size(rng));
    chunks.emplace_back(begin, end);
    begin = end;
  }
  std::shuffle(chunks.begin(), chunks.end(), rng);
  return chunks;
}

// fixed_point_cpu through dispatch_fixed_point, as the CPU kernels call it.
template <typename f_t, typename view_t>
bool run_kernel(FixedPointOp op, int64_t* out, view_t* view, const int64_t* x, const f_t* f, int bits,
                const CouplingLayout& layout, int64_t begin, int64_t end) {
  const ScalarKind f_kind = op == FixedPointOp::View ? Traits<view_t>::kind : Traits<f_t>::kind;
  return dispatch_fixed_point(op, f_kind, Traits<view_t>::kind, [&](auto op_tag, auto f_tag, auto view_tag) {
    using F = typename decltype(f_tag)::type;
    using V = typename decltype(view_tag)::type;
    constexpr FixedPointOp kOp = decltype(op_tag)::value;
    if constexpr (std::is_same_v<V, view_t> && (kOp == FixedPointOp::View || std::is_same_v<F, f_t>)) {
      RK_CHECK(kOp == op, "dispatched op %d for %d", int(kOp), int(op));
      return fixed_point_cpu<kOp>(out, view, x, reinterpret_cast<const F*>(f), bits, layout, begin, end);
    } else {
      RK_CHECK(false, "op %d, f %s, view %s: dispatched other types", int(op), Traits<f_t>::name, Traits<view_t>::name);
      return false;
    }
  });
}

template <typename f_t, typename view_t>
void check_layout(const Case& c, FixedPointOp op, std::mt19937_64& rng) {
  if (op == FixedPointOp::FromFloat && !std::is_same_v<f_t, view_t>) return;  // its view is in f's dtype
  const int bits = 20;
  std::uniform_real_distribution<double> mantissa(-4.0, 4.0);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<int64_t> x(c.x_span);
  std::vector<f_t> f(c.f_span);
  for (auto& v : x) v = static_cast<int64_t>(rng() >> 3) - (int64_t(1) << 60);
  for (auto& v : f) v = from_double<f_t>(std::ldexp(mantissa(rng), exponent(rng)));
  if (c.f_span > 3) f[c.f_span / 2] = from_double<f_t>(NAN);  // one flagged value (where the layout reads it)

  std::vector<int64_t> want(c.numel);
  std::vector<view_t> want_view(c.numel);
  bool want_flag = false;
  for (int64_t i = 0; i < c.numel; ++i) {
    int64_t xo, fo;
    layout_offsets(c.layout, i, xo, fo);
    const auto [q, bad] = quantize_exact<f_t>(to_double(f[fo]), bits);
    const uint64_t sum = op == FixedPointOp::Add   ? static_cast<uint64_t>(x[xo]) + static_cast<uint64_t>(q)
                         : op == FixedPointOp::Sub ? static_cast<uint64_t>(x[xo]) - static_cast<uint64_t>(q)
                         : op == FixedPointOp::View ? static_cast<uint64_t>(x[xo]) : static_cast<uint64_t>(q);
    want[i] = static_cast<int64_t>(sum);
    want_view[i] = view_exact<view_t>(want[i], bits);
    if (op != FixedPointOp::View) want_flag = want_flag || bad || fixed_point_out_of_range(want[i]);
  }
  const int64_t sentinel_int = 0x5EED;
  auto compare = [&](const std::vector<int64_t>& out, const std::vector<view_t>& view, int64_t begin, int64_t end,
                     const char* how) {
    for (int64_t i = 0; i < c.numel; ++i) {
      const bool inside = begin <= i && i < end;
      const bool written = inside && op != FixedPointOp::View;
      RK_CHECK(out[i] == (written ? want[i] : sentinel_int), "%s, op %d, f %s: %s, out[%" PRId64 "] = %" PRId64
               ", expected %" PRId64, c.name, int(op), Traits<f_t>::name, how, i, out[i], written ? want[i] : sentinel_int);
      const view_t expect = inside ? want_view[i] : sentinel<view_t>();
      RK_CHECK(same_bits(view[i], expect), "%s, op %d, f %s, view %s: %s, view[%" PRId64 "] = %.17g, expected %.17g",
               c.name, int(op), Traits<f_t>::name, Traits<view_t>::name, how, i, to_double(view[i]), to_double(expect));
    }
  };
  std::vector<int64_t> out(c.numel, sentinel_int);
  std::vector<view_t> view(c.numel, sentinel<view_t>());
  const bool flag = run_kernel(op, out.data(), view.data(), x.data(), f.data(), bits, c.layout, 0, c.numel);
  compare(out, view, 0, c.numel, "full call");
  RK_CHECK(flag == want_flag, "%s, op %d: flag %d, expected %d", c.name, int(op), int(flag), int(want_flag));

  // Uneven chunks; the flags OR-ed.
  for (int64_t largest : {int64_t(1), c.numel / 3 + 1, c.numel}) {
    std::vector<int64_t> split(c.numel, sentinel_int);
    std::vector<view_t> split_view(c.numel, sentinel<view_t>());
    bool any = false;
    for (const auto& [begin, end] : random_chunks(c.numel, largest, rng)) {
      any |= run_kernel(op, split.data(), split_view.data(), x.data(), f.data(), bits, c.layout, begin, end);
    }
    compare(split, split_view, 0, c.numel, "chunked call");
    RK_CHECK(any == want_flag, "%s, op %d: chunked flag %d, expected %d", c.name, int(op), int(any), int(want_flag));
  }
  // One chunk writes its range and nothing else (end < begin: a no-op).
  std::uniform_int_distribution<int64_t> pos(0, c.numel);
  for (int trial = 0; trial < 4; ++trial) {
    const int64_t begin = pos(rng), end = pos(rng);
    std::vector<int64_t> part(c.numel, sentinel_int);
    std::vector<view_t> part_view(c.numel, sentinel<view_t>());
    run_kernel(op, part.data(), part_view.data(), x.data(), f.data(), bits, c.layout, begin, end);
    compare(part, part_view, begin, end, "one chunk");
  }
}

template <typename f_t, typename view_t>
void check_layouts(const std::vector<Case>& cases, std::mt19937_64& rng) {
  for (const Case& c : cases) {
    for (FixedPointOp op : {FixedPointOp::FromFloat, FixedPointOp::Add, FixedPointOp::Sub, FixedPointOp::View}) {
      check_layout<f_t, view_t>(c, op, rng);
    }
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(11);
  check_quantize(rng);
  check_views(rng);
  check_flags();
  // (FromFloat and View read one input: the glue passes its strides as both.)
  const std::vector<Case> cases = {
      make_case("contiguous 1-D", {{1000, 1, 1}}),
      make_case("strided 1-D", {{257, 3, 2}}),
      make_case("2-D, x transposed", {{37, 1, 53}, {53, 37, 1}}),
      make_case("2-D, f broadcast (stride 0) in the inner dim", {{8, 9, 1}, {9, 1, 0}}),
      make_case("3-D, x broadcast in the middle", {{4, 6, 30}, {5, 0, 6}, {6, 1, 1}}),
      make_case("4-D permuted", {{3, 1, 40}, {4, 30, 10}, {5, 6, 2}, {2, 3, 1}}),
      make_case("ndim 0 (one element)", {}),
  };
  // (branch value, view) dtypes: each alike, and mixed pairs
  check_layouts<float, float>(cases, rng), check_layouts<double, double>(cases, rng);
  check_layouts<Half, Half>(cases, rng), check_layouts<BFloat16, BFloat16>(cases, rng);
  check_layouts<BFloat16, float>(cases, rng), check_layouts<float, Half>(cases, rng);
  check_layouts<double, BFloat16>(cases, rng), check_layouts<Half, double>(cases, rng);
  return rktest::finish("test_fixed_point_cpu");
}
