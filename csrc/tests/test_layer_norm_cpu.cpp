// Unit test of the torch-free CPU LayerNorm kernels (kernels/layer_norm.h) against naive loops in
// double: revkernels::sub_layer_norm_cpu, layer_norm_bwd_add_cpu and reduce_partials_cpu, for every
// data type, mixed input dtypes, strided and broadcast rows, widths from 1 to 4097, and row ranges
// split as threads would (rows outside a range stay untouched).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/layer_norm.h"
#include "tests/check.h"
#include "tests/values.h"

using namespace rktest;

namespace {

using namespace revkernels;



// Relative error of the accumulation type's arithmetic, as a bound on the kernel's error over the
// scale of an output (the largest |value| of that output).
template <typename acc_t> constexpr double acc_tolerance() { return std::is_same_v<acc_t, double> ? 1e-12 : 1e-5; }

// |got - want| <= one ulp of the stored type at |want| (its one rounding, plus a rounding-boundary
// flip) + the accumulation error relative to `scale`.
template <typename out_t, typename acc_t>
bool close(double got, double want, double scale) {
  return std::fabs(got - want) <= Traits<out_t>::ulp * std::fabs(want) + acc_tolerance<acc_t>() * scale;
}

struct Shape {
  int64_t rows, n;
};

double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double d : v) m = std::max(m, std::fabs(d));
  return m;
}

template <typename acc_t, typename x_t, typename g_t>
void check_forward(Shape s, std::mt19937_64& rng) {
  const int64_t rows = s.rows, n = s.n;
  // Rows with an offset and a spread, so mean and variance are both non-trivial; y rows padded
  // (row stride n + 3), g either strided or one broadcast row (row stride 0).
  std::normal_distribution<double> normal(0.0, 1.0);
  const bool g_broadcast = (rng() & 1) != 0;
  const int64_t y_stride = n + 3, g_stride = g_broadcast ? 0 : n;
  std::vector<x_t> y(rows * y_stride);
  std::vector<g_t> g(g_broadcast ? n : rows * n);
  for (auto& v : y) v = from_double<x_t>(3.0 * normal(rng) + 0.5);
  for (auto& v : g) v = from_double<g_t>(normal(rng));
  std::vector<acc_t> weight(n), bias(n);
  for (auto& v : weight) v = static_cast<acc_t>(1.0 + 0.5 * normal(rng));
  for (auto& v : bias) v = static_cast<acc_t>(normal(rng));
  const acc_t eps = static_cast<acc_t>(1e-5);

  // Reference: x = y - g in double, rounded to acc_t (as the kernel's subtraction), then to x_t;
  // the statistics and ln in double from that rounded x.
  std::vector<x_t> want_x(rows * n);
  std::vector<double> want_ln(rows * n), want_mean(rows), want_rstd(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      const double d = to_double(y[r * y_stride + i]) - to_double(g[r * g_stride + i]);
      want_x[r * n + i] = from_double<x_t>(static_cast<double>(static_cast<acc_t>(d)));
      sum += to_double(want_x[r * n + i]);
    }
    const double mean = sum / n;
    double m2 = 0.0;
    for (int64_t i = 0; i < n; ++i) m2 += (to_double(want_x[r * n + i]) - mean) * (to_double(want_x[r * n + i]) - mean);
    const double rstd = 1.0 / std::sqrt(m2 / n + static_cast<double>(eps));
    want_mean[r] = mean;
    want_rstd[r] = rstd;
    for (int64_t i = 0; i < n; ++i) {
      want_ln[r * n + i] = (to_double(want_x[r * n + i]) - mean) * rstd * weight[i] + bias[i];
    }
  }
  const double ln_scale = max_abs(want_ln);

  auto run_and_compare = [&](int64_t begin, int64_t end, const char* how) {
    std::vector<x_t> x(rows * n, sentinel<x_t>()), ln(rows * n, sentinel<x_t>());
    std::vector<acc_t> mean(rows, std::numeric_limits<acc_t>::quiet_NaN()), rstd = mean;
    sub_layer_norm_cpu<acc_t>(x.data(), ln.data(), mean.data(), rstd.data(), y.data(), y_stride, g.data(), g_stride,
                              weight.data(), bias.data(), eps, n, begin, end);
    for (int64_t r = 0; r < rows; ++r) {
      const bool inside = begin <= r && r < end;
      // mean to within the float sum's error over the row's spread (~3); rstd relative.
      const bool stats_ok = inside ? std::fabs(mean[r] - want_mean[r]) <= acc_tolerance<acc_t>() * 4.0 &&
                                         std::fabs(rstd[r] - want_rstd[r]) <= acc_tolerance<acc_t>() * want_rstd[r]
                                   : std::isnan(mean[r]) && std::isnan(rstd[r]);
      RK_CHECK(stats_ok, "forward x %s, g %s, %" PRId64 "x%" PRId64 ", %s [%" PRId64 ", %" PRId64 "): row %" PRId64
               " mean %.9g rstd %.9g, expected %.9g %.9g%s", Traits<x_t>::name, Traits<g_t>::name, rows, n, how,
               begin, end, r, static_cast<double>(mean[r]), static_cast<double>(rstd[r]), want_mean[r], want_rstd[r],
               inside ? "" : " (outside the range: untouched)");
      for (int64_t i = 0; i < n; ++i) {
        const int64_t k = r * n + i;
        const bool x_ok = bits_of(x[k]) == (inside ? bits_of(want_x[k]) : bits_of(sentinel<x_t>()));
        const bool ln_ok =
            inside ? close<x_t, acc_t>(to_double(ln[k]), want_ln[k], ln_scale) : std::isnan(to_double(ln[k]));
        RK_CHECK(x_ok && ln_ok, "forward x %s, g %s, %" PRId64 "x%" PRId64 ", %s [%" PRId64 ", %" PRId64 "): (%" PRId64
                 ", %" PRId64 ") x %.9g ln %.9g, expected %.9g %.9g", Traits<x_t>::name, Traits<g_t>::name, rows, n,
                 how, begin, end, r, i, to_double(x[k]), to_double(ln[k]), to_double(want_x[k]), want_ln[k]);
      }
    }
  };
  run_and_compare(0, rows, "all rows");
  std::uniform_int_distribution<int64_t> pos(0, rows);
  for (int trial = 0; trial < 2; ++trial) {
    const int64_t a = pos(rng), b = pos(rng);
    run_and_compare(std::min(a, b), std::max(a, b), "one range");
  }
}

template <typename acc_t, typename dres_t, typename x_t>
void check_backward(Shape s, std::mt19937_64& rng) {
  const int64_t rows = s.rows, n = s.n;
  std::normal_distribution<double> normal(0.0, 1.0);
  // dln and x padded rows, dres a broadcast row half of the time.
  const bool dres_broadcast = (rng() & 1) != 0;
  const int64_t dln_stride = n + 1, x_stride = n + 5, dres_stride = dres_broadcast ? 0 : n;
  std::vector<x_t> dln(rows * dln_stride), x(rows * x_stride);
  std::vector<dres_t> dres(dres_broadcast ? n : rows * n);
  for (auto& v : dln) v = from_double<x_t>(normal(rng));
  for (auto& v : x) v = from_double<x_t>(2.0 * normal(rng) - 0.7);
  for (auto& v : dres) v = from_double<dres_t>(normal(rng));
  std::vector<acc_t> weight(n), mean(rows), rstd(rows);
  for (auto& v : weight) v = static_cast<acc_t>(1.0 + 0.5 * normal(rng));
  for (int64_t r = 0; r < rows; ++r) {  // statistics near the row's own, as from the forward
    mean[r] = static_cast<acc_t>(-0.7 + 0.1 * normal(rng));
    rstd[r] = static_cast<acc_t>(0.5 * (1.0 + 0.1 * normal(rng)));
  }

  std::vector<double> want_dx(rows * n), xhat(rows * n);
  for (int64_t r = 0; r < rows; ++r) {
    double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
    for (int64_t i = 0; i < n; ++i) {
      xhat[r * n + i] = (to_double(x[r * x_stride + i]) - mean[r]) * rstd[r];
      const double dxhat = to_double(dln[r * dln_stride + i]) * weight[i];
      sum_dxhat += dxhat;
      sum_dxhat_xhat += dxhat * xhat[r * n + i];
    }
    for (int64_t i = 0; i < n; ++i) {
      const double dxhat = to_double(dln[r * dln_stride + i]) * weight[i];
      want_dx[r * n + i] = to_double(dres[r * dres_stride + i]) +
                           rstd[r] * (dxhat - sum_dxhat / n - xhat[r * n + i] * sum_dxhat_xhat / n);
    }
  }
  const double dx_scale = max_abs(want_dx);

  auto run_and_compare = [&](int64_t begin, int64_t end, const char* how) {
    std::vector<dres_t> dx(rows * n, sentinel<dres_t>());
    std::vector<acc_t> dweight(n, std::numeric_limits<acc_t>::quiet_NaN()), dbias = dweight;
    layer_norm_bwd_add_cpu<acc_t>(dx.data(), dweight.data(), dbias.data(), dln.data(), dln_stride, x.data(), x_stride,
                                  weight.data(), mean.data(), rstd.data(), dres.data(), dres_stride, n, begin, end);
    for (int64_t r = 0; r < rows; ++r) {
      const bool inside = begin <= r && r < end;
      for (int64_t i = 0; i < n; ++i) {
        const double got = to_double(dx[r * n + i]);
        const bool ok = inside ? close<dres_t, acc_t>(got, want_dx[r * n + i], dx_scale) : std::isnan(got);
        RK_CHECK(ok, "backward dres %s, x %s, %" PRId64 "x%" PRId64 ", %s [%" PRId64 ", %" PRId64 "): dx(%" PRId64
                 ", %" PRId64 ") = %.9g, expected %.9g%s", Traits<dres_t>::name, Traits<x_t>::name, rows, n, how, begin,
                 end, r, i, got, inside ? want_dx[r * n + i] : std::nan(""), inside ? "" : " (outside the range)");
      }
    }
    // The partial sums over this range only (zero for an empty one), within the float sum's error.
    for (int64_t i = 0; i < n; ++i) {
      double want_dw = 0.0, want_db = 0.0, magnitude = 0.0;
      for (int64_t r = begin; r < end; ++r) {
        const double d = to_double(dln[r * dln_stride + i]);
        want_dw += d * xhat[r * n + i];
        want_db += d;
        magnitude += std::fabs(d) * (1.0 + std::fabs(xhat[r * n + i]));
      }
      const double tol = acc_tolerance<acc_t>() * magnitude;
      RK_CHECK(std::fabs(dweight[i] - want_dw) <= tol && std::fabs(dbias[i] - want_db) <= tol,
               "backward dres %s, x %s, %" PRId64 "x%" PRId64 ", %s [%" PRId64 ", %" PRId64 "): column %" PRId64
               " dweight %.9g dbias %.9g, expected %.9g %.9g", Traits<dres_t>::name, Traits<x_t>::name, rows, n, how,
               begin, end, i, static_cast<double>(dweight[i]), static_cast<double>(dbias[i]), want_dw, want_db);
    }
  };
  run_and_compare(0, rows, "all rows");
  std::uniform_int_distribution<int64_t> pos(0, rows);
  for (int trial = 0; trial < 2; ++trial) {
    const int64_t a = pos(rng), b = pos(rng);
    run_and_compare(std::min(a, b), std::max(a, b), "one range");
  }
}

template <typename acc_t, typename out_t>
void check_reduce(int64_t num_partials, int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<acc_t> partials(num_partials * n);
  for (auto& v : partials) v = static_cast<acc_t>(normal(rng));
  std::vector<double> want(n, 0.0), magnitude(n, 0.0);
  for (int64_t p = 0; p < num_partials; ++p) {
    for (int64_t i = 0; i < n; ++i) {
      want[i] += partials[p * n + i];
      magnitude[i] += std::fabs(partials[p * n + i]);
    }
  }
  // Uneven column chunks in a shuffled order; every column written exactly once.
  std::vector<int64_t> cuts{0, n};
  std::uniform_int_distribution<int64_t> cut(0, n);
  for (int k = 0; k < 3; ++k) cuts.push_back(cut(rng));
  std::sort(cuts.begin(), cuts.end());
  std::vector<size_t> order(cuts.size() - 1);
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<out_t> out(n, sentinel<out_t>());
  for (size_t k : order) reduce_partials_cpu<acc_t>(out.data(), partials.data(), num_partials, n, cuts[k], cuts[k + 1]);
  for (int64_t i = 0; i < n; ++i) {
    const double got = to_double(out[i]);
    const double tol = Traits<out_t>::ulp * std::fabs(want[i]) + acc_tolerance<acc_t>() * magnitude[i];
    RK_CHECK(std::fabs(got - want[i]) <= tol,
             "reduce acc %s, out %s, %" PRId64 " partials x %" PRId64 ": column %" PRId64 " = %.9g, expected %.9g",
             std::is_same_v<acc_t, double> ? "double" : "float", Traits<out_t>::name, num_partials, n, i, got, want[i]);
  }
}

// The data types as the op glue dispatches them: acc_t double when either input is double.
template <typename first_t, typename second_t>
void check_types(const std::vector<Shape>& shapes, std::mt19937_64& rng) {
  bool dispatched = false;
  const ScalarKind first = Traits<first_t>::kind, second = Traits<second_t>::kind;
  dispatch_float_pair(first, second, [&](auto acc_tag, auto first_tag, auto second_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    if constexpr (std::is_same_v<typename decltype(first_tag)::type, first_t> &&
                  std::is_same_v<typename decltype(second_tag)::type, second_t>) {
      dispatched = true;
      for (Shape s : shapes) {
        check_forward<acc_t, first_t, second_t>(s, rng);   // x = y's dtype, g's dtype
        check_backward<acc_t, first_t, second_t>(s, rng);  // dres's dtype, x's dtype
      }
    }
  });
  RK_CHECK(dispatched, "%s, %s: dispatched other data types", Traits<first_t>::name, Traits<second_t>::name);
}

}  // namespace

int main() {
  const std::vector<Shape> shapes = {{1, 1}, {3, 7}, {1, 33}, {37, 33}, {5, 1000}, {2, 4097}, {9, 8}};
  std::mt19937_64 rng(11);
  check_types<float, float>(shapes, rng);
  check_types<double, double>(shapes, rng);
  check_types<Half, Half>(shapes, rng);
  check_types<BFloat16, BFloat16>(shapes, rng);
  check_types<float, BFloat16>(shapes, rng);
  check_types<BFloat16, float>(shapes, rng);
  check_types<float, Half>(shapes, rng);
  check_types<float, double>(shapes, rng);
  check_types<Half, double>(shapes, rng);
  for (int64_t p : {1, 7, 64}) {
    for (int64_t n : {1, 63, 64, 65, 1000}) {
      check_reduce<float, float>(p, n, rng);
      check_reduce<float, BFloat16>(p, n, rng);
      check_reduce<float, Half>(p, n, rng);
      check_reduce<double, double>(p, n, rng);
      check_reduce<double, float>(p, n, rng);
    }
  }
  // dispatch_float_type picks the storage type of each kind.
  auto size_of = [](ScalarKind k) {
    return dispatch_float_type(k, [](auto tag) { return sizeof(typename decltype(tag)::type); });
  };
  RK_CHECK(size_of(ScalarKind::Float32) == 4 && size_of(ScalarKind::Float64) == 8 &&
               size_of(ScalarKind::Float16) == 2 && size_of(ScalarKind::BFloat16) == 2,
           "dispatch_float_type picked the wrong types");
  return rktest::finish("test_layer_norm_cpu");
}
