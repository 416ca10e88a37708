// CPU implementations of revkernels::bias_gelu / bias_gelu_bwd: the vectorised kernels of
// cpu/vec_kernels.h (semantics: kernels/bias_gelu.h), split across threads with at::parallel_for. Also defines the argument checks
// shared with the CUDA glue (bias_gelu_cuda.cpp, compiled into the same library).
//
// Layout: the kernels take x and dy as rows of N with unit column stride and one row stride.
// x.reshape(-1, N) is such a view for contiguous inputs and for row-sliced ones (x[:, :N] of a wider
// buffer); any other layout (transposed, permuted, channels-last) is first copied to a contiguous
// tensor (one extra pass). Outputs are always contiguous.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

#include "../cpu/vec_kernels.h"
#include "../kernels/bias_gelu.h"
#include "coupling_layout.h"  // scalar_kind, element_aligned

namespace revkernels {

GeluApprox parse_gelu_approximate(c10::string_view approximate) {
  if (approximate == "none") return GeluApprox::None;
  if (approximate == "tanh") return GeluApprox::Tanh;
  TORCH_CHECK_VALUE(false, "revkernels: approximate must be 'none' or 'tanh', got '", approximate, "'");
}

// Checks x (..., N), bias (N,) and, for the backward, dy (x's shape and dtype): float dtypes, one
// device. Returns the parsed `approximate`.
GeluApprox check_bias_gelu_args(const at::Tensor* dy, const at::Tensor& x, const at::Tensor& bias,
                                c10::string_view approximate) {
  scalar_kind(x, "x");
  scalar_kind(bias, "bias");
  const GeluApprox approx = parse_gelu_approximate(approximate);
  TORCH_CHECK_VALUE(x.dim() >= 1, "revkernels: x must have shape (..., N), got a 0-d tensor");
  TORCH_CHECK_VALUE(bias.dim() == 1 && bias.size(0) == x.size(-1), "revkernels: bias must have shape (N,) = (",
                    x.size(-1), ",) for x of shape ", x.sizes(), ", got ", bias.sizes());
  TORCH_CHECK_VALUE(bias.device() == x.device(), "revkernels: bias must be on the device of x (", x.device(),
                    "), got ", bias.device());
  if (dy != nullptr) {
    scalar_kind(*dy, "dy");
    TORCH_CHECK_TYPE(dy->scalar_type() == x.scalar_type(), "revkernels: dy must have the dtype of x (",
                     x.scalar_type(), "), got ", dy->scalar_type());
    TORCH_CHECK_VALUE(dy->sizes() == x.sizes(), "revkernels: dy must have the shape of x ", x.sizes(), ", got ",
                      dy->sizes());
    TORCH_CHECK_VALUE(dy->device() == x.device(), "revkernels: dy must be on the device of x (", x.device(),
                      "), got ", dy->device());
  }
  return approx;
}

// t as (rows, n) with unit column stride: a view where one exists, else a contiguous copy.
at::Tensor bias_gelu_rows_view(const at::Tensor& t, int64_t n) {
  at::Tensor rows = t.reshape({-1, n});
  if (n > 1 && rows.stride(1) != 1) rows = rows.contiguous();
  return rows;
}

namespace {

constexpr int64_t kGrainSize = 32768;  // elements per task

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(n, 1)); }

struct BiasGeluArgs {
  ScalarKind x_kind;
  ScalarKind bias_kind;
  GeluApprox approx;
  int64_t rows;  // x viewed as (rows, n)
  int64_t n;
};

BiasGeluArgs bias_gelu_args(const at::Tensor* dy, const at::Tensor& x, const at::Tensor& bias,
                            c10::string_view approximate) {
  BiasGeluArgs args;
  args.approx = check_bias_gelu_args(dy, x, bias, approximate);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "revkernels: x must be a CPU tensor here");
  args.x_kind = scalar_kind(x, "x");
  args.bias_kind = scalar_kind(bias, "bias");
  args.n = x.size(-1);
  args.rows = args.n > 0 ? x.numel() / args.n : 0;
  return args;
}

at::Tensor bias_gelu_cpu_impl(const at::Tensor& x, const at::Tensor& bias, c10::string_view approximate) {
  const BiasGeluArgs args = bias_gelu_args(nullptr, x, bias, approximate);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const at::Tensor x2 = element_aligned(bias_gelu_rows_view(x, args.n));
  const at::Tensor b = element_aligned(bias.contiguous());
  const CpuKernels& kernels = cpu_kernels();
  at::parallel_for(0, args.rows, grain_rows(args.n), [&](int64_t begin, int64_t end) {
    kernels.bias_gelu(out.data_ptr(), x2.const_data_ptr(), args.x_kind, x2.stride(0), b.const_data_ptr(),
                      args.bias_kind, args.n, args.approx, begin, end);
  });
  return out;
}

// dbias: each chunk of rows (bias_gelu_bwd_rows_per_chunk, a function of the shape only) sums its
// dx into its own row of an fp32 (fp64) partial buffer; a second pass sums the partial rows in chunk
// order. The result does not depend on the thread count.
std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd_cpu_impl(const at::Tensor& dy, const at::Tensor& x,
                                                          const at::Tensor& bias, c10::string_view approximate) {
  const BiasGeluArgs args = bias_gelu_args(&dy, x, bias, approximate);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dbias = at::empty({args.n}, bias.options());
  if (args.n == 0) return {dx, dbias};
  if (args.rows == 0) return {dx, dbias.zero_()};
  const at::Tensor x2 = element_aligned(bias_gelu_rows_view(x, args.n));
  const at::Tensor dy2 = element_aligned(bias_gelu_rows_view(dy, args.n));
  const at::Tensor b = element_aligned(bias.contiguous());
  const int64_t rows_per_chunk = bias_gelu_bwd_rows_per_chunk(args.rows, args.n);
  const int64_t chunks = (args.rows + rows_per_chunk - 1) / rows_per_chunk;
  dispatch_float_pair(args.x_kind, args.bias_kind, [&](auto acc_tag, auto, auto bias_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    using bias_t = typename decltype(bias_tag)::type;
    const at::Tensor partials =
        at::zeros({chunks, args.n}, x.options().dtype(std::is_same_v<acc_t, double> ? at::kDouble : at::kFloat));
    auto* pp = static_cast<acc_t*>(partials.data_ptr());
    const CpuKernels& kernels = cpu_kernels();
    at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t row_begin = c * rows_per_chunk;
        const int64_t row_end = std::min(args.rows, row_begin + rows_per_chunk);
        kernels.bias_gelu_bwd(dx.data_ptr(), dy2.const_data_ptr(), dy2.stride(0), x2.const_data_ptr(), args.x_kind,
                              x2.stride(0), b.const_data_ptr(), args.bias_kind, args.n, args.approx, row_begin,
                              row_end, pp + c * args.n);
      }
    });
    auto* pdb = static_cast<bias_t*>(dbias.data_ptr());
    at::parallel_for(0, args.n, std::max<int64_t>(1, kGrainSize / chunks), [&](int64_t begin, int64_t end) {
      bias_gelu_reduce_partials_cpu<acc_t>(pdb, pp, chunks, args.n, begin, end);
    });
  });
  return {dx, dbias};
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, CPU, m) {
  m.impl("bias_gelu", &bias_gelu_cpu_impl);
  m.impl("bias_gelu_bwd", &bias_gelu_bwd_cpu_impl);
}

}  // namespace revkernels
