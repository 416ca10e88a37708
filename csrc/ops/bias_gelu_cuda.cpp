// CUDA C++ implementations of the bias + GELU ops, registered as the internal ops
// revkernels::cuda_bias_gelu / cuda_bias_gelu_bwd: the public ops' CUDA kernel (registered in
// Python) calls them when the CUDA backend is "cuda", or "auto" (the default) for calls below
// 2^24 elements (Triton at and above; revkernels/ops/_library.py).
// Layouts as on CPU (bias_gelu_cpu.cpp): x and dy as (rows, N) views with unit column stride, else
// contiguous copies; outputs contiguous. The dbias partial sums live in a caching-allocator buffer.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../kernels/bias_gelu_cuda.h"
#include "coupling_layout.h"  // scalar_kind

namespace revkernels {

// Defined in bias_gelu_cpu.cpp (always compiled into the same library).
GeluApprox check_bias_gelu_args(const at::Tensor* dy, const at::Tensor& x, const at::Tensor& bias,
                                c10::string_view approximate);
at::Tensor bias_gelu_rows_view(const at::Tensor& t, int64_t n);

namespace {

int64_t rows_of(const at::Tensor& x) {
  const int64_t n = x.size(-1);
  return n > 0 ? x.numel() / n : 0;
}

at::Tensor bias_gelu_cuda_impl(const at::Tensor& x, const at::Tensor& bias, c10::string_view approximate) {
  const GeluApprox approx = check_bias_gelu_args(nullptr, x, bias, approximate);
  TORCH_CHECK_VALUE(x.is_cuda(), "revkernels: x must be a CUDA tensor here");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const int64_t n = x.size(-1), rows = rows_of(x);
  const at::Tensor x2 = bias_gelu_rows_view(x, n);
  const at::Tensor b = bias.contiguous();
  const cudaError_t status =
      bias_gelu_cuda(scalar_kind(x, "x"), scalar_kind(bias, "bias"), approx, out.data_ptr(), x2.const_data_ptr(),
                     x2.stride(0), b.const_data_ptr(), rows, n, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "revkernels: bias_gelu kernel launch failed: ", cudaGetErrorString(status));
  return out;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_bwd_cuda_impl(const at::Tensor& dy, const at::Tensor& x,
                                                           const at::Tensor& bias, c10::string_view approximate) {
  const GeluApprox approx = check_bias_gelu_args(&dy, x, bias, approximate);
  TORCH_CHECK_VALUE(x.is_cuda(), "revkernels: x must be a CUDA tensor here");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.size(-1), rows = rows_of(x);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dbias = at::empty({n}, bias.options());
  if (n == 0) return {dx, dbias};
  const ScalarKind x_kind = scalar_kind(x, "x"), bias_kind = scalar_kind(bias, "bias");
  // rows == 0: no views needed, the launcher only zeroes dbias.
  const at::Tensor x2 = rows > 0 ? bias_gelu_rows_view(x, n) : x;
  const at::Tensor dy2 = rows > 0 ? bias_gelu_rows_view(dy, n) : dy;
  const at::Tensor b = bias.contiguous();
  const at::Tensor workspace =
      at::empty({bias_gelu_bwd_cuda_workspace_bytes(x_kind, bias_kind, rows, n)}, x.options().dtype(at::kByte));
  const cudaError_t status = bias_gelu_bwd_cuda(
      x_kind, bias_kind, approx, dx.data_ptr(), dbias.data_ptr(), dy2.const_data_ptr(), rows > 0 ? dy2.stride(0) : n,
      x2.const_data_ptr(), rows > 0 ? x2.stride(0) : n, b.const_data_ptr(), rows, n, workspace.data_ptr(),
      at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "revkernels: bias_gelu_bwd kernel launch failed: ", cudaGetErrorString(status));
  return {dx, dbias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  m.def("cuda_bias_gelu(Tensor x, Tensor bias, str approximate=\"none\") -> Tensor");
  m.def("cuda_bias_gelu_bwd(Tensor dy, Tensor x, Tensor bias, str approximate=\"none\") -> (Tensor dx, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(revkernels, CUDA, m) {
  m.impl("cuda_bias_gelu", &bias_gelu_cuda_impl);
  m.impl("cuda_bias_gelu_bwd", &bias_gelu_bwd_cuda_impl);
}

}  // namespace revkernels
