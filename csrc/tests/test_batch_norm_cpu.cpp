// Unit test of the torch-free CPU BatchNorm (+ ReLU) kernels (kernels/batch_norm.h) against naive
// loops in double: revkernels::batch_norm_act_cpu and batch_norm_act_bwd_cpu, for float, double,
// bf16 and fp16 data, NCHW and channels_last views, with and without ReLU, channel ranges split as
// threads would (channels outside a range stay untouched), one value per channel, and millions of
// values per channel far from zero (the chunked sums); channels of one value (exact mean, out = bias).
#include <cmath>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "kernels/batch_norm.h"
#include "tests/check.h"
#include "tests/values.h"

using namespace rktest;

namespace {

using namespace revkernels;

struct Shape {
  int64_t n, c, s;
};

BnView make_view(const Shape& sh, bool channels_last) {
  BnView v;
  v.n = sh.n, v.s = sh.s;
  v.n_stride = sh.c * sh.s;
  v.c_stride = channels_last ? 1 : sh.s;
  v.s_stride = channels_last ? sh.c : 1;
  return v;
}

int64_t at(const BnView& v, int64_t i, int64_t c, int64_t j) { return i * v.n_stride + c * v.c_stride + j * v.s_stride; }

template <typename x_t>
void run_case(const Shape& sh, bool channels_last, bool relu, std::mt19937& rng, double offset = 1.0) {
  using acc_t = typename std::conditional<std::is_same_v<x_t, double>, double, float>::type;
  const int64_t total = sh.n * sh.c * sh.s, m = sh.n * sh.s;
  const double tol = std::is_same_v<acc_t, double> ? 1e-12 : 2e-5;
  const double eps = 1e-5;
  std::normal_distribution<double> normal;
  std::vector<x_t> x(total), dout(total), out(total, sentinel<x_t>()), dx(total, sentinel<x_t>());
  for (auto& v : x) v = from_double<x_t>(normal(rng) * 2 + offset);
  for (auto& v : dout) v = from_double<x_t>(normal(rng));
  std::vector<acc_t> w(sh.c), b(sh.c), mean(sh.c, acc_t(-7)), rstd(sh.c, acc_t(-7)), dw(sh.c, acc_t(-7)),
      db(sh.c, acc_t(-7));
  for (int64_t c = 0; c < sh.c; ++c) w[c] = static_cast<acc_t>(1 + 0.5 * normal(rng)), b[c] = static_cast<acc_t>(0.5 * normal(rng));
  const BnView v = make_view(sh, channels_last);
  // Two ranges, [0, c/2) and [c/2, c), as two threads would take them; the first checked untouched.
  const int64_t half = sh.c / 2;
  batch_norm_act_cpu<acc_t>(out.data(), mean.data(), rstd.data(), x.data(), v, v, w.data(), b.data(),
                            static_cast<acc_t>(eps), relu, half, sh.c);
  for (int64_t c = 0; c < half; ++c) {
    RK_CHECK(mean[c] == acc_t(-7), "channel %lld outside the range written", (long long)c);
  }
  batch_norm_act_cpu<acc_t>(out.data(), mean.data(), rstd.data(), x.data(), v, v, w.data(), b.data(),
                            static_cast<acc_t>(eps), relu, 0, half);
  batch_norm_act_bwd_cpu<acc_t>(dx.data(), dw.data(), db.data(), dout.data(), v, x.data(), v, v, w.data(), b.data(),
                                mean.data(), rstd.data(), relu, 0, sh.c);
  for (int64_t c = 0; c < sh.c; ++c) {
    // Naive double reference, from the same (stored) x.
    double mu = 0, var = 0;
    for (int64_t i = 0; i < sh.n; ++i)
      for (int64_t j = 0; j < sh.s; ++j) mu += to_double(x[at(v, i, c, j)]);
    mu /= m;
    for (int64_t i = 0; i < sh.n; ++i)
      for (int64_t j = 0; j < sh.s; ++j) var += std::pow(to_double(x[at(v, i, c, j)]) - mu, 2);
    var /= m;
    const double rs = 1 / std::sqrt(var + eps);
    RK_CHECK(std::fabs(mean[c] - mu) <= tol * (std::fabs(mu) + std::sqrt(var)), "mean[%lld]", (long long)c);
    RK_CHECK(std::fabs(rstd[c] - rs) <= tol * rs, "rstd[%lld]: %g vs %g", (long long)c, (double)rstd[c], rs);
    double sum_dy = 0, sum_dy_xhat = 0, out_scale = 0, dx_scale = 0;
    std::vector<double> want(m), mask(m);
    for (int64_t i = 0; i < sh.n; ++i) {
      for (int64_t j = 0; j < sh.s; ++j) {
        const double xhat = (to_double(x[at(v, i, c, j)]) - mu) * rs;
        const double y = xhat * w[c] + b[c];
        want[i * sh.s + j] = relu && y <= 0 ? 0 : y;
        mask[i * sh.s + j] = relu && y <= 0 ? 0 : 1;
        out_scale = std::fmax(out_scale, std::fabs(y));
        const double d = to_double(dout[at(v, i, c, j)]) * mask[i * sh.s + j];
        sum_dy += d;
        sum_dy_xhat += d * xhat;
      }
    }
    for (int64_t i = 0; i < sh.n; ++i) {
      for (int64_t j = 0; j < sh.s; ++j) {
        const double got = to_double(out[at(v, i, c, j)]);
        const double e = want[i * sh.s + j];
        RK_CHECK(std::fabs(got - e) <= Traits<x_t>::ulp * std::fabs(e) + tol * out_scale,
                 "%s out (%lld, %lld, %lld): %g vs %g", Traits<x_t>::name, (long long)i, (long long)c, (long long)j, got, e);
        const double xhat = (to_double(x[at(v, i, c, j)]) - mu) * rs;
        const double d = to_double(dout[at(v, i, c, j)]) * mask[i * sh.s + j];
        const double g = rs * w[c] * (d - sum_dy / m - xhat * sum_dy_xhat / m);
        dx_scale = std::fmax(dx_scale, std::fabs(g));
        want[i * sh.s + j] = g;
      }
    }
    for (int64_t i = 0; i < sh.n; ++i) {
      for (int64_t j = 0; j < sh.s; ++j) {
        const double got = to_double(dx[at(v, i, c, j)]), e = want[i * sh.s + j];
        RK_CHECK(std::fabs(got - e) <= Traits<x_t>::ulp * std::fabs(e) + tol * 10 * dx_scale + 1e-12,
                 "%s dx (%lld, %lld, %lld): %g vs %g", Traits<x_t>::name, (long long)i, (long long)c, (long long)j, got, e);
      }
    }
    RK_CHECK(std::fabs(db[c] - sum_dy) <= tol * 10 * (1 + std::sqrt((double)m)), "dbias[%lld]", (long long)c);
    RK_CHECK(std::fabs(dw[c] - sum_dy_xhat) <= tol * 10 * (1 + std::sqrt((double)m)), "dweight[%lld]", (long long)c);
  }
}

template <typename x_t>
void run_all(std::mt19937& rng) {
  for (const Shape& sh : {Shape{2, 3, 35}, Shape{4, 16, 64}, Shape{1, 3, 1}, Shape{5, 7, 1}, Shape{3, 5, 13}}) {
    for (bool channels_last : {false, true}) {
      for (bool relu : {true, false}) run_case<x_t>(sh, channels_last, relu, rng);
    }
  }
}

// Channels of one value each (1234.5 and -7.3, 16 x 4096 of them): the mean is the value itself and
// out is the bias exactly (sums of x - the channel's first value; summed from the values themselves
// the mean rounded, and that rounding times rstd ~ 1 / sqrt(eps) moved out by 1e-3).
void constant_channels(bool channels_last) {
  const Shape sh{16, 2, 4096};
  const float values[2] = {1234.5f, -7.3f}, w[2] = {1.5f, 0.75f}, b[2] = {0.5f, -0.25f};
  const BnView v = make_view(sh, channels_last);
  std::vector<float> x(sh.n * sh.c * sh.s), out(x.size()), mean(2), rstd(2);
  for (int64_t i = 0; i < sh.n; ++i)
    for (int64_t c = 0; c < sh.c; ++c)
      for (int64_t j = 0; j < sh.s; ++j) x[at(v, i, c, j)] = values[c];
  batch_norm_act_cpu<float>(out.data(), mean.data(), rstd.data(), x.data(), v, v, w, b, 1e-5f, false, 0, sh.c);
  for (int64_t c = 0; c < sh.c; ++c) {
    RK_CHECK(mean[c] == values[c], "constant channel %lld: mean %.9g, not %.9g", (long long)c, (double)mean[c],
             (double)values[c]);
    for (int64_t i = 0; i < sh.n; ++i)
      for (int64_t j = 0; j < sh.s; ++j) {
        RK_CHECK(out[at(v, i, c, j)] == b[c], "constant channel %lld: out %.9g, not the bias", (long long)c,
                 (double)out[at(v, i, c, j)]);
      }
  }
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  run_all<float>(rng);
  run_all<double>(rng);
  run_all<BFloat16>(rng);
  run_all<Half>(rng);
  // 2^21 values per channel near 100: a running sum over all of them per lane loses the statistics.
  for (bool channels_last : {false, true}) run_case<float>(Shape{1, 2, 1 << 21}, channels_last, false, rng, 100.0);
  for (bool channels_last : {false, true}) constant_channels(channels_last);
  return finish("test_batch_norm_cpu");
}
