// Unit test of the vectorised CPU kernels (cpu/vec_kernels.h): every ISA build this CPU runs
// (DEFAULT, AVX2, AVX512, AVX512_BF16; cpu_kernels_for), called directly, against naive loops in double, for
// each data type and mixed pairs (the fp64-mixed ones take the scalar path), widths that leave
// every vector tail (1 to 100 and a 1000-wide row), padded and broadcast rows, a strided innermost
// dim, and row ranges split as threads would split them. Links the op library (the kernels live
// there), hence the _ops name.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <type_traits>
#include <vector>

#include "cpu/vec_kernels.h"
#include "tests/check.h"
#include "tests/values.h"

using namespace rktest;
using namespace revkernels;

namespace {

const int64_t kWidths[] = {1, 3, 8, 15, 16, 17, 31, 33, 64, 100, 1000};

template <typename T> using acc_of = std::conditional_t<std::is_same_v<T, double>, double, float>;

// One rounding to out_t at |want| (ulp: a rounding-boundary flip included; one subnormal spacing
// near zero) plus the accumulation type's error relative to `scale`.
template <typename out_t, typename acc_t>
bool close(double got, double want, double scale) {
  const double acc = std::is_same_v<acc_t, double> ? 1e-12 : 2e-6;
  return std::fabs(got - want) <= Traits<out_t>::ulp * std::fabs(want) + 2 * Traits<out_t>::subnormal + acc * scale;
}

template <typename T> std::vector<T> random_values(int64_t count, double mean, double spread, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(mean, spread);
  std::vector<T> v(count);
  for (auto& x : v) x = from_double<T>(normal(rng));
  return v;
}

// --- coupling: out = a + alpha * b over a (rows, n) layout; b broadcast along rows or not, a's
// innermost stride 1 or 2 (the strided case takes the scalar path).
template <typename out_t, typename b_t>
void check_coupling(const CpuKernels& k, int64_t rows, int64_t n, bool b_broadcast, int64_t a_inner,
                    std::mt19937_64& rng) {
  using acc_t = std::conditional_t<std::is_same_v<out_t, double> || std::is_same_v<b_t, double>, double, float>;
  const auto a = random_values<out_t>(rows * n * a_inner, 0.0, 2.0, rng);
  const auto b = random_values<b_t>(b_broadcast ? n : rows * n, 0.0, 2.0, rng);
  CouplingLayout layout;
  layout.ndim = 2;
  layout.sizes[0] = rows, layout.sizes[1] = n;
  layout.a_strides[0] = n * a_inner, layout.a_strides[1] = a_inner;
  layout.b_strides[0] = b_broadcast ? 0 : n, layout.b_strides[1] = 1;
  std::vector<out_t> out(rows * n, sentinel<out_t>());
  const int64_t total = rows * n, split = total / 3 + 1;  // two ranges, as two threads would get
  auto run = [&](out_t* o, bool stream) {
    k.coupling_axpy(o, a.data(), Traits<out_t>::kind, b.data(), Traits<b_t>::kind, -1.0, layout, 0, split, stream);
    k.coupling_axpy(o, a.data(), Traits<out_t>::kind, b.data(), Traits<b_t>::kind, -1.0, layout, split, total, stream);
  };
  run(out.data(), false);
  // Streaming stores from every start alignment (peel, whole blocks, tail) write the same values.
  std::vector<out_t> streamed(total + 64);
  for (int64_t offset : {0, 1, 3}) {
    std::fill(streamed.begin(), streamed.end(), sentinel<out_t>());  // an unwritten element stays NaN
    run(streamed.data() + offset, true);
    RK_CHECK(std::equal(out.begin(), out.end(), streamed.begin() + offset, same_bits<out_t>),
             "%s coupling %s/%s n %lld: streamed output at offset %lld differs", k.name, Traits<out_t>::name,
             Traits<b_t>::name, (long long)n, (long long)offset);
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      const double want = to_double(a[(r * n + i) * a_inner]) - to_double(b[(b_broadcast ? 0 : r * n) + i]);
      const double got = to_double(out[r * n + i]);
      RK_CHECK((close<out_t, acc_t>(got, want, std::fabs(want))), "%s coupling %s/%s rows %lld n %lld [%lld,%lld]: %g vs %g",
               k.name, Traits<out_t>::name, Traits<b_t>::name, (long long)rows, (long long)n, (long long)r,
               (long long)i, got, want);
    }
  }
}

// --- sub_layer_norm and layer_norm_bwd_add, rows of n with padded y / broadcast g rows.
template <typename x_t, typename g_t>
void check_layer_norm(const CpuKernels& k, int64_t rows, int64_t n, std::mt19937_64& rng) {
  using acc_t = std::conditional_t<std::is_same_v<x_t, double> || std::is_same_v<g_t, double>, double, float>;
  const int64_t y_stride = n + 3;
  const auto y = random_values<x_t>(rows * y_stride, 0.5, 3.0, rng);
  const auto g = random_values<g_t>(n, 0.0, 1.0, rng);  // one row, broadcast (row stride 0)
  std::vector<acc_t> w(n), b(n);
  for (int64_t i = 0; i < n; ++i) w[i] = acc_t(0.5 + 0.01 * i), b[i] = acc_t(0.1 * (i % 7) - 0.3);
  std::vector<x_t> x(rows * n, sentinel<x_t>()), ln(rows * n, sentinel<x_t>());
  std::vector<acc_t> mean(rows), rstd(rows);
  const double eps = 1e-5;
  const int64_t split = rows / 2;
  auto forward = [&](x_t* xo, x_t* lo, acc_t* mo, acc_t* ro, bool stream) {
    for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, split}, {split, rows}}) {
      k.sub_layer_norm(xo, lo, mo, ro, Traits<x_t>::kind, y.data(), y_stride, g.data(), Traits<g_t>::kind, 0, w.data(),
                       b.data(), eps, n, r0, r1, stream);
    }
  };
  forward(x.data(), ln.data(), mean.data(), rstd.data(), false);
  // Streamed: x and ln equally aligned in one buffer (a gap of 32 elements' multiple), from several
  // start alignments, and in two separate buffers (streaming may fall back to plain stores there):
  // the same values bit for bit.
  const int64_t gap = (rows * n + 31) / 32 * 32;
  std::vector<x_t> both(2 * gap + 64), x2(rows * n), ln2(rows * n);
  std::vector<acc_t> mean2(rows), rstd2(rows);
  for (int64_t offset : {-1, 0, 1, 5}) {
    for (auto* buffer : {&both, &x2, &ln2}) std::fill(buffer->begin(), buffer->end(), sentinel<x_t>());
    x_t* xo = offset < 0 ? x2.data() : both.data() + offset;
    x_t* lo = offset < 0 ? ln2.data() : both.data() + offset + gap;
    forward(xo, lo, mean2.data(), rstd2.data(), true);
    const bool same = std::equal(x.begin(), x.end(), xo, same_bits<x_t>) &&
                      std::equal(ln.begin(), ln.end(), lo, same_bits<x_t>) &&
                      std::equal(mean.begin(), mean.end(), mean2.begin(), same_bits<acc_t>) &&
                      std::equal(rstd.begin(), rstd.end(), rstd2.begin(), same_bits<acc_t>);
    RK_CHECK(same, "%s sub_layer_norm %s/%s n %lld: streamed outputs (offset %lld) differ", k.name, Traits<x_t>::name,
             Traits<g_t>::name, (long long)n, (long long)offset);
  }
  for (int64_t r = 0; r < rows; ++r) {
    // Reference statistics of the stored x (the op normalises the x it returns).
    double mu = 0, var = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double want = to_double(y[r * y_stride + i]) - to_double(g[i]);
      RK_CHECK((close<x_t, acc_t>(to_double(x[r * n + i]), want, std::fabs(want))), "%s sub_layer_norm x %s/%s n %lld",
               k.name, Traits<x_t>::name, Traits<g_t>::name, (long long)n);
      mu += to_double(x[r * n + i]);
    }
    mu /= n;
    for (int64_t i = 0; i < n; ++i) var += (to_double(x[r * n + i]) - mu) * (to_double(x[r * n + i]) - mu);
    const double rs = 1.0 / std::sqrt(var / n + eps);
    RK_CHECK((close<acc_t, acc_t>(mean[r], mu, 3.0 + std::fabs(mu))), "%s mean %s/%s n %lld: %g vs %g", k.name,
             Traits<x_t>::name, Traits<g_t>::name, (long long)n, double(mean[r]), mu);
    RK_CHECK((close<acc_t, acc_t>(rstd[r], rs, 8 * rs)), "%s rstd %s/%s n %lld: %g vs %g", k.name, Traits<x_t>::name,
             Traits<g_t>::name, (long long)n, double(rstd[r]), rs);
    for (int64_t i = 0; i < n; ++i) {
      const double want = (to_double(x[r * n + i]) - mu) * rs * w[i] + b[i];
      const double got = to_double(ln[r * n + i]);
      RK_CHECK((close<x_t, acc_t>(got, want, 16.0)), "%s sub_layer_norm ln %s/%s n %lld [%lld]: %g vs %g", k.name,
               Traits<x_t>::name, Traits<g_t>::name, (long long)n, (long long)i, got, want);
    }
  }

  // Backward: dres has g_t's dtype (dx's dtype), dln x's; two blocks of rows with their partials.
  const auto dln = random_values<x_t>(rows * n, 0.0, 1.0, rng);
  const auto dres = random_values<g_t>(rows * n, 0.0, 1.0, rng);
  std::vector<g_t> dx(rows * n, sentinel<g_t>());
  std::vector<acc_t> dw_part(2 * n, acc_t(7)), db_part(2 * n, acc_t(7));  // overwritten, not added to
  int64_t block = 0;
  for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, split}, {split, rows}}) {
    k.layer_norm_bwd_add(dx.data(), Traits<g_t>::kind, dw_part.data() + block * n, db_part.data() + block * n,
                         dln.data(), n, x.data(), Traits<x_t>::kind, n, w.data(), mean.data(), rstd.data(), dres.data(),
                         n, n, r0, r1);
    ++block;
  }
  std::vector<double> dw(n, 0.0), db(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    double s1 = 0, s2 = 0;
    std::vector<double> xhat(n), dxhat(n);
    for (int64_t i = 0; i < n; ++i) {
      xhat[i] = (to_double(x[r * n + i]) - double(mean[r])) * double(rstd[r]);
      dxhat[i] = to_double(dln[r * n + i]) * w[i];
      s1 += dxhat[i], s2 += dxhat[i] * xhat[i];
      dw[i] += to_double(dln[r * n + i]) * xhat[i];
      db[i] += to_double(dln[r * n + i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const double want = to_double(dres[r * n + i]) + double(rstd[r]) * (dxhat[i] - s1 / n - xhat[i] * s2 / n);
      const double got = to_double(dx[r * n + i]);
      RK_CHECK((close<g_t, acc_t>(got, want, 16.0 * double(rstd[r]))), "%s layer_norm_bwd_add dx %s/%s n %lld [%lld]: %g vs %g",
               k.name, Traits<x_t>::name, Traits<g_t>::name, (long long)n, (long long)i, got, want);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const double got_w = double(dw_part[i]) + double(dw_part[n + i]), got_b = double(db_part[i]) + double(db_part[n + i]);
    RK_CHECK((close<acc_t, acc_t>(got_w, dw[i], 4.0 * rows)), "%s dweight %s n %lld [%lld]: %g vs %g", k.name,
             Traits<x_t>::name, (long long)n, (long long)i, got_w, dw[i]);
    RK_CHECK((close<acc_t, acc_t>(got_b, db[i], 4.0 * rows)), "%s dbias %s n %lld [%lld]: %g vs %g", k.name,
             Traits<x_t>::name, (long long)n, (long long)i, got_b, db[i]);
  }
}

// --- bias + GELU, forward and backward, both forms; x rows padded.
double gelu_ref(double z, GeluApprox a) {
  if (a == GeluApprox::Tanh) return 0.5 * z * (1 + std::tanh(std::sqrt(2 / M_PI) * (z + 0.044715 * z * z * z)));
  return 0.5 * z * (1 + std::erf(z / std::sqrt(2.0)));
}

double gelu_grad_ref(double z, GeluApprox a) {
  if (a == GeluApprox::Tanh) {
    const double u = std::sqrt(2 / M_PI) * (z + 0.044715 * z * z * z), t = std::tanh(u);
    return 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * std::sqrt(2 / M_PI) * (1 + 3 * 0.044715 * z * z);
  }
  return 0.5 * (1 + std::erf(z / std::sqrt(2.0))) + z * std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI);
}

template <typename x_t, typename bias_t>
void check_bias_gelu(const CpuKernels& k, int64_t rows, int64_t n, GeluApprox approx, std::mt19937_64& rng) {
  using acc_t = std::conditional_t<std::is_same_v<x_t, double> || std::is_same_v<bias_t, double>, double, float>;
  const int64_t stride = n + 5;
  const auto x = random_values<x_t>(rows * stride, 0.0, 3.0, rng);
  const auto bias = random_values<bias_t>(n, 0.0, 1.0, rng);
  const auto dy = random_values<x_t>(rows * stride, 0.0, 1.0, rng);
  std::vector<x_t> out(rows * n, sentinel<x_t>()), dx(rows * n, sentinel<x_t>());
  std::vector<acc_t> partial(n, acc_t(0));
  const int64_t split = rows / 2;
  for (auto [r0, r1] : {std::pair<int64_t, int64_t>{0, split}, {split, rows}}) {
    k.bias_gelu(out.data(), x.data(), Traits<x_t>::kind, stride, bias.data(), Traits<bias_t>::kind, n, approx, r0, r1);
    k.bias_gelu_bwd(dx.data(), dy.data(), stride, x.data(), Traits<x_t>::kind, stride, bias.data(), Traits<bias_t>::kind,
                    n, approx, r0, r1, partial.data());
  }
  std::vector<double> db(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      const double z = to_double(x[r * stride + i]) + to_double(bias[i]);
      const double want = gelu_ref(z, approx), got = to_double(out[r * n + i]);
      RK_CHECK((close<x_t, acc_t>(got, want, 1.0 + std::fabs(z))), "%s bias_gelu %s/%s %d n %lld: z %g: %g vs %g", k.name,
               Traits<x_t>::name, Traits<bias_t>::name, int(approx), (long long)n, z, got, want);
      const double want_dx = to_double(dy[r * stride + i]) * gelu_grad_ref(z, approx), got_dx = to_double(dx[r * n + i]);
      RK_CHECK((close<x_t, acc_t>(got_dx, want_dx, 2.0 * std::fabs(to_double(dy[r * stride + i])))),
               "%s bias_gelu_bwd %s/%s %d n %lld: z %g: %g vs %g", k.name, Traits<x_t>::name, Traits<bias_t>::name,
               int(approx), (long long)n, z, got_dx, want_dx);
      db[i] += want_dx;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    RK_CHECK((close<acc_t, acc_t>(partial[i], db[i], 4.0 * rows)), "%s dbias %s %d n %lld [%lld]: %g vs %g", k.name,
             Traits<x_t>::name, int(approx), (long long)n, (long long)i, double(partial[i]), db[i]);
  }
}

// --- BatchNorm + ReLU forward (NCHW), one small case per build.
template <typename x_t>
void check_batch_norm(const CpuKernels& k, std::mt19937_64& rng) {
  using acc_t = acc_of<x_t>;
  const int64_t n = 3, c = 5, s = 37;
  const auto x = random_values<x_t>(n * c * s, 1.0, 2.0, rng);
  BnView v;
  v.n = n, v.s = s, v.n_stride = c * s, v.c_stride = s, v.s_stride = 1;
  std::vector<acc_t> w(c, acc_t(1.5)), b(c, acc_t(0.25)), mean(c), rstd(c);
  std::vector<x_t> out(n * c * s, sentinel<x_t>());
  k.batch_norm_act(out.data(), mean.data(), rstd.data(), x.data(), Traits<x_t>::kind, v, v, w.data(), b.data(), 1e-5,
                   true, 0, c);
  for (int64_t ch = 0; ch < c; ++ch) {
    double mu = 0, var = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < s; ++j) mu += to_double(x[i * c * s + ch * s + j]);
    mu /= n * s;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < s; ++j) var += std::pow(to_double(x[i * c * s + ch * s + j]) - mu, 2);
    const double rs = 1.0 / std::sqrt(var / (n * s) + 1e-5);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < s; ++j) {
        const int64_t at = i * c * s + ch * s + j;
        const double want = std::max(0.0, (to_double(x[at]) - mu) * rs * 1.5 + 0.25), got = to_double(out[at]);
        RK_CHECK((close<x_t, acc_t>(got, want, 8.0)), "%s batch_norm_act %s: %g vs %g", k.name, Traits<x_t>::name, got, want);
      }
    }
  }
}

template <typename A, typename B>
void check_pair(const CpuKernels& k, std::mt19937_64& rng) {
  for (int64_t n : kWidths) {
    const int64_t rows = n >= 1000 ? 3 : 5;
    check_coupling<A, B>(k, rows, n, false, 1, rng);
    check_coupling<A, B>(k, rows, n, true, 1, rng);
    check_coupling<A, B>(k, rows, n, false, 2, rng);
    check_layer_norm<A, B>(k, rows, n, rng);
    check_bias_gelu<A, B>(k, rows, n, GeluApprox::None, rng);
    check_bias_gelu<A, B>(k, rows, n, GeluApprox::Tanh, rng);
  }
}

// A bf16 output whose fp32 value is subnormal (2^-127): the AVX512_BF16 build's conversion
// (vcvtne2ps2bf16) flushes it to +0; every other build rounds it to bf16's subnormal 2^-127.
void check_bf16_subnormal_output(const CpuKernels& k) {
  const int64_t n = 40;  // whole vector blocks and a tail in every build
  const std::vector<BFloat16> a(n, from_double<BFloat16>(std::ldexp(1.5, -126)));
  const std::vector<BFloat16> b(n, from_double<BFloat16>(std::ldexp(1.0, -126)));
  std::vector<BFloat16> out(n, sentinel<BFloat16>());
  CouplingLayout layout;
  layout.ndim = 1;
  layout.sizes[0] = n, layout.a_strides[0] = 1, layout.b_strides[0] = 1;
  k.coupling_axpy(out.data(), a.data(), Traits<BFloat16>::kind, b.data(), Traits<BFloat16>::kind, -1.0, layout, 0, n, false);
  const double want = k.isa == CpuIsa::Avx512Bf16 ? 0.0 : std::ldexp(1.0, -127);
  for (int64_t i = 0; i < n; ++i) {
    RK_CHECK(to_double(out[i]) == want, "%s bf16 subnormal output %lld: %g, expected %g", k.name, (long long)i,
             to_double(out[i]), want);
  }
}

void check_kernels(const CpuKernels& k) {
  std::mt19937_64 rng(1234);
  check_bf16_subnormal_output(k);
  check_pair<float, float>(k, rng);
  check_pair<double, double>(k, rng);
  check_pair<BFloat16, BFloat16>(k, rng);
  check_pair<Half, Half>(k, rng);
  check_pair<BFloat16, float>(k, rng);
  check_pair<float, Half>(k, rng);
  check_pair<float, double>(k, rng);  // scalar path
  check_batch_norm<float>(k, rng);
  check_batch_norm<BFloat16>(k, rng);
  check_batch_norm<double>(k, rng);
}

}  // namespace

int main() {
  int builds = 0;
  for (CpuIsa isa : {CpuIsa::Default, CpuIsa::Avx2, CpuIsa::Avx512, CpuIsa::Avx512Bf16}) {
    const CpuKernels* k = cpu_kernels_for(isa);
    if (k == nullptr) {
      std::printf("ISA %d: not built or not supported by this CPU, skipped\n", int(isa));
      continue;
    }
    RK_CHECK(k->isa == isa, "cpu_kernels_for(%d) returned the %s build", int(isa), k->name);
    std::printf("checking the %s build\n", k->name);
    check_kernels(*k);
    ++builds;
  }
  RK_CHECK(builds >= 1, "no kernel build ran");
  std::printf("cpu_kernels() picks %s\n", cpu_kernels().name);
  return finish("test_cpu_vec_ops");
}
