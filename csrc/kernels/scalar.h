// Torch-free scalar types for the kernels: the float formats revkernels ops accept, and their
// conversions to and from float. Storage of a 16-bit value is a raw uint16_t so the same code
// compiles with g++ and nvcc; conversions round to nearest even, as torch does.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define RK_HOST_DEVICE __host__ __device__
#else
#define RK_HOST_DEVICE
#endif

namespace revkernels {

enum class ScalarKind : int { Float32 = 0, Float64 = 1, Float16 = 2, BFloat16 = 3 };

struct Half { uint16_t bits; };
struct BFloat16 { uint16_t bits; };

RK_HOST_DEVICE inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

RK_HOST_DEVICE inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

RK_HOST_DEVICE inline float half_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  const uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in float.
    return bits_float(sign | float_bits(static_cast<float>(mantissa) * 5.9604644775390625e-8f));
  }
  if (exponent == 31) return bits_float(sign | 0x7F800000u | (mantissa << 13));
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

RK_HOST_DEVICE inline uint16_t float_to_half(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t magnitude = x & 0x7FFFFFFFu;
  if (magnitude >= 0x7F800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | (magnitude > 0x7F800000u ? 0x7E00u : 0x7C00u));
  }
  if (magnitude >= 0x477FF000u) {  // >= 65520 rounds past the largest half: inf
    return static_cast<uint16_t>(sign | 0x7C00u);
  }
  if (magnitude < 0x38800000u) {  // below 2^-14: a half subnormal or zero
    // Adding 0.5f puts the half subnormal unit (2^-24) at float's last bit; the FPU rounds.
    const float shifted = bits_float(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (float_bits(shifted) - 0x3F000000u));
  }
  // Rebias the exponent (127 -> 15) and round to nearest even on the 13 dropped bits.
  const uint32_t odd = (magnitude >> 13) & 1u;
  magnitude += 0xC8000FFFu + odd;
  return static_cast<uint16_t>(sign | (magnitude >> 13));
#endif
}

RK_HOST_DEVICE inline float bfloat16_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
}

RK_HOST_DEVICE inline uint16_t float_to_bfloat16(float f) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
  const uint32_t x = float_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);  // quiet nan
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
#endif
}

// Load/store through the accumulation type `acc_t` (float, or double for float64 data).
template <typename acc_t> RK_HOST_DEVICE inline acc_t load(const float* p) { return static_cast<acc_t>(*p); }
template <typename acc_t> RK_HOST_DEVICE inline acc_t load(const double* p) { return static_cast<acc_t>(*p); }
template <typename acc_t> RK_HOST_DEVICE inline acc_t load(const Half* p) { return static_cast<acc_t>(half_to_float(p->bits)); }
template <typename acc_t> RK_HOST_DEVICE inline acc_t load(const BFloat16* p) { return static_cast<acc_t>(bfloat16_to_float(p->bits)); }

template <typename acc_t> RK_HOST_DEVICE inline void store(float* p, acc_t v) { *p = static_cast<float>(v); }
template <typename acc_t> RK_HOST_DEVICE inline void store(double* p, acc_t v) { *p = static_cast<double>(v); }
template <typename acc_t> RK_HOST_DEVICE inline void store(Half* p, acc_t v) { p->bits = float_to_half(static_cast<float>(v)); }
template <typename acc_t> RK_HOST_DEVICE inline void store(BFloat16* p, acc_t v) { p->bits = float_to_bfloat16(static_cast<float>(v)); }

template <typename T> struct TypeTag { using type = T; };

// Calls fn(TypeTag<T>) for the runtime dtype `kind`. Returns fn's result.
template <typename Fn>
auto dispatch_float_type(ScalarKind kind, Fn&& fn) {
  switch (kind) {
    case ScalarKind::Float64: return fn(TypeTag<double>{});
    case ScalarKind::Float16: return fn(TypeTag<Half>{});
    case ScalarKind::BFloat16: return fn(TypeTag<BFloat16>{});
    case ScalarKind::Float32: break;
  }
  return fn(TypeTag<float>{});
}

// Calls fn(TypeTag<acc_t>, TypeTag<first_t>, TypeTag<second_t>) for two runtime dtypes (an op's
// output-side operand and its other operand); acc_t is double when either is double, float
// otherwise. Returns fn's result.
template <typename Fn>
auto dispatch_float_pair(ScalarKind out_kind, ScalarKind b_kind, Fn&& fn) {
  auto with_b = [&](auto out_tag) {
    using out_t = typename decltype(out_tag)::type;
    constexpr bool out_double = sizeof(out_t) == sizeof(double);
    using acc_if_narrow_b = typename std::conditional<out_double, double, float>::type;
    switch (b_kind) {
      case ScalarKind::Float64: return fn(TypeTag<double>{}, out_tag, TypeTag<double>{});
      case ScalarKind::Float16: return fn(TypeTag<acc_if_narrow_b>{}, out_tag, TypeTag<Half>{});
      case ScalarKind::BFloat16: return fn(TypeTag<acc_if_narrow_b>{}, out_tag, TypeTag<BFloat16>{});
      case ScalarKind::Float32: break;
    }
    return fn(TypeTag<acc_if_narrow_b>{}, out_tag, TypeTag<float>{});
  };
  switch (out_kind) {
    case ScalarKind::Float64: return with_b(TypeTag<double>{});
    case ScalarKind::Float16: return with_b(TypeTag<Half>{});
    case ScalarKind::BFloat16: return with_b(TypeTag<BFloat16>{});
    case ScalarKind::Float32: break;
  }
  return with_b(TypeTag<float>{});
}

}  // namespace revkernels
