// Unit test of the torch-free bias + GELU kernels (kernels/bias_gelu.h) against a naive loop in
// double that uses the textbook formulas (std::erf, std::tanh; not the kernels' sigmoid form):
// the GELU value/derivative helpers over a wide range, the forward and backward row kernels for
// every dtype pair the op glue dispatches (row strides > n, uneven row chunks), the dbias partial
// sums and their reduction, and the chunking rule.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/bias_gelu.h"
#include "tests/check.h"
#include "tests/values.h"

using namespace rktest;

namespace {

using namespace revkernels;


template <typename T> bool is_nan(const T& v) { return std::isnan(to_double(v)); }

const char* approx_name(GeluApprox a) { return a == GeluApprox::Tanh ? "tanh" : "none"; }

// The textbook formulas, in double.
double gelu_ref(double z, GeluApprox a) {
  if (a == GeluApprox::Tanh) {
    const double u = std::sqrt(2.0 / M_PI) * (z + 0.044715 * z * z * z);
    return 0.5 * z * (1.0 + std::tanh(u));
  }
  return 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0)));
}

double gelu_grad_ref(double z, GeluApprox a) {
  if (a == GeluApprox::Tanh) {
    const double beta = std::sqrt(2.0 / M_PI), kappa = 0.044715;
    const double t = std::tanh(beta * (z + kappa * z * z * z));
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * beta * (1.0 + 3.0 * kappa * z * z);
  }
  return 0.5 * (1.0 + std::erf(z / std::sqrt(2.0))) + z * std::exp(-0.5 * z * z) / std::sqrt(2.0 * M_PI);
}

// Math error allowed for the accumulation type (relative to max(1, |value|)).
template <typename acc_t> constexpr double math_tol() { return std::is_same_v<acc_t, double> ? 1e-13 : 2e-6; }

void check_helpers() {
  for (GeluApprox a : {GeluApprox::None, GeluApprox::Tanh}) {
    for (double z = -40.0; z <= 40.0; z += 1.0 / 64) {
      const double want = gelu_ref(z, a), want_grad = gelu_grad_ref(z, a);
      const double scale = std::max(1.0, std::fabs(z));
      const double got_f = gelu_value<float>(static_cast<float>(z), a);
      const double got_d = gelu_value<double>(z, a);
      const double grad_f = gelu_derivative<float>(static_cast<float>(z), a);
      const double grad_d = gelu_derivative<double>(z, a);
      RK_CHECK(std::fabs(got_f - want) <= 2e-6 * scale, "gelu<float>(%g, %s) = %.9g, expected %.9g", z,
               approx_name(a), got_f, want);
      RK_CHECK(std::fabs(got_d - want) <= 1e-14 * scale, "gelu<double>(%g, %s) = %.17g, expected %.17g", z,
               approx_name(a), got_d, want);
      RK_CHECK(std::fabs(grad_f - want_grad) <= 2e-6 * scale, "gelu'<float>(%g, %s) = %.9g, expected %.9g", z,
               approx_name(a), grad_f, want_grad);
      RK_CHECK(std::fabs(grad_d - want_grad) <= 1e-14 * scale, "gelu'<double>(%g, %s) = %.17g, expected %.17g", z,
               approx_name(a), grad_d, want_grad);
    }
    // Far tails: finite, and gelu -> max(z, 0), gelu' -> step.
    for (double z : {-1e4, -300.0, 300.0, 1e4}) {
      const float gv = gelu_value<float>(static_cast<float>(z), a);
      const float gd = gelu_derivative<float>(static_cast<float>(z), a);
      RK_CHECK(std::isfinite(gv) && std::fabs(gv - std::max(z, 0.0)) <= 1e-6 * std::fabs(z),
               "gelu<float>(%g, %s) = %g", z, approx_name(a), gv);
      RK_CHECK(std::isfinite(gd) && gd == (z > 0 ? 1.0f : 0.0f), "gelu'<float>(%g, %s) = %g", z, approx_name(a),
               gd);
    }
  }
}

// Runs fn(acc_t, x_t, bias_t tags) through dispatch_float_pair as the op glue does, checking the
// dispatched types.
template <typename x_t, typename bias_t, typename Fn> void dispatched(Fn&& fn) {
  constexpr bool acc_double = std::is_same_v<x_t, double> || std::is_same_v<bias_t, double>;
  using want_acc = std::conditional_t<acc_double, double, float>;
  dispatch_float_pair(Traits<x_t>::kind, Traits<bias_t>::kind, [&](auto acc_tag, auto x_tag, auto bias_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    if constexpr (std::is_same_v<typename decltype(x_tag)::type, x_t> &&
                  std::is_same_v<typename decltype(bias_tag)::type, bias_t>) {
      RK_CHECK((std::is_same_v<acc_t, want_acc>), "x %s, bias %s: dispatched the wrong accumulation type",
               Traits<x_t>::name, Traits<bias_t>::name);
      fn(acc_tag);
    } else {
      RK_CHECK(false, "x %s, bias %s: dispatched other data types", Traits<x_t>::name, Traits<bias_t>::name);
    }
  });
}

struct Shape {
  int64_t rows, n, x_row_stride, dy_row_stride;
};

// Random row cut points [0 = c0 <= c1 <= ... <= ck = rows], some chunks empty.
std::vector<int64_t> random_cuts(int64_t rows, int pieces, std::mt19937_64& rng) {
  std::vector<int64_t> cuts{0, rows};
  std::uniform_int_distribution<int64_t> cut(0, rows);
  for (int k = 1; k < pieces; ++k) cuts.push_back(cut(rng));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

template <typename x_t, typename bias_t>
void check_kernels(const Shape& s, GeluApprox a, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.25, 2.0);
  const int64_t x_span = (s.rows - 1) * s.x_row_stride + s.n;
  const int64_t dy_span = (s.rows - 1) * s.dy_row_stride + s.n;
  std::vector<x_t> x(x_span), dy(dy_span);
  std::vector<bias_t> bias(s.n);
  for (auto& v : x) v = from_double<x_t>(normal(rng));
  for (auto& v : dy) v = from_double<x_t>(normal(rng) - 0.25);
  for (auto& v : bias) v = from_double<bias_t>(normal(rng) * 0.5);

  // Naive reference in double from the stored (rounded) inputs.
  std::vector<double> want_y(s.rows * s.n), want_dx(s.rows * s.n), want_dbias(s.n, 0.0), abs_dbias(s.n, 0.0);
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t j = 0; j < s.n; ++j) {
      const double z = to_double(x[r * s.x_row_stride + j]) + to_double(bias[j]);
      want_y[r * s.n + j] = gelu_ref(z, a);
      const double g = to_double(dy[r * s.dy_row_stride + j]) * gelu_grad_ref(z, a);
      want_dx[r * s.n + j] = g;
      want_dbias[j] += g;
      abs_dbias[j] += std::fabs(g);
    }
  }

  dispatched<x_t, bias_t>([&](auto acc_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    const double rel = Traits<x_t>::rounding * 1.0001, math = math_tol<acc_t>();
    auto close = [&](double got, double want, double scale) {
      return std::fabs(got - want) <= rel * std::fabs(want) + Traits<x_t>::subnormal + math * std::max(1.0, scale);
    };
    const std::vector<int64_t> cuts = random_cuts(s.rows, 4, rng);

    // Forward, in uneven row chunks: every row written once, nothing past the rows.
    std::vector<x_t> y(s.rows * s.n + 1, sentinel<x_t>());
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      bias_gelu_cpu<acc_t>(y.data(), x.data(), s.x_row_stride, bias.data(), s.n, a, cuts[k], cuts[k + 1]);
    }
    for (int64_t i = 0; i < s.rows * s.n; ++i) {
      const double got = to_double(y[i]);
      RK_CHECK(close(got, want_y[i], std::fabs(want_y[i])),
               "forward x %s bias %s %s, rows %" PRId64 " n %" PRId64 ": element %" PRId64 " = %.9g, expected %.9g",
               Traits<x_t>::name, Traits<bias_t>::name, approx_name(a), s.rows, s.n, i, got, want_y[i]);
    }
    RK_CHECK(is_nan(y[s.rows * s.n]), "forward wrote past its rows");

    // Backward: one partial row per chunk, pre-filled to check the kernel adds to it.
    const int64_t chunks = static_cast<int64_t>(cuts.size()) - 1;
    std::vector<acc_t> partials(chunks * s.n);
    for (int64_t c = 0; c < chunks; ++c) {
      for (int64_t j = 0; j < s.n; ++j) partials[c * s.n + j] = static_cast<acc_t>(c == 0 ? 0.5 : 0.0);
    }
    std::vector<x_t> dx(s.rows * s.n + 1, sentinel<x_t>());
    for (int64_t c = 0; c < chunks; ++c) {
      bias_gelu_bwd_cpu<acc_t>(dx.data(), dy.data(), s.dy_row_stride, x.data(), s.x_row_stride, bias.data(), s.n, a,
                               cuts[c], cuts[c + 1], partials.data() + c * s.n);
    }
    for (int64_t i = 0; i < s.rows * s.n; ++i) {
      const double got = to_double(dx[i]);
      RK_CHECK(close(got, want_dx[i], std::fabs(want_dx[i])),
               "backward dx, x %s bias %s %s, rows %" PRId64 " n %" PRId64 ": element %" PRId64 " = %.9g, expected %.9g",
               Traits<x_t>::name, Traits<bias_t>::name, approx_name(a), s.rows, s.n, i, got, want_dx[i]);
    }
    RK_CHECK(is_nan(dx[s.rows * s.n]), "backward wrote past its rows");

    // Reduction, in two column ranges; dbias sums the unrounded dx, so its error is the fp32
    // summation's (relative to the sum of |dx|) plus one rounding to bias's dtype.
    std::vector<bias_t> dbias(s.n + 1, sentinel<bias_t>());
    const int64_t mid = s.n / 3;
    bias_gelu_reduce_partials_cpu<acc_t>(dbias.data(), partials.data(), chunks, s.n, mid, s.n);
    bias_gelu_reduce_partials_cpu<acc_t>(dbias.data(), partials.data(), chunks, s.n, 0, mid);
    const double sum_rel = std::is_same_v<acc_t, double> ? 1e-14 : 1e-6;
    for (int64_t j = 0; j < s.n; ++j) {
      const double want = want_dbias[j] + 0.5, got = to_double(dbias[j]);
      const double tol = Traits<bias_t>::rounding * 1.0001 * std::fabs(want) + Traits<bias_t>::subnormal +
                         sum_rel * (abs_dbias[j] + 1.0) +
                         math_tol<acc_t>() * std::sqrt(static_cast<double>(s.rows));
      RK_CHECK(std::fabs(got - want) <= tol,
               "dbias, x %s bias %s %s, rows %" PRId64 " n %" PRId64 ", %" PRId64 " chunks: column %" PRId64
               " = %.12g, expected %.12g (tolerance %.3g)",
               Traits<x_t>::name, Traits<bias_t>::name, approx_name(a), s.rows, s.n, chunks, j, got, want, tol);
    }
    RK_CHECK(is_nan(dbias[s.n]), "reduction wrote past n");
  });
}

template <typename x_t, typename bias_t> void check_types(std::mt19937_64& rng) {
  const Shape shapes[] = {
      {1, 33, 33, 33}, {1, 4097, 4097, 4097}, {7, 1000, 1000, 1000}, {40, 33, 70, 35}, {300, 17, 17, 40},
      {5, 1, 3, 1},    {3, 129, 0, 129},  // x's rows broadcast (row stride 0)
  };
  for (const Shape& s : shapes) {
    for (GeluApprox a : {GeluApprox::None, GeluApprox::Tanh}) check_kernels<x_t, bias_t>(s, a, rng);
  }
}

void check_chunking() {
  for (int64_t rows : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100000}, int64_t{10000000}}) {
    for (int64_t n : {int64_t{1}, int64_t{33}, int64_t{4097}, int64_t{100000}}) {
      const int64_t per = bias_gelu_bwd_rows_per_chunk(rows, n);
      const int64_t chunks = (rows + per - 1) / per;
      RK_CHECK(per >= 1 && chunks >= 1 && chunks <= 256, "rows %" PRId64 " n %" PRId64 ": %" PRId64
               " rows per chunk, %" PRId64 " chunks", rows, n, per, chunks);
      RK_CHECK(per * n >= 32768, "rows %" PRId64 " n %" PRId64 ": chunks of %" PRId64 " rows are too small", rows, n,
               per);
    }
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(11);
  check_helpers();
  check_chunking();
  check_types<float, float>(rng);
  check_types<double, double>(rng);
  check_types<Half, Half>(rng);
  check_types<BFloat16, BFloat16>(rng);
  check_types<BFloat16, float>(rng);
  check_types<Half, float>(rng);
  check_types<float, BFloat16>(rng);
  check_types<float, double>(rng);
  check_types<Half, double>(rng);
  return rktest::finish("test_bias_gelu_cpu");
}
