// The vectorised CPU kernels (interface and semantics: vec_kernels.h), compiled once per ISA as
// ATen compiles its own CPU kernels: as a plain source (DEFAULT: at::vec's portable vectors), and
// with `-DCPU_CAPABILITY=AVX2 -DCPU_CAPABILITY_AVX2 -mavx2 -mfma -mf16c` and
// `-DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma`,
// and AVX512_BF16: the AVX512 build plus `-mavx512bf16 -DREVKERNELS_AVX512_BF16`, which stores bf16
// with the CPU's own conversion (setup.py and CMakeLists.txt). at::vec picks its vector width and
// intrinsics from those macros, and everything here lands in namespace revkernels::CPU_CAPABILITY.
// No static data with dynamic initialisers here: they would run ISA-specific code at load time on
// any CPU.
//
// Data are processed in blocks of two accumulation-type vectors (kBlock elements: the width of one
// 16-bit vector, converted to two fp32 vectors); a row's last partial block uses masked loads and
// stores. Row sums are carried in vector lanes and folded in a fixed order, so results depend on
// the ISA's vector width but never on the thread count.
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <type_traits>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#endif

#include "../kernels/layer_norm.h"
#include "vec_kernels.h"

#if defined(REVKERNELS_AVX512_BF16)
#define RK_CPU_ISA CpuIsa::Avx512Bf16
#elif defined(CPU_CAPABILITY_AVX512)
#define RK_CPU_ISA CpuIsa::Avx512
#elif defined(CPU_CAPABILITY_AVX2)
#define RK_CPU_ISA CpuIsa::Avx2
#else
#define RK_CPU_ISA CpuIsa::Default
#endif
#define RK_STRINGIFY(x) #x
#define RK_NAME(x) RK_STRINGIFY(x)

// What has no vector path (mixed dtypes with double, a strided innermost dim, BatchNorm) runs the
// torch-free scalar kernels of csrc/kernels, instantiated in the DEFAULT build only: the AVX2 and
// AVX512 builds forward such calls to DEFAULT's table (RK_SCALAR). Template
// instances shared by several builds would be one symbol, and the linker may keep any build's
// code for it, so no build may instantiate what another needs in baseline form.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
namespace revkernels::DEFAULT {
extern const CpuKernels kCpuKernels;
}
#define RK_SCALAR(entry, call, ...) DEFAULT::kCpuKernels.entry(__VA_ARGS__)
#else
#define RK_SCALAR(entry, call, ...) call
#endif

// The AVX512 build forwards the all-fp32 calls of the streaming kernels (coupling_axpy,
// sub_layer_norm) to AVX2's table: on the AVX-512 CPU measured (AMD Zen 4), a loop of 512-bit
// loads streams fp32 from L3/DRAM 10-15% slower than the same loop with 256-bit loads, which is
// also why ATen runs its own elementwise and LayerNorm kernels from its AVX2 build on AVX-512 CPUs.
// With 16-bit data, or mixed with fp32, the AVX-512 code is as fast or faster, and stays.
#if defined(CPU_CAPABILITY_AVX512)
namespace revkernels::AVX2 {
extern const CpuKernels kCpuKernels;
}
#endif

namespace revkernels {
namespace CPU_CAPABILITY {

template <typename T> struct C10Type { using type = T; };
template <> struct C10Type<Half> { using type = c10::Half; };
template <> struct C10Type<BFloat16> { using type = c10::BFloat16; };

template <typename acc_t> using Vec = at::vec::Vectorized<acc_t>;
template <typename acc_t> constexpr int64_t kLanes = Vec<acc_t>::size();
template <typename acc_t> constexpr int64_t kBlock = 2 * kLanes<acc_t>;
static_assert(at::vec::Vectorized<c10::BFloat16>::size() == kBlock<float>, "a bf16 vector converts to two fp32 ones");
static_assert(at::vec::Vectorized<c10::Half>::size() == kBlock<float>, "an fp16 vector converts to two fp32 ones");

// Whether (acc_t, T...) has a vector path: fp32 math on fp32/fp16/bf16 data, or fp64 on fp64 data.
template <typename acc_t, typename... T>
constexpr bool kVectorised = std::is_same_v<acc_t, double> ? (std::is_same_v<T, double> && ...)
                                                           : (!std::is_same_v<T, double> && ...);

// One block: elements [0, kLanes) in lo, [kLanes, kBlock) in hi.
template <typename acc_t>
struct Block {
  Vec<acc_t> lo, hi;
  Block() = default;
  Block(Vec<acc_t> l, Vec<acc_t> h) : lo(l), hi(h) {}
  explicit Block(acc_t v) : lo(v), hi(v) {}
};
// The per-block helpers below are forced inline: GCC left some of them out of line in hot loops (a
// call through the PLT per block, the vectors passed through memory), e.g. gelu_value and the bf16
// store in bias_gelu on bf16, a third of its time.
template <typename acc_t> C10_ALWAYS_INLINE Block<acc_t> operator+(const Block<acc_t>& a, const Block<acc_t>& b) { return {a.lo + b.lo, a.hi + b.hi}; }
template <typename acc_t> C10_ALWAYS_INLINE Block<acc_t> operator-(const Block<acc_t>& a, const Block<acc_t>& b) { return {a.lo - b.lo, a.hi - b.hi}; }
template <typename acc_t> C10_ALWAYS_INLINE Block<acc_t> operator*(const Block<acc_t>& a, const Block<acc_t>& b) { return {a.lo * b.lo, a.hi * b.hi}; }

// relu(v) as the scalar kernels form it: 0 where v <= 0, else v (a NaN stays NaN, as in torch.relu).
template <typename acc_t>
C10_ALWAYS_INLINE Block<acc_t> relu(const Block<acc_t>& v) {
  const Vec<acc_t> zero(acc_t(0));
  return {Vec<acc_t>::blendv(v.lo, zero, v.lo <= zero), Vec<acc_t>::blendv(v.hi, zero, v.hi <= zero)};
}

// ReLU's backward from the pre-activation y: 0 where y <= 0, else d (a NaN y passes d, as torch's
// threshold_backward does).
template <typename acc_t>
C10_ALWAYS_INLINE Block<acc_t> relu_masked(const Block<acc_t>& y, const Block<acc_t>& d) {
  const Vec<acc_t> zero(acc_t(0));
  return {Vec<acc_t>::blendv(d.lo, zero, y.lo <= zero), Vec<acc_t>::blendv(d.hi, zero, y.hi <= zero)};
}

// AddressSanitizer builds (scripts/sanitize.sh): reports an access to the `bytes` at p that reaches
// memory ASan has poisoned (out of bounds, freed), as ASan reports a plain access. The AVX-512
// builds' partial blocks go through at::vec's masked loads and stores, and the streaming stores
// through their own intrinsics: compiler builtins that GCC's ASan does not instrument, so without
// this an overrun in a row's tail would go unseen there. Nothing in other builds.
C10_ALWAYS_INLINE void asan_check([[maybe_unused]] const void* p, [[maybe_unused]] int64_t bytes,
                                  [[maybe_unused]] bool write) {
#if defined(__SANITIZE_ADDRESS__)
  void* bad = __asan_region_is_poisoned(const_cast<void*>(p), static_cast<size_t>(bytes));
  if (bad != nullptr) {
    void* frame = __builtin_frame_address(0);
    __asan_report_error(__builtin_return_address(0), frame, frame, bad, write, static_cast<size_t>(bytes));
  }
#endif
}

// Loads count (<= kBlock) elements of T as acc_t; lanes past count are unspecified.
template <typename acc_t, typename T>
C10_ALWAYS_INLINE Block<acc_t> load_block(const T* p, int64_t count = kBlock<acc_t>) {
  constexpr int64_t L = kLanes<acc_t>;
  asan_check(p, std::min(count, kBlock<acc_t>) * static_cast<int64_t>(sizeof(T)), false);
  if constexpr (std::is_same_v<T, acc_t>) {
    if (count >= kBlock<acc_t>) return {Vec<acc_t>::loadu(p), Vec<acc_t>::loadu(p + L)};
    if (count > L) return {Vec<acc_t>::loadu(p), Vec<acc_t>::loadu(p + L, count - L)};
    return {Vec<acc_t>::loadu(p, count), Vec<acc_t>(acc_t(0))};
  } else {
    static_assert(std::is_same_v<acc_t, float>, "16-bit data convert to fp32");
    using c10_t = typename C10Type<T>::type;
    const auto* q = reinterpret_cast<const c10_t*>(p);
    const Vec<c10_t> v = count >= kBlock<acc_t> ? Vec<c10_t>::loadu(q) : Vec<c10_t>::loadu(q, count);
    auto [lo, hi] = at::vec::convert_to_float<c10_t>(v);
    return {lo, hi};
  }
}

// fp32 -> 16-bit, round to nearest even. The AVX512_BF16 build converts to bf16 with
// vcvtne2ps2bf16 (one instruction for what at::vec emulates with several integer ops per vector),
// which flushes fp32 subnormals (|v| < 2^-126) to a signed zero; every other value converts bitwise
// as at::vec's emulation does.
template <typename c10_t>
C10_ALWAYS_INLINE Vec<c10_t> to_16bit(const Vec<float>& lo, const Vec<float>& hi) {
#if defined(REVKERNELS_AVX512_BF16)
  if constexpr (std::is_same_v<c10_t, c10::BFloat16>) {
    return Vec<c10_t>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
  }
#endif
  return at::vec::convert_from_float<c10_t>(lo, hi);
}

// Stores the first count (<= kBlock) elements, rounded once to T (round to nearest even).
template <typename acc_t, typename T>
C10_ALWAYS_INLINE void store_block(T* p, const Block<acc_t>& v, int64_t count = kBlock<acc_t>) {
  constexpr int64_t L = kLanes<acc_t>;
  asan_check(p, std::min(count, kBlock<acc_t>) * static_cast<int64_t>(sizeof(T)), true);
  if constexpr (std::is_same_v<T, acc_t>) {
    if (count >= kBlock<acc_t>) {
      v.lo.store(p);
      v.hi.store(p + L);
    } else if (count > L) {
      v.lo.store(p);
      v.hi.store(p + L, count - L);
    } else {
      v.lo.store(p, count);
    }
  } else {
    using c10_t = typename C10Type<T>::type;
    auto* q = reinterpret_cast<c10_t*>(p);
    const Vec<c10_t> r = to_16bit<c10_t>(v.lo, v.hi);
    if (count >= kBlock<acc_t>) {
      r.store(q);
    } else {
      r.store(q, count);
    }
  }
}

// Whether this build writes streaming (non-temporal) stores; DEFAULT's portable vectors have none.
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kStreams = true;
#else
constexpr bool kStreams = false;
#endif

// The bytes one vector store of T data covers: the alignment stream_block needs.
template <typename acc_t, typename T>
constexpr int64_t kStoreBytes = std::is_same_v<T, acc_t> ? sizeof(Vec<acc_t>) : sizeof(Vec<typename C10Type<T>::type>);

// Stores a whole block, rounded once to T, with streaming stores (kStreams builds; plain stores
// otherwise); p is aligned to kStoreBytes<acc_t, T>.
template <typename acc_t, typename T>
C10_ALWAYS_INLINE void stream_block(T* p, const Block<acc_t>& v) {
  asan_check(p, kBlock<acc_t> * static_cast<int64_t>(sizeof(T)), true);
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    _mm512_stream_ps(p, v.lo);
    _mm512_stream_ps(p + kLanes<acc_t>, v.hi);
  } else if constexpr (std::is_same_v<T, double>) {
    _mm512_stream_pd(p, v.lo);
    _mm512_stream_pd(p + kLanes<acc_t>, v.hi);
  } else {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), to_16bit<typename C10Type<T>::type>(v.lo, v.hi));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    _mm256_stream_ps(p, v.lo);
    _mm256_stream_ps(p + kLanes<acc_t>, v.hi);
  } else if constexpr (std::is_same_v<T, double>) {
    _mm256_stream_pd(p, v.lo);
    _mm256_stream_pd(p + kLanes<acc_t>, v.hi);
  } else {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_16bit<typename C10Type<T>::type>(v.lo, v.hi));
  }
#else
  store_block(p, v);
#endif
}

// Stores the first count elements of v at p: whole blocks with streaming stores when `stream`
// (p aligned: for_blocks_aligned), the rest as store_block does.
template <typename acc_t, typename T>
C10_ALWAYS_INLINE void put_block(T* p, const Block<acc_t>& v, int64_t count, bool stream) {
  if (kStreams && stream && count == kBlock<acc_t>) {
    stream_block(p, v);
  } else {
    store_block(p, v, count);
  }
}

// Orders this thread's streaming stores before whatever follows (the join of the parallel_for that
// hands the outputs to other threads); they are weakly ordered otherwise.
C10_ALWAYS_INLINE void end_streaming(bool stream) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if (stream) _mm_sfence();
#endif
}

// v rounded to T and back (the value a store to T then a load would give).
template <typename T, typename acc_t>
C10_ALWAYS_INLINE Block<acc_t> rounded(const Block<acc_t>& v) {
  if constexpr (std::is_same_v<T, acc_t>) {
    return v;
  } else {
    using c10_t = typename C10Type<T>::type;
    auto [lo, hi] = at::vec::convert_to_float<c10_t>(to_16bit<c10_t>(v.lo, v.hi));
    return {lo, hi};
  }
}

// v with the lanes past count set to zero.
template <typename acc_t>
C10_ALWAYS_INLINE Block<acc_t> first(const Block<acc_t>& v, int64_t count) {
  constexpr int64_t L = kLanes<acc_t>;
  const Vec<acc_t> zero(acc_t(0));
  if (count >= kBlock<acc_t>) return v;
  if (count > L) return {v.lo, Vec<acc_t>::set(zero, v.hi, count - L)};
  return {Vec<acc_t>::set(zero, v.lo, count), zero};
}

// The sum of a block's lanes, folded pairwise in a fixed order.
template <typename acc_t>
C10_ALWAYS_INLINE acc_t total(const Block<acc_t>& v) {
  __at_align__ acc_t lanes[kLanes<acc_t>];
  (v.lo + v.hi).store(lanes);
  for (int64_t width = kLanes<acc_t> / 2; width > 0; width /= 2) {
    for (int64_t lane = 0; lane < width; ++lane) lanes[lane] += lanes[lane + width];
  }
  return lanes[0];
}

// fn(i, count) over [0, n) in blocks: count = kBlock but for the last one. The block bodies passed
// here are forced inline too (C10_ALWAYS_INLINE_ATTRIBUTE): GCC otherwise keeps the larger ones
// (bias_gelu's on bf16) out of line, a call per block that reloads every constant.
template <typename acc_t, typename Fn>
C10_ALWAYS_INLINE void for_blocks(int64_t n, Fn&& fn) {
  int64_t i = 0;
  for (; i + kBlock<acc_t> <= n; i += kBlock<acc_t>) fn(i, kBlock<acc_t>);
  if (i < n) fn(i, n - i);
}

// for_blocks over [0, n) with the whole blocks starting where out + i is aligned for stream_block
// (a first, partial block up to there) when `align`; plain for_blocks otherwise. out's address is a
// multiple of sizeof(T).
template <typename acc_t, typename T, typename Fn>
C10_ALWAYS_INLINE void for_blocks_aligned(const T* out, int64_t n, bool align, Fn&& fn) {
  int64_t i = 0;
  if (kStreams && align) {
    constexpr int64_t bytes = kStoreBytes<acc_t, T>;
    const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(out) % bytes);
    i = std::min<int64_t>(n, misaligned == 0 ? 0 : (bytes - misaligned) / static_cast<int64_t>(sizeof(T)));
    if (i > 0) fn(0, i);
  }
  for (; i + kBlock<acc_t> <= n; i += kBlock<acc_t>) fn(i, kBlock<acc_t>);
  if (i < n) fn(i, n - i);
}

// fn(i, count) over the blocks of [0, n) as for_blocks, in chunks of at most kSumChunk blocks;
// done() after each chunk: a sum carried in a Block and flushed into fp64 by done() takes at most
// kSumChunk terms per lane (kernels/lane_sums.h).
template <typename acc_t, typename Fn, typename Done>
C10_ALWAYS_INLINE void for_chunked_blocks(int64_t n, Fn&& fn, Done&& done) {
  constexpr int64_t chunk = kSumChunk * kBlock<acc_t>;
  for (int64_t i0 = 0; i0 < n; i0 += chunk) {
    for_blocks<acc_t>(std::min(chunk, n - i0), [&](int64_t i, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE { fn(i0 + i, c); });
    done();
  }
}

// sum += the sum of part's lanes (folded pairwise), in fp64; part reset to zero.
template <typename acc_t>
C10_ALWAYS_INLINE void add_total(double& sum, Block<acc_t>& part) {
  sum += total(part);
  part = Block<acc_t>(acc_t(0));
}

// --- coupling ------------------------------------------------------------------------------------

template <typename acc_t, typename out_t, typename b_t>
void coupling_axpy_vec(out_t* out, const out_t* a, const b_t* b, acc_t alpha, const CouplingLayout& layout,
                       int64_t begin, int64_t end, bool stream) {
  // (layout.ndim >= 1, unit-stride innermost dim in a and b: coupling_axpy checks)
  const Block<acc_t> alpha_v(alpha);
  for_each_layout_run(layout, begin, end, [&](int64_t linear, int64_t a_off, int64_t b_off, int64_t run) {
    out_t* o = out + linear;
    const out_t* pa = a + a_off;
    const b_t* pb = b + b_off;
    for_blocks_aligned<acc_t>(o, run, stream, [&](int64_t i, int64_t count) C10_ALWAYS_INLINE_ATTRIBUTE {
      put_block(o + i, load_block<acc_t>(pa + i, count) + alpha_v * load_block<acc_t>(pb + i, count), count, stream);
    });
  });
  end_streaming(stream);
}

void coupling_axpy(void* out, const void* a, ScalarKind out_kind, const void* b, ScalarKind b_kind, double alpha,
                   const CouplingLayout& layout, int64_t begin, int64_t end, bool stream_out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (out_kind == ScalarKind::Float32 && b_kind == ScalarKind::Float32) {  // why: see AVX2's declaration above
    return AVX2::kCpuKernels.coupling_axpy(out, a, out_kind, b, b_kind, alpha, layout, begin, end, stream_out);
  }
#endif
  dispatch_float_pair(out_kind, b_kind, [&](auto acc_tag, auto out_tag, auto b_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    using out_t = typename decltype(out_tag)::type;
    using b_t = typename decltype(b_tag)::type;
    auto* o = static_cast<out_t*>(out);
    const auto* pa = static_cast<const out_t*>(a);
    const auto* pb = static_cast<const b_t*>(b);
    const int nd = layout.ndim;
    if constexpr (kVectorised<acc_t, out_t, b_t>) {
      if (nd > 0 && layout.a_strides[nd - 1] == 1 && layout.b_strides[nd - 1] == 1) {
        coupling_axpy_vec<acc_t>(o, pa, pb, static_cast<acc_t>(alpha), layout, begin, end, stream_out);
        return;
      }
    }
    RK_SCALAR(coupling_axpy, coupling_axpy_cpu<acc_t>(o, pa, pb, static_cast<acc_t>(alpha), layout, begin, end),
              out, a, out_kind, b, b_kind, alpha, layout, begin, end, stream_out);
  });
}

// --- LayerNorm -----------------------------------------------------------------------------------

template <typename acc_t, typename x_t, typename g_t>
void sub_layer_norm_vec(x_t* x, x_t* ln, acc_t* mean, acc_t* rstd, const x_t* y, int64_t y_row_stride, const g_t* g,
                        int64_t g_row_stride, const acc_t* weight, const acc_t* bias, acc_t eps, int64_t n,
                        int64_t row_begin, int64_t row_end, bool stream) {
  // Streaming writes x and ln in the last pass only, both from the same offsets: their rows must be
  // equally aligned (always so for the op's own fresh outputs).
  constexpr int64_t align = kStoreBytes<acc_t, x_t>;
  stream = stream && kStreams && (reinterpret_cast<uintptr_t>(x) - reinterpret_cast<uintptr_t>(ln)) % align == 0;
  // The rounded x row in acc_t, read by the statistics and the normalisation: x itself when x_t is
  // acc_t and x is written in the first pass, else this scratch row (cached, where a streamed x is not).
  const bool x_is_scratch = std::is_same_v<x_t, acc_t> && !stream;
  const std::unique_ptr<acc_t[]> scratch(x_is_scratch ? nullptr : new acc_t[n]);
  const double count = static_cast<double>(n);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const x_t* yr = y + r * y_row_stride;
    const g_t* gr = g + r * g_row_stride;
    x_t* xr = x + r * n;
    x_t* lr = ln + r * n;
    acc_t* xs = scratch.get();
    if constexpr (std::is_same_v<x_t, acc_t>) {
      if (x_is_scratch) xs = xr;
    }
    // The mean sums x - x[0] (see sub_layer_norm_cpu): a constant row's is exact. x[0] rounded as the
    // stores below round it.
    x_t first_x;
    store<acc_t>(&first_x, load<acc_t>(yr) - load<acc_t>(gr));
    const acc_t pivot = stats_pivot(load<acc_t>(&first_x));
    const Block<acc_t> pivot_v(pivot);
    Block<acc_t> part(acc_t(0));
    double sum = 0.0, squares = 0.0;
    for_chunked_blocks<acc_t>(
        n,
        [&](int64_t i, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
          const Block<acc_t> v = load_block<acc_t>(yr + i, c) - load_block<acc_t>(gr + i, c);
          const Block<acc_t> xv = rounded<x_t>(v);
          if (!stream) store_block(xr + i, v, c);
          if (!x_is_scratch) store_block(xs + i, xv, c);
          part = part + first(xv - pivot_v, c);
        },
        [&] { add_total(sum, part); });
    const acc_t mu = static_cast<acc_t>(pivot + sum / count);
    const Block<acc_t> mu_v(mu);
    for_chunked_blocks<acc_t>(
        n,
        [&](int64_t i, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
          const Block<acc_t> d = first(load_block<acc_t>(xs + i, c) - mu_v, c);
          part = part + d * d;
        },
        [&] { add_total(squares, part); });
    const acc_t rs = acc_t(1) / std::sqrt(static_cast<acc_t>(squares / count) + eps);
    const Block<acc_t> rs_v(rs);
    for_blocks_aligned<acc_t>(xr, n, stream, [&](int64_t i, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
      const Block<acc_t> xv = load_block<acc_t>(xs + i, c);
      if (stream) put_block(xr + i, xv, c, true);  // xv is x_t-exact: this store rounds nothing
      put_block(lr + i, (xv - mu_v) * rs_v * load_block<acc_t>(weight + i, c) + load_block<acc_t>(bias + i, c), c, stream);
    });
    mean[r] = mu;
    rstd[r] = rs;
  }
  end_streaming(stream);
}

void sub_layer_norm(void* x, void* ln, void* mean, void* rstd, ScalarKind x_kind, const void* y,
                    int64_t y_row_stride, const void* g, ScalarKind g_kind, int64_t g_row_stride,
                    const void* weight, const void* bias, double eps, int64_t n, int64_t row_begin,
                    int64_t row_end, bool stream_out) {
#if defined(CPU_CAPABILITY_AVX512)
  if (x_kind == ScalarKind::Float32 && g_kind == ScalarKind::Float32) {  // why: see AVX2's declaration above
    return AVX2::kCpuKernels.sub_layer_norm(x, ln, mean, rstd, x_kind, y, y_row_stride, g, g_kind, g_row_stride,
                                            weight, bias, eps, n, row_begin, row_end, stream_out);
  }
#endif
  dispatch_float_pair(x_kind, g_kind, [&](auto acc_tag, auto x_tag, auto g_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    using x_t = typename decltype(x_tag)::type;
    using g_t = typename decltype(g_tag)::type;
    auto args = [&](auto kernel, auto... stream) {
      kernel(static_cast<x_t*>(x), static_cast<x_t*>(ln), static_cast<acc_t*>(mean), static_cast<acc_t*>(rstd),
             static_cast<const x_t*>(y), y_row_stride, static_cast<const g_t*>(g), g_row_stride,
             static_cast<const acc_t*>(weight), static_cast<const acc_t*>(bias), static_cast<acc_t>(eps), n,
             row_begin, row_end, stream...);
    };
    if constexpr (kVectorised<acc_t, x_t, g_t>) {
      args(sub_layer_norm_vec<acc_t, x_t, g_t>, stream_out);
    } else {
      RK_SCALAR(sub_layer_norm, args(sub_layer_norm_cpu<acc_t, x_t, g_t>), x, ln, mean, rstd, x_kind, y,
                y_row_stride, g, g_kind, g_row_stride, weight, bias, eps, n, row_begin, row_end, stream_out);
    }
  });
}

template <typename acc_t, typename dres_t, typename x_t>
void layer_norm_bwd_add_vec(dres_t* dx, acc_t* dweight_partial, acc_t* dbias_partial, const x_t* dln,
                            int64_t dln_row_stride, const x_t* x, int64_t x_row_stride, const acc_t* weight,
                            const acc_t* mean, const acc_t* rstd, const dres_t* dres, int64_t dres_row_stride,
                            int64_t n, int64_t row_begin, int64_t row_end) {
  for_blocks<acc_t>(n, [&](int64_t i, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
    store_block(dweight_partial + i, Block<acc_t>(acc_t(0)), c);
    store_block(dbias_partial + i, Block<acc_t>(acc_t(0)), c);
  });
  const double count = static_cast<double>(n);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const x_t* dr = dln + r * dln_row_stride;
    const x_t* xr = x + r * x_row_stride;
    const dres_t* res = dres + r * dres_row_stride;
    dres_t* out = dx + r * n;
    const Block<acc_t> mu(mean[r]), rs(rstd[r]);
    // Pass 1: the row sums of dxhat and dxhat * xhat, and the dweight/dbias partial sums.
    Block<acc_t> part_dxhat(acc_t(0)), part_dxhat_xhat(acc_t(0));
    double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
    for_chunked_blocks<acc_t>(
        n,
        [&](int64_t i, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
          const Block<acc_t> xhat = (load_block<acc_t>(xr + i, c) - mu) * rs;
          const Block<acc_t> d = first(load_block<acc_t>(dr + i, c), c);
          const Block<acc_t> dxhat = d * load_block<acc_t>(weight + i, c);
          part_dxhat = part_dxhat + first(dxhat, c);
          part_dxhat_xhat = part_dxhat_xhat + first(dxhat * xhat, c);
          store_block(dweight_partial + i, load_block<acc_t>(dweight_partial + i, c) + d * xhat, c);
          store_block(dbias_partial + i, load_block<acc_t>(dbias_partial + i, c) + d, c);
        },
        [&] {
          add_total(sum_dxhat, part_dxhat);
          add_total(sum_dxhat_xhat, part_dxhat_xhat);
        });
    const Block<acc_t> mean_dxhat(static_cast<acc_t>(sum_dxhat / count));
    const Block<acc_t> mean_dxhat_xhat(static_cast<acc_t>(sum_dxhat_xhat / count));
    // Pass 2: dx, with the residual gradient added before the one rounding to dres_t.
    for_blocks<acc_t>(n, [&](int64_t i, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
      const Block<acc_t> xhat = (load_block<acc_t>(xr + i, c) - mu) * rs;
      const Block<acc_t> dxhat = load_block<acc_t>(dr + i, c) * load_block<acc_t>(weight + i, c);
      store_block(out + i, load_block<acc_t>(res + i, c) + rs * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat), c);
    });
  }
}

void layer_norm_bwd_add(void* dx, ScalarKind dres_kind, void* dweight_partial, void* dbias_partial, const void* dln,
                        int64_t dln_row_stride, const void* x, ScalarKind x_kind, int64_t x_row_stride,
                        const void* weight, const void* mean, const void* rstd, const void* dres,
                        int64_t dres_row_stride, int64_t n, int64_t row_begin, int64_t row_end) {
  // dispatch_float_pair(first, second): acc_t is double when either dtype is double.
  dispatch_float_pair(dres_kind, x_kind, [&](auto acc_tag, auto dres_tag, auto x_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    using dres_t = typename decltype(dres_tag)::type;
    using x_t = typename decltype(x_tag)::type;
    auto args = [&](auto kernel) {
      kernel(static_cast<dres_t*>(dx), static_cast<acc_t*>(dweight_partial), static_cast<acc_t*>(dbias_partial),
             static_cast<const x_t*>(dln), dln_row_stride, static_cast<const x_t*>(x), x_row_stride,
             static_cast<const acc_t*>(weight), static_cast<const acc_t*>(mean), static_cast<const acc_t*>(rstd),
             static_cast<const dres_t*>(dres), dres_row_stride, n, row_begin, row_end);
    };
    if constexpr (kVectorised<acc_t, dres_t, x_t>) {
      args(layer_norm_bwd_add_vec<acc_t, dres_t, x_t>);
    } else {
      RK_SCALAR(layer_norm_bwd_add, args(layer_norm_bwd_add_cpu<acc_t, dres_t, x_t>), dx, dres_kind,
                dweight_partial, dbias_partial, dln, dln_row_stride, x, x_kind, x_row_stride, weight, mean, rstd,
                dres, dres_row_stride, n, row_begin, row_end);
    }
  });
}

// --- bias + GELU ---------------------------------------------------------------------------------

// erf(v) and exp(v). For fp32, erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7, the form
// at::vec's own fp32 erf uses) and exp by at::vec's inline exp_u20 (relative error ~1e-6): no
// out-of-line Sleef call per vector, which is what GELU's time goes to. fp64 keeps Sleef's.
template <typename acc_t>
C10_ALWAYS_INLINE Vec<acc_t> fast_exp(const Vec<acc_t>& v) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return v.exp_u20();
  } else {
    return v.exp();
  }
}

template <typename acc_t>
C10_ALWAYS_INLINE Vec<acc_t> fast_erf(const Vec<acc_t>& v) {
  if constexpr (std::is_same_v<acc_t, float>) {
    const Vec<float> one(1.f), a = v.abs();
    const Vec<float> t = one / (Vec<float>(0.3275911f) * a + one);
    Vec<float> r = Vec<float>(1.061405429f) * t + Vec<float>(-1.453152027f);
    r = r * t + Vec<float>(1.421413741f);
    r = r * t + Vec<float>(-0.284496736f);
    r = r * t + Vec<float>(0.254829592f);
    const Vec<float> magnitude = one - r * t * fast_exp(Vec<float>(0.f) - a * a);  // erf(|v|)
    return Vec<float>::blendv(magnitude, Vec<float>(0.f) - magnitude, v < Vec<float>(0.f));
  } else {
    return v.erf();
  }
}

// sigmoid(2u) and sigmoid(-2u) from e = exp(-2|u|), as gelu_math::sigmoid_pair.
template <typename acc_t>
C10_ALWAYS_INLINE void sigmoid_pair(const Vec<acc_t>& u, Vec<acc_t>* plus, Vec<acc_t>* minus) {
  const Vec<acc_t> one(acc_t(1));
  const Vec<acc_t> e = fast_exp(u.abs() * Vec<acc_t>(acc_t(-2)));
  const Vec<acc_t> big = one / (one + e);
  const Vec<acc_t> small = e * big;
  const Vec<acc_t> negative = u < Vec<acc_t>(acc_t(0));
  *plus = Vec<acc_t>::blendv(big, small, negative);
  *minus = Vec<acc_t>::blendv(small, big, negative);
}

// gelu_value and gelu_derivative (kernels/bias_gelu.h), one vector at a time.
template <GeluApprox approx, typename acc_t>
C10_ALWAYS_INLINE Vec<acc_t> gelu_value(const Vec<acc_t>& z) {
  using C = gelu_math::Constants<acc_t>;
  if constexpr (approx == GeluApprox::Tanh) {
    const Vec<acc_t> u = Vec<acc_t>(C::kBeta) * (z + Vec<acc_t>(C::kKappa) * z * z * z);
    Vec<acc_t> plus, minus;
    sigmoid_pair(u, &plus, &minus);
    return z * plus;
  } else {
    return Vec<acc_t>(acc_t(0.5)) * z * (Vec<acc_t>(acc_t(1)) + fast_erf(z * Vec<acc_t>(C::kSqrt1_2)));
  }
}

template <GeluApprox approx, typename acc_t>
C10_ALWAYS_INLINE Vec<acc_t> gelu_derivative(const Vec<acc_t>& z) {
  using C = gelu_math::Constants<acc_t>;
  const Vec<acc_t> one(acc_t(1)), half(acc_t(0.5));
  const Vec<acc_t> z2 = z * z;
  if constexpr (approx == GeluApprox::Tanh) {
    const Vec<acc_t> u = Vec<acc_t>(C::kBeta) * (z + Vec<acc_t>(C::kKappa) * z2 * z);
    const Vec<acc_t> du = Vec<acc_t>(C::kBeta) * (one + Vec<acc_t>(acc_t(3) * C::kKappa) * z2);
    Vec<acc_t> plus, minus;
    sigmoid_pair(u, &plus, &minus);
    return plus + Vec<acc_t>(acc_t(2)) * z * plus * minus * du;
  } else {
    const Vec<acc_t> cdf = half * (one + fast_erf(z * Vec<acc_t>(C::kSqrt1_2)));
    const Vec<acc_t> pdf = Vec<acc_t>(C::kInvSqrt2Pi) * fast_exp(Vec<acc_t>(-acc_t(0.5)) * z2);
    return cdf + z * pdf;
  }
}

template <GeluApprox approx, typename acc_t, typename x_t, typename bias_t>
void bias_gelu_vec(x_t* out, const x_t* x, int64_t x_row_stride, const bias_t* bias, int64_t n, int64_t row_begin,
                   int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    x_t* o = out + r * n;
    const x_t* xr = x + r * x_row_stride;
    for_blocks<acc_t>(n, [&](int64_t j, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
      const Block<acc_t> z = load_block<acc_t>(xr + j, c) + load_block<acc_t>(bias + j, c);
      store_block(o + j, Block<acc_t>(gelu_value<approx>(z.lo), gelu_value<approx>(z.hi)), c);
    });
  }
}

template <GeluApprox approx, typename acc_t, typename x_t, typename bias_t>
void bias_gelu_bwd_vec(x_t* dx, const x_t* dy, int64_t dy_row_stride, const x_t* x, int64_t x_row_stride,
                       const bias_t* bias, int64_t n, int64_t row_begin, int64_t row_end, acc_t* dbias_partial) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    x_t* d = dx + r * n;
    const x_t* dyr = dy + r * dy_row_stride;
    const x_t* xr = x + r * x_row_stride;
    for_blocks<acc_t>(n, [&](int64_t j, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
      const Block<acc_t> z = load_block<acc_t>(xr + j, c) + load_block<acc_t>(bias + j, c);
      const Block<acc_t> g =
          load_block<acc_t>(dyr + j, c) * Block<acc_t>(gelu_derivative<approx>(z.lo), gelu_derivative<approx>(z.hi));
      store_block(d + j, g, c);
      store_block(dbias_partial + j, load_block<acc_t>(dbias_partial + j, c) + g, c);
    });
  }
}

void bias_gelu(void* out, const void* x, ScalarKind x_kind, int64_t x_row_stride, const void* bias,
               ScalarKind bias_kind, int64_t n, GeluApprox approx, int64_t row_begin, int64_t row_end) {
  dispatch_float_pair(x_kind, bias_kind, [&](auto acc_tag, auto x_tag, auto bias_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    using x_t = typename decltype(x_tag)::type;
    using bias_t = typename decltype(bias_tag)::type;
    auto* o = static_cast<x_t*>(out);
    const auto* px = static_cast<const x_t*>(x);
    const auto* pb = static_cast<const bias_t*>(bias);
    if constexpr (kVectorised<acc_t, x_t, bias_t>) {
      if (approx == GeluApprox::Tanh) {
        bias_gelu_vec<GeluApprox::Tanh, acc_t>(o, px, x_row_stride, pb, n, row_begin, row_end);
      } else {
        bias_gelu_vec<GeluApprox::None, acc_t>(o, px, x_row_stride, pb, n, row_begin, row_end);
      }
    } else {
      RK_SCALAR(bias_gelu, bias_gelu_cpu<acc_t>(o, px, x_row_stride, pb, n, approx, row_begin, row_end), out, x,
                x_kind, x_row_stride, bias, bias_kind, n, approx, row_begin, row_end);
    }
  });
}

void bias_gelu_bwd(void* dx, const void* dy, int64_t dy_row_stride, const void* x, ScalarKind x_kind,
                   int64_t x_row_stride, const void* bias, ScalarKind bias_kind, int64_t n, GeluApprox approx,
                   int64_t row_begin, int64_t row_end, void* dbias_partial) {
  dispatch_float_pair(x_kind, bias_kind, [&](auto acc_tag, auto x_tag, auto bias_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    using x_t = typename decltype(x_tag)::type;
    using bias_t = typename decltype(bias_tag)::type;
    auto* pdx = static_cast<x_t*>(dx);
    const auto* pdy = static_cast<const x_t*>(dy);
    const auto* px = static_cast<const x_t*>(x);
    const auto* pb = static_cast<const bias_t*>(bias);
    auto* pp = static_cast<acc_t*>(dbias_partial);
    if constexpr (kVectorised<acc_t, x_t, bias_t>) {
      if (approx == GeluApprox::Tanh) {
        bias_gelu_bwd_vec<GeluApprox::Tanh, acc_t>(pdx, pdy, dy_row_stride, px, x_row_stride, pb, n, row_begin,
                                                    row_end, pp);
      } else {
        bias_gelu_bwd_vec<GeluApprox::None, acc_t>(pdx, pdy, dy_row_stride, px, x_row_stride, pb, n, row_begin,
                                                    row_end, pp);
      }
    } else {
      RK_SCALAR(bias_gelu_bwd,
                bias_gelu_bwd_cpu<acc_t>(pdx, pdy, dy_row_stride, px, x_row_stride, pb, n, approx, row_begin, row_end, pp),
                dx, dy, dy_row_stride, x, x_kind, x_row_stride, bias, bias_kind, n, approx, row_begin, row_end,
                dbias_partial);
    }
  });
}

// --- BatchNorm -----------------------------------------------------------------------------------
// Two layouts have a vector path: spatially contiguous (NCHW; s_stride 1), vectorised along each
// sample's S elements of one channel, and channel-contiguous (channels_last, (N, C) or S = 1;
// c_stride 1), vectorised across a block of adjacent channels at each position. Sums are chunked
// as in the scalar kernels (kernels/batch_norm.h): a chunk's blocks are summed lane-wise in a local
// acc_t accumulator (at most kSumChunk blocks), whose sum is then added in fp64.

enum class BnPath { Spatial, Channels, Scalar };

inline BnPath bn_path(std::initializer_list<const BnView*> views) {
  bool channels = true, spatial = true;
  for (const BnView* v : views) {
    channels = channels && v->c_stride == 1 && (v->s_stride != 1 || v->s == 1);
    spatial = spatial && v->s_stride == 1;
  }
  return channels ? BnPath::Channels : spatial ? BnPath::Spatial : BnPath::Scalar;
}

// The lanes of a block, in an array.
template <typename acc_t>
struct Lanes {
  __at_align__ acc_t v[kBlock<acc_t>];
  explicit Lanes(const Block<acc_t>& b) { store_block(v, b); }
};

// Spatial path: fn(i, j, k) over the blocks of each sample i's S elements (j the offset, k the
// count), in chunks of at most kSumChunk blocks; done() after each chunk.
template <typename acc_t, typename Fn, typename Done>
C10_ALWAYS_INLINE void for_spatial_chunks(const BnView& v, Fn&& fn, Done&& done) {
  for (int64_t i = 0; i < v.n; ++i) {
    for_chunked_blocks<acc_t>(v.s, [&](int64_t j, int64_t k) C10_ALWAYS_INLINE_ATTRIBUTE { fn(i, j, k); }, done);
  }
}

// Channels path: fn(i, j) over the positions (sample i, position j) in memory order, in chunks of
// at most kSumChunk positions (crossing samples when S is small); done() after each chunk.
template <typename Fn, typename Done>
C10_ALWAYS_INLINE void for_position_chunks(const BnView& v, Fn&& fn, Done&& done) {
  int64_t room = kSumChunk;
  for (int64_t i = 0; i < v.n; ++i) {
    for (int64_t j = 0; j < v.s;) {
      const int64_t end = std::min(v.s, j + room);
      room -= end - j;
      for (; j < end; ++j) fn(i, j);
      if (room == 0) {
        done();
        room = kSumChunk;
      }
    }
  }
  if (room < kSumChunk) done();
}

// totals[l] += part's lane l, in fp64; part reset to zero.
template <typename acc_t>
C10_ALWAYS_INLINE void add_lanes(double* totals, Block<acc_t>& part) {
  const Lanes<acc_t> p(part);
  for (int64_t l = 0; l < kBlock<acc_t>; ++l) totals[l] += p.v[l];
  part = Block<acc_t>(acc_t(0));
}

template <typename acc_t, typename x_t>
void batch_norm_act_vec(x_t* out, acc_t* mean, acc_t* rstd, const x_t* x, const BnView& xv, const BnView& ov,
                        const acc_t* weight, const acc_t* bias, acc_t eps, bool relu, int64_t c_begin, int64_t c_end,
                        BnPath path) {
  const double count = static_cast<double>(xv.n * xv.s);
  if (path == BnPath::Spatial) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      const x_t* xc = x + c * xv.c_stride;
      // The sums of x - the channel's first value (stats_pivot: a constant channel's mean is exact)
      const acc_t pivot = count > 0 ? stats_pivot(load<acc_t>(xc)) : acc_t(0);
      const Block<acc_t> pivot_v(pivot);
      Block<acc_t> part(acc_t(0));
      double sum = 0, squares = 0;
      for_spatial_chunks<acc_t>(
          xv,
          [&](int64_t i, int64_t j, int64_t k) C10_ALWAYS_INLINE_ATTRIBUTE {
            part = part + first(load_block<acc_t>(xc + i * xv.n_stride + j, k) - pivot_v, k);
          },
          [&] { add_total(sum, part); });
      mean[c] = static_cast<acc_t>(pivot + sum / count);
      const Block<acc_t> mu(mean[c]);
      for_spatial_chunks<acc_t>(
          xv,
          [&](int64_t i, int64_t j, int64_t k) C10_ALWAYS_INLINE_ATTRIBUTE {
            const Block<acc_t> d = first(load_block<acc_t>(xc + i * xv.n_stride + j, k) - mu, k);
            part = part + d * d;
          },
          [&] { add_total(squares, part); });
      rstd[c] = acc_t(1) / std::sqrt(static_cast<acc_t>(squares / count) + eps);
      const Block<acc_t> rs(rstd[c]), w(weight[c]), b(bias[c]);
      x_t* oc = out + c * ov.c_stride;
      for (int64_t i = 0; i < xv.n; ++i) {
        for_blocks<acc_t>(xv.s, [&](int64_t j, int64_t k) C10_ALWAYS_INLINE_ATTRIBUTE {
          const Block<acc_t> y = (load_block<acc_t>(xc + i * xv.n_stride + j, k) - mu) * rs * w + b;
          store_block(oc + i * ov.n_stride + j, relu ? CPU_CAPABILITY::relu(y) : y, k);
        });
      }
    }
    return;
  }
  for (int64_t c0 = c_begin; c0 < c_end; c0 += kBlock<acc_t>) {  // BnPath::Channels
    const int64_t k = std::min(kBlock<acc_t>, c_end - c0);
    auto at = [&](int64_t i, int64_t j) { return load_block<acc_t>(x + i * xv.n_stride + j * xv.s_stride + c0, k); };
    Block<acc_t> part(acc_t(0));
    double sums[kBlock<acc_t>] = {}, squares[kBlock<acc_t>] = {};
    // The sums of x - each channel's first value (stats_pivot: a constant channel's mean is exact)
    __at_align__ acc_t pivots[kBlock<acc_t>] = {};
    if (count > 0) {
      store_block(pivots, at(0, 0), k);
      for (int64_t l = 0; l < k; ++l) pivots[l] = stats_pivot(pivots[l]);
    }
    const Block<acc_t> pivot_v = load_block<acc_t>(pivots, k);
    for_position_chunks(
        xv, [&](int64_t i, int64_t j) C10_ALWAYS_INLINE_ATTRIBUTE { part = part + (at(i, j) - pivot_v); },
        [&] { add_lanes(sums, part); });
    for (int64_t l = 0; l < k; ++l) mean[c0 + l] = static_cast<acc_t>(pivots[l] + sums[l] / count);
    const Block<acc_t> mu = load_block<acc_t>(mean + c0, k);
    for_position_chunks(
        xv,
        [&](int64_t i, int64_t j) C10_ALWAYS_INLINE_ATTRIBUTE {
          const Block<acc_t> d = at(i, j) - mu;
          part = part + d * d;
        },
        [&] { add_lanes(squares, part); });
    for (int64_t l = 0; l < k; ++l) {
      rstd[c0 + l] = acc_t(1) / std::sqrt(static_cast<acc_t>(squares[l] / count) + eps);
    }
    const Block<acc_t> rs = load_block<acc_t>(rstd + c0, k), w = load_block<acc_t>(weight + c0, k),
                       b = load_block<acc_t>(bias + c0, k);
    for (int64_t i = 0; i < xv.n; ++i) {
      for (int64_t j = 0; j < xv.s; ++j) {
        const Block<acc_t> y = (at(i, j) - mu) * rs * w + b;
        store_block(out + i * ov.n_stride + j * ov.s_stride + c0, relu ? CPU_CAPABILITY::relu(y) : y, k);
      }
    }
  }
}

template <typename acc_t, typename x_t>
void batch_norm_act_bwd_vec(x_t* dx, acc_t* dweight, acc_t* dbias, const x_t* dout, const BnView& dv, const x_t* x,
                            const BnView& xv, const BnView& dxv, const acc_t* weight, const acc_t* bias,
                            const acc_t* mean, const acc_t* rstd, bool relu, int64_t c_begin, int64_t c_end,
                            BnPath path) {
  const double count = static_cast<double>(xv.n * xv.s);
  // dy (dout masked by the recomputed pre-activation) and xhat of a block at x offset xo, dout offset do_.
  auto dy_xhat = [&](int64_t xo, int64_t do_, int64_t k, const Block<acc_t>& mu, const Block<acc_t>& rs,
                     const Block<acc_t>& w, const Block<acc_t>& b, Block<acc_t>* dy, Block<acc_t>* xhat) {
    const Block<acc_t> xb = load_block<acc_t>(x + xo, k);
    *xhat = (xb - mu) * rs;
    const Block<acc_t> d = load_block<acc_t>(dout + do_, k);
    *dy = relu ? relu_masked((xb - mu) * rs * w + b, d) : d;
  };
  if (path == BnPath::Spatial) {
    for (int64_t c = c_begin; c < c_end; ++c) {
      const Block<acc_t> mu(mean[c]), rs(rstd[c]), w(weight[c]), b(bias[c]);
      Block<acc_t> part_dy(acc_t(0)), part_dy_xhat(acc_t(0));
      double sum_dy = 0, sum_dy_xhat = 0;
      for_spatial_chunks<acc_t>(
          xv,
          [&](int64_t i, int64_t j, int64_t k) C10_ALWAYS_INLINE_ATTRIBUTE {
            Block<acc_t> dy, xhat;
            dy_xhat(c * xv.c_stride + i * xv.n_stride + j, c * dv.c_stride + i * dv.n_stride + j, k, mu, rs, w, b, &dy, &xhat);
            part_dy = part_dy + first(dy, k);
            part_dy_xhat = part_dy_xhat + first(dy * xhat, k);
          },
          [&] {
            add_total(sum_dy, part_dy);
            add_total(sum_dy_xhat, part_dy_xhat);
          });
      const Block<acc_t> mean_dy(static_cast<acc_t>(sum_dy / count));
      const Block<acc_t> mean_dy_xhat(static_cast<acc_t>(sum_dy_xhat / count)), scale(rstd[c] * weight[c]);
      for (int64_t i = 0; i < xv.n; ++i) {
        for_blocks<acc_t>(xv.s, [&](int64_t j, int64_t k) C10_ALWAYS_INLINE_ATTRIBUTE {
          Block<acc_t> dy, xhat;
          dy_xhat(c * xv.c_stride + i * xv.n_stride + j, c * dv.c_stride + i * dv.n_stride + j, k, mu, rs, w, b, &dy, &xhat);
          store_block(dx + c * dxv.c_stride + i * dxv.n_stride + j, scale * (dy - mean_dy - xhat * mean_dy_xhat), k);
        });
      }
      dweight[c] = static_cast<acc_t>(sum_dy_xhat);
      dbias[c] = static_cast<acc_t>(sum_dy);
    }
    return;
  }
  for (int64_t c0 = c_begin; c0 < c_end; c0 += kBlock<acc_t>) {  // BnPath::Channels
    const int64_t k = std::min(kBlock<acc_t>, c_end - c0);
    const Block<acc_t> mu = load_block<acc_t>(mean + c0, k), rs = load_block<acc_t>(rstd + c0, k),
                       w = load_block<acc_t>(weight + c0, k), b = load_block<acc_t>(bias + c0, k);
    Block<acc_t> part_dy(acc_t(0)), part_dy_xhat(acc_t(0));
    double sum_dy[kBlock<acc_t>] = {}, sum_dy_xhat[kBlock<acc_t>] = {};
    for_position_chunks(
        xv,
        [&](int64_t i, int64_t j) C10_ALWAYS_INLINE_ATTRIBUTE {
          Block<acc_t> dy, xhat;
          dy_xhat(i * xv.n_stride + j * xv.s_stride + c0, i * dv.n_stride + j * dv.s_stride + c0, k, mu, rs, w, b, &dy, &xhat);
          part_dy = part_dy + dy;
          part_dy_xhat = part_dy_xhat + dy * xhat;
        },
        [&] {
          add_lanes(sum_dy, part_dy);
          add_lanes(sum_dy_xhat, part_dy_xhat);
        });
    __at_align__ acc_t means[2][kBlock<acc_t>];  // of dy and dy * xhat, per channel
    for (int64_t l = 0; l < k; ++l) {
      dbias[c0 + l] = static_cast<acc_t>(sum_dy[l]);
      dweight[c0 + l] = static_cast<acc_t>(sum_dy_xhat[l]);
      means[0][l] = static_cast<acc_t>(sum_dy[l] / count);
      means[1][l] = static_cast<acc_t>(sum_dy_xhat[l] / count);
    }
    const Block<acc_t> mean_dy = load_block<acc_t>(means[0], k), mean_dy_xhat = load_block<acc_t>(means[1], k),
                       scale = rs * w;
    for (int64_t i = 0; i < xv.n; ++i) {
      for (int64_t j = 0; j < xv.s; ++j) {
        Block<acc_t> dy, xhat;
        dy_xhat(i * xv.n_stride + j * xv.s_stride + c0, i * dv.n_stride + j * dv.s_stride + c0, k, mu, rs, w, b, &dy, &xhat);
        store_block(dx + i * dxv.n_stride + j * dxv.s_stride + c0, scale * (dy - mean_dy - xhat * mean_dy_xhat), k);
      }
    }
  }
}

void batch_norm_act(void* out, void* mean, void* rstd, const void* x, ScalarKind x_kind, const BnView& xv,
                    const BnView& ov, const void* weight, const void* bias, double eps, bool relu, int64_t c_begin,
                    int64_t c_end) {
  dispatch_float_type(x_kind, [&](auto x_tag) {
    using x_t = typename decltype(x_tag)::type;
    using acc_t = typename std::conditional<std::is_same_v<x_t, double>, double, float>::type;
    const BnPath path = bn_path({&xv, &ov});
    if (path != BnPath::Scalar) {
      batch_norm_act_vec<acc_t>(static_cast<x_t*>(out), static_cast<acc_t*>(mean), static_cast<acc_t*>(rstd),
                                static_cast<const x_t*>(x), xv, ov, static_cast<const acc_t*>(weight),
                                static_cast<const acc_t*>(bias), static_cast<acc_t>(eps), relu, c_begin, c_end, path);
      return;
    }
    RK_SCALAR(batch_norm_act,
              batch_norm_act_cpu<acc_t>(static_cast<x_t*>(out), static_cast<acc_t*>(mean), static_cast<acc_t*>(rstd),
                                        static_cast<const x_t*>(x), xv, ov, static_cast<const acc_t*>(weight),
                                        static_cast<const acc_t*>(bias), static_cast<acc_t>(eps), relu, c_begin, c_end),
              out, mean, rstd, x, x_kind, xv, ov, weight, bias, eps, relu, c_begin, c_end);
  });
}

void batch_norm_act_bwd(void* dx, void* dweight, void* dbias, const void* dout, const BnView& dv, const void* x,
                        ScalarKind x_kind, const BnView& xv, const BnView& dxv, const void* weight, const void* bias,
                        const void* mean, const void* rstd, bool relu, int64_t c_begin, int64_t c_end) {
  dispatch_float_type(x_kind, [&](auto x_tag) {
    using x_t = typename decltype(x_tag)::type;
    using acc_t = typename std::conditional<std::is_same_v<x_t, double>, double, float>::type;
    const BnPath path = bn_path({&dv, &xv, &dxv});
    if (path != BnPath::Scalar) {
      batch_norm_act_bwd_vec<acc_t>(static_cast<x_t*>(dx), static_cast<acc_t*>(dweight), static_cast<acc_t*>(dbias),
                                    static_cast<const x_t*>(dout), dv, static_cast<const x_t*>(x), xv, dxv,
                                    static_cast<const acc_t*>(weight), static_cast<const acc_t*>(bias),
                                    static_cast<const acc_t*>(mean), static_cast<const acc_t*>(rstd), relu, c_begin,
                                    c_end, path);
      return;
    }
    RK_SCALAR(batch_norm_act_bwd,
              batch_norm_act_bwd_cpu<acc_t>(static_cast<x_t*>(dx), static_cast<acc_t*>(dweight),
                                            static_cast<acc_t*>(dbias), static_cast<const x_t*>(dout), dv,
                                            static_cast<const x_t*>(x), xv, dxv, static_cast<const acc_t*>(weight),
                                            static_cast<const acc_t*>(bias), static_cast<const acc_t*>(mean),
                                            static_cast<const acc_t*>(rstd), relu, c_begin, c_end),
              dx, dweight, dbias, dout, dv, x, x_kind, xv, dxv, weight, bias, mean, rstd, relu, c_begin, c_end);
  });
}

// --- fixed point (the exact mode's int64 streams) -------------------------------------------------
// The AVX512 builds convert 8 lanes at a time with AVX512DQ's float <-> int64 conversions, each
// rounding once to nearest even (what the scalar kernel's llrint and int64 -> float casts do); the
// other builds run the scalar kernel (AVX2 has no int64 <-> float conversions).

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// 8 branch values (the lanes of m; the others zero) in their accumulation type.
C10_ALWAYS_INLINE __m256 load8(const float* p, __mmask8 m) { return _mm256_maskz_loadu_ps(m, p); }
C10_ALWAYS_INLINE __m256 load8(const Half* p, __mmask8 m) { return _mm256_cvtph_ps(_mm_maskz_loadu_epi16(m, p)); }
C10_ALWAYS_INLINE __m256 load8(const BFloat16* p, __mmask8 m) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_maskz_loadu_epi16(m, p)), 16));
}
C10_ALWAYS_INLINE __m512d load8(const double* p, __mmask8 m) { return _mm512_maskz_loadu_pd(m, p); }

// q of 8 values: round_half_even(v * 2^b), 0 where not |v * 2^b| < 2^62 (those lanes of m set in `bad`).
C10_ALWAYS_INLINE __m512i quantize8(__m256 v, const FixedPointScales& s, __mmask8 m, __mmask8& bad) {
  const __m256 scaled = _mm256_mul_ps(v, _mm256_set1_ps(s.up_f));
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), scaled);
  const __mmask8 fits = _mm256_cmp_ps_mask(magnitude, _mm256_set1_ps(0x1p62f), _CMP_LT_OQ);  // false for NaN
  bad = static_cast<__mmask8>(m & ~fits);
  return _mm512_maskz_cvt_roundps_epi64(fits, scaled, kNearest);
}
C10_ALWAYS_INLINE __m512i quantize8(__m512d v, const FixedPointScales& s, __mmask8 m, __mmask8& bad) {
  const __m512d scaled = _mm512_mul_pd(v, _mm512_set1_pd(s.up_d));
  const __m512d magnitude = _mm512_abs_pd(scaled);
  const __mmask8 fits = _mm512_cmp_pd_mask(magnitude, _mm512_set1_pd(0x1p62), _CMP_LT_OQ);
  bad = static_cast<__mmask8>(m & ~fits);
  return _mm512_maskz_cvt_roundpd_epi64(fits, scaled, kNearest);
}

// Stores view(r) of the lanes of m: float(r) (double(r)) rounded once, times 2^-b, rounded to view_t.
C10_ALWAYS_INLINE __m256 scaled_view8(__m512i r, const FixedPointScales& s) {
  return _mm256_mul_ps(_mm512_cvt_roundepi64_ps(r, kNearest), _mm256_set1_ps(s.down_f));
}
C10_ALWAYS_INLINE void store_view8(float* p, __m512i r, const FixedPointScales& s, __mmask8 m) {
  _mm256_mask_storeu_ps(p, m, scaled_view8(r, s));
}
C10_ALWAYS_INLINE void store_view8(double* p, __m512i r, const FixedPointScales& s, __mmask8 m) {
  _mm512_mask_storeu_pd(p, m, _mm512_mul_pd(_mm512_cvt_roundepi64_pd(r, kNearest), _mm512_set1_pd(s.down_d)));
}
C10_ALWAYS_INLINE void store_view8(Half* p, __m512i r, const FixedPointScales& s, __mmask8 m) {
  _mm_mask_storeu_epi16(p, m, _mm256_cvtps_ph(scaled_view8(r, s), kNearest));
}
// (bf16 by integer rounding in both AVX512 builds, so the one code is what the tests on either CPU
// run; a view is finite, never NaN: the rounding needs no NaN case)
C10_ALWAYS_INLINE void store_view8(BFloat16* p, __m512i r, const FixedPointScales& s, __mmask8 m) {
  const __m256i u = _mm256_castps_si256(scaled_view8(r, s));  // round to nearest even on the 16 dropped bits
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  _mm_mask_storeu_epi16(p, m, _mm256_cvtepi32_epi16(_mm256_srli_epi32(rounded, 16)));
}

// fixed_point_cpu for layouts whose innermost dim has unit stride in x and f.
template <FixedPointOp op, typename f_t, typename view_t>
bool fixed_point_vec(int64_t* out, view_t* view, const int64_t* x, const f_t* f, int bits, const CouplingLayout& layout,
                     int64_t begin, int64_t end) {
  const FixedPointScales s = fixed_point_scales(bits);
  const __m512i limit = _mm512_set1_epi64(kFixedPointLimit), minus_limit = _mm512_set1_epi64(-kFixedPointLimit);
  __mmask8 flags = 0;
  for_each_layout_run(layout, begin, end, [&](int64_t linear, int64_t a_off, int64_t b_off, int64_t run) {
    for (int64_t i = 0; i < run; i += 8) {
      const __mmask8 m = run - i >= 8 ? __mmask8(0xFF) : static_cast<__mmask8>((1u << (run - i)) - 1);
      __m512i r;
      if constexpr (op == FixedPointOp::View) {
        r = _mm512_maskz_loadu_epi64(m, x + a_off + i);
      } else {
        __mmask8 bad;
        r = quantize8(load8(f + b_off + i, m), s, m, bad);
        if constexpr (op == FixedPointOp::Add) r = _mm512_add_epi64(_mm512_maskz_loadu_epi64(m, x + a_off + i), r);
        if constexpr (op == FixedPointOp::Sub) r = _mm512_sub_epi64(_mm512_maskz_loadu_epi64(m, x + a_off + i), r);
        flags |= bad | _mm512_mask_cmpge_epi64_mask(m, r, limit) | _mm512_mask_cmple_epi64_mask(m, r, minus_limit);
        _mm512_mask_storeu_epi64(out + linear + i, m, r);
      }
      store_view8(view + linear + i, r, s, m);
    }
  });
  return flags != 0;
}
#endif

bool fixed_point(FixedPointOp op, int64_t* out, void* view, ScalarKind view_kind, const int64_t* x, const void* f,
                 ScalarKind f_kind, int bits, const CouplingLayout& layout, int64_t begin, int64_t end) {
  return dispatch_fixed_point(op, f_kind, view_kind, [&](auto op_tag, auto f_tag, auto view_tag) {
    [[maybe_unused]] constexpr FixedPointOp kOp = decltype(op_tag)::value;
    using f_t = typename decltype(f_tag)::type;
    using view_t = typename decltype(view_tag)::type;
    [[maybe_unused]] auto* v = static_cast<view_t*>(view);  // (unused where RK_SCALAR forwards)
    [[maybe_unused]] const auto* pf = static_cast<const f_t*>(f);
#if defined(CPU_CAPABILITY_AVX512)
    const int nd = layout.ndim;
    if (nd > 0 && layout.a_strides[nd - 1] == 1 && layout.b_strides[nd - 1] == 1) {
      return fixed_point_vec<kOp>(out, v, x, pf, bits, layout, begin, end);
    }
#endif
    return RK_SCALAR(fixed_point, fixed_point_cpu<kOp>(out, v, x, pf, bits, layout, begin, end), op, out, view,
                     view_kind, x, f, f_kind, bits, layout, begin, end);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace revkernels

namespace revkernels {
namespace CPU_CAPABILITY {

// Function pointers only: constant-initialised, no code runs at load time.
extern const CpuKernels kCpuKernels;
const CpuKernels kCpuKernels = {RK_CPU_ISA,         RK_NAME(CPU_CAPABILITY), coupling_axpy, sub_layer_norm,   layer_norm_bwd_add,
                                bias_gelu,          bias_gelu_bwd,   batch_norm_act, batch_norm_act_bwd,
                                fixed_point};

}  // namespace CPU_CAPABILITY
}  // namespace revkernels
