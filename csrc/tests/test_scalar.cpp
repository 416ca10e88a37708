// Unit test of the torch-free float16 / bfloat16 conversions in kernels/scalar.h.
//
// The reference is independent of the code under test: values are decoded from the bit layout
// with ldexp in double, and float -> 16-bit rounding is a search for the nearest of the two
// neighbouring 16-bit values (ties to the even encoding, overflow at max + half an ulp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/scalar.h"
#include "tests/check.h"

namespace {

using revkernels::bfloat16_to_float;
using revkernels::float_to_bfloat16;
using revkernels::float_to_half;
using revkernels::half_to_float;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// A 16-bit float format: `mantissa_bits` explicit mantissa bits, the rest exponent.
struct Format {
  const char* name;
  int mantissa_bits;
  int bias;
  uint16_t exponent_mask() const { return static_cast<uint16_t>(0x7FFF & ~((1u << mantissa_bits) - 1)); }
  uint16_t inf() const { return exponent_mask(); }
  bool is_nan(uint16_t v) const { return (v & 0x7FFF) > inf(); }

  // Value of a finite encoding (double holds every such value exactly).
  double value(uint16_t v) const {
    const int e = (v & 0x7FFF) >> mantissa_bits;
    const int m = v & ((1 << mantissa_bits) - 1);
    const double mag = e == 0 ? std::ldexp(m, 1 - bias - mantissa_bits)
                              : std::ldexp((1 << mantissa_bits) + m, e - bias - mantissa_bits);
    return (v & 0x8000) ? -mag : mag;
  }

  // Non-negative finite values in encoding order (which is increasing order).
  std::vector<double> table() const {
    std::vector<double> t;
    for (uint32_t v = 0; v < inf(); ++v) t.push_back(value(static_cast<uint16_t>(v)));
    return t;
  }

  // Correctly rounded encoding of a non-NaN float: nearest value, ties to even, and
  // |x| >= max + ulp(max)/2 overflows to infinity.
  uint16_t round(float f, const std::vector<double>& table) const {
    const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    const double x = std::fabs(static_cast<double>(f));
    const double max = table.back();
    const double overflow = max + std::ldexp(1.0, static_cast<int>(std::ilogb(max)) - mantissa_bits - 1);
    if (x >= overflow) return static_cast<uint16_t>(sign | inf());
    const size_t hi = std::lower_bound(table.begin(), table.end(), x) - table.begin();
    if (hi == table.size()) return static_cast<uint16_t>(sign | (hi - 1));  // between max and overflow
    if (table[hi] == x || hi == 0) return static_cast<uint16_t>(sign | hi);
    const size_t lo = hi - 1;
    const double below = x - table[lo], above = table[hi] - x;  // exact: x and the table are close
    const size_t pick = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
    return static_cast<uint16_t>(sign | pick);
  }
};

constexpr Format kHalf{"half", 10, 15};
constexpr Format kBF16{"bfloat16", 7, 127};

template <typename ToFloat>
void check_to_float_exhaustive(const Format& fmt, ToFloat to_float) {
  for (uint32_t v = 0; v <= 0xFFFF; ++v) {
    const uint16_t bits = static_cast<uint16_t>(v);
    const float f = to_float(bits);
    if (fmt.is_nan(bits)) {
      RK_CHECK(std::isnan(f), "%s 0x%04X -> float %a, expected nan", fmt.name, v, f);
    } else if ((bits & 0x7FFF) == fmt.inf()) {
      RK_CHECK(std::isinf(f) && std::signbit(f) == ((bits & 0x8000) != 0), "%s 0x%04X -> float %a, expected %cinf",
               fmt.name, v, f, (bits & 0x8000) ? '-' : '+');
    } else {
      const double want = fmt.value(bits);
      RK_CHECK(static_cast<double>(f) == want && std::signbit(f) == ((bits & 0x8000) != 0),
               "%s 0x%04X -> float %a, expected %a", fmt.name, v, f, want);
    }
  }
}

template <typename ToFloat, typename FromFloat>
void check_round_trip_exhaustive(const Format& fmt, ToFloat to_float, FromFloat from_float) {
  for (uint32_t v = 0; v <= 0xFFFF; ++v) {
    const uint16_t bits = static_cast<uint16_t>(v);
    const uint16_t back = from_float(to_float(bits));
    if (fmt.is_nan(bits)) {
      RK_CHECK(fmt.is_nan(back), "%s nan 0x%04X -> float -> 0x%04X, expected a nan", fmt.name, v, back);
    } else {
      RK_CHECK(back == bits, "%s 0x%04X -> float -> 0x%04X, expected identity", fmt.name, v, back);
    }
  }
}

template <typename FromFloat>
void check_from_float(const Format& fmt, const std::vector<double>& table, FromFloat from_float, float f) {
  const uint16_t got = from_float(f);
  if (std::isnan(f)) {
    RK_CHECK(fmt.is_nan(got), "%s: float nan 0x%08X -> 0x%04X, expected a nan", fmt.name, to_bits(f), got);
    return;
  }
  const uint16_t want = fmt.round(f, table);
  RK_CHECK(got == want, "%s: float %a (0x%08X) -> 0x%04X, expected 0x%04X", fmt.name, f, to_bits(f), got, want);
}

// Every finite 16-bit value, the midpoints to its neighbours (exact ties), the floats just either
// side of each midpoint and a random float in between; both signs. Then random float bit patterns
// over the whole float range (nan, inf, float subnormals included) and random floats in range.
template <typename FromFloat>
void check_from_float_sweep(const Format& fmt, FromFloat from_float, std::mt19937_64& rng) {
  const std::vector<double> table = fmt.table();
  for (size_t i = 0; i < table.size(); ++i) {
    // Past the largest finite value the next step is where infinity would sit.
    const double next = i + 1 < table.size() ? table[i + 1] : 2 * table[i] - table[i - 1];
    const float lo = static_cast<float>(table[i]);
    const float mid = static_cast<float>((table[i] + next) / 2);  // exact: one bit more than the format
    std::uniform_real_distribution<double> between(table[i], next);
    const float inside = static_cast<float>(std::min<double>(between(rng), std::numeric_limits<float>::max()));
    const float above = std::nextafter(mid, std::numeric_limits<float>::infinity());
    for (float f : {lo, mid, std::nextafter(mid, 0.0f), above, inside}) {
      check_from_float(fmt, table, from_float, f);
      check_from_float(fmt, table, from_float, -f);
    }
  }
  std::uniform_int_distribution<uint32_t> any_bits;
  for (int i = 0; i < 4000000; ++i) check_from_float(fmt, table, from_float, from_bits(any_bits(rng)));
  // Within the format's range: exponents from below its smallest subnormal to past its largest value.
  const int min_exp = 1 - fmt.bias - fmt.mantissa_bits - 2, max_exp = fmt.bias + 2;
  std::uniform_int_distribution<int> exponent(min_exp, std::min(max_exp, 127));
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  for (int i = 0; i < 2000000; ++i) {
    const float f = std::ldexp(mantissa(rng), exponent(rng));
    check_from_float(fmt, table, from_float, (i & 1) ? -f : f);
  }
}

void expect_half(float f, uint16_t want) {
  const uint16_t got = float_to_half(f);
  RK_CHECK(got == want, "float_to_half(%a) = 0x%04X, expected 0x%04X", f, got, want);
}

void expect_bf16(float f, uint16_t want) {
  const uint16_t got = float_to_bfloat16(f);
  RK_CHECK(got == want, "float_to_bfloat16(%a) = 0x%04X, expected 0x%04X", f, got, want);
}

// Hand-written cases with known answers, so a wrong reference cannot hide a wrong kernel.
void check_edge_cases() {
  const float inf = std::numeric_limits<float>::infinity();
  const float tiny = std::ldexp(1.0f, -40);
  expect_half(0.0f, 0x0000);
  expect_half(-0.0f, 0x8000);
  expect_half(1.0f, 0x3C00);
  expect_half(-1.5f, 0xBE00);
  expect_half(1.0f + std::ldexp(1.0f, -11), 0x3C00);         // tie, even below
  expect_half(1.0f + 3 * std::ldexp(1.0f, -11), 0x3C02);     // tie, even above
  expect_half(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -23), 0x3C01);  // just past the tie
  expect_half(2049.0f, 0x6800);                               // tie between 2048 and 2050
  expect_half(2051.0f, 0x6802);                               // tie between 2050 and 2052
  expect_half(65504.0f, 0x7BFF);                              // largest half
  expect_half(65519.99f, 0x7BFF);
  expect_half(std::nextafter(65520.0f, 0.0f), 0x7BFF);
  expect_half(65520.0f, 0x7C00);                              // tie with 65536: overflows
  expect_half(-65520.0f, 0xFC00);
  expect_half(1e10f, 0x7C00);
  expect_half(inf, 0x7C00);
  expect_half(-inf, 0xFC00);
  expect_half(std::ldexp(1.0f, -14), 0x0400);                 // smallest normal
  expect_half(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25), 0x0400);  // tie 0x03FF/0x0400
  expect_half(std::ldexp(1023.0f, -24), 0x03FF);              // largest subnormal
  expect_half(std::ldexp(1.0f, -24), 0x0001);                 // smallest subnormal
  expect_half(-std::ldexp(1.0f, -24), 0x8001);
  expect_half(std::ldexp(1.0f, -25), 0x0000);                 // tie 0/0x0001: even is zero
  expect_half(-std::ldexp(1.0f, -25), 0x8000);
  expect_half(std::ldexp(1.0f, -25) + tiny, 0x0001);
  expect_half(std::ldexp(3.0f, -25), 0x0002);                 // tie 0x0001/0x0002
  expect_half(std::ldexp(5.0f, -25), 0x0002);                 // tie 0x0002/0x0003
  expect_half(1e-45f, 0x0000);                                // float subnormal
  expect_half(-1e-45f, 0x8000);
  RK_CHECK(kHalf.is_nan(float_to_half(std::nanf(""))), "float_to_half(nan) is not a nan");
  RK_CHECK(kHalf.is_nan(float_to_half(from_bits(0xFF800001u))), "float_to_half(-snan) is not a nan");

  expect_bf16(0.0f, 0x0000);
  expect_bf16(-0.0f, 0x8000);
  expect_bf16(1.0f, 0x3F80);
  expect_bf16(1.0f + std::ldexp(1.0f, -8), 0x3F80);           // tie, even below
  expect_bf16(1.0f + 3 * std::ldexp(1.0f, -8), 0x3F82);       // tie, even above
  expect_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -23), 0x3F81);
  expect_bf16(-257.0f, 0xC380);                               // tie between 256 and 258
  expect_bf16(from_bits(0x7F7F7FFFu), 0x7F7F);                // just below max + half ulp
  expect_bf16(from_bits(0x7F7F8000u), 0x7F80);                // tie at the overflow threshold
  expect_bf16(from_bits(0x7F7FFFFFu), 0x7F80);                // largest float overflows
  expect_bf16(inf, 0x7F80);
  expect_bf16(-inf, 0xFF80);
  expect_bf16(from_bits(0x00008000u), 0x0000);                // subnormal tie, even is zero
  expect_bf16(from_bits(0x00018000u), 0x0002);
  expect_bf16(from_bits(0x80008001u), 0x8001);
  for (uint32_t nan : {0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu, 0xFF800001u, 0xFFFFFFFFu, 0x7F80FFFFu}) {
    const uint16_t got = float_to_bfloat16(from_bits(nan));
    RK_CHECK(kBF16.is_nan(got), "float_to_bfloat16(nan 0x%08X) = 0x%04X, not a nan", nan, got);
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(20240611);
  check_edge_cases();
  check_to_float_exhaustive(kHalf, half_to_float);
  check_round_trip_exhaustive(kHalf, half_to_float, float_to_half);
  check_from_float_sweep(kHalf, float_to_half, rng);
  check_to_float_exhaustive(kBF16, bfloat16_to_float);
  check_round_trip_exhaustive(kBF16, bfloat16_to_float, float_to_bfloat16);
  check_from_float_sweep(kBF16, float_to_bfloat16, rng);
  return rktest::finish("test_scalar");
}
