// CUDA C++ implementation of revkernels::batch_norm_act, registered as the internal op
// revkernels::cuda_batch_norm_act: the public op's CUDA kernel (registered in Python) calls it when
// the CUDA backend is "cuda", or "auto" (the default) for calls below 2^24 elements (Triton at
// and above; revkernels/ops/_library.py). The per-channel statistics come from
// ATen's batch_norm_stats (Welford in fp32, fp64 for fp64 data; mean and 1/sqrt(var + eps)); the
// normalise + affine + ReLU is the kernel in kernels/batch_norm.cu. batch_norm_act_bwd has no CUDA
// C++ kernel (Triton under every backend).
// Layouts as on CPU (batch_norm_cpu.cpp): NCHW-contiguous or channels_last as is, else a contiguous
// copy; out is allocated like it.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "../kernels/batch_norm_cuda.h"
#include "coupling_layout.h"  // scalar_kind

namespace revkernels {

// Defined in batch_norm_cpu.cpp (always compiled into the same library).
bool batch_norm_is_channels_last(const at::Tensor& t);
at::Tensor batch_norm_laid_out(const at::Tensor& t);
void check_batch_norm_act_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_act_cuda_impl(const at::Tensor& x, const at::Tensor& weight,
                                                                        const at::Tensor& bias, double eps,
                                                                        bool relu) {
  check_batch_norm_act_args(x, weight, bias, eps);
  TORCH_CHECK_VALUE(x.is_cuda(), "revkernels: x must be a CUDA tensor here");
  const c10::cuda::CUDAGuard guard(x.device());
  const ScalarKind x_kind = scalar_kind(x, "x");
  const auto acc_dtype = x_kind == ScalarKind::Float64 ? at::kDouble : at::kFloat;
  const at::Tensor xl = batch_norm_laid_out(x);
  at::Tensor out = at::empty_like(xl);
  const int64_t c = x.size(1), total = xl.numel();
  if (total == 0) {
    at::Tensor nan = at::full({c}, std::numeric_limits<double>::quiet_NaN(), x.options().dtype(acc_dtype));
    return {out, nan, nan.clone()};
  }
  auto [mean, rstd] = at::batch_norm_stats(xl, eps);
  mean = mean.to(acc_dtype).contiguous();
  rstd = rstd.to(acc_dtype).contiguous();
  const at::Tensor w = weight.to(acc_dtype).contiguous(), b = bias.to(acc_dtype).contiguous();
  const bool channels_last = !xl.is_contiguous() && batch_norm_is_channels_last(xl);
  const int64_t s = total / (x.size(0) * c);
  const cudaError_t status = batch_norm_act_apply_cuda(
      x_kind, out.data_ptr(), xl.const_data_ptr(), mean.const_data_ptr(), rstd.const_data_ptr(), w.const_data_ptr(),
      b.const_data_ptr(), total, c, s, channels_last, relu, at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "revkernels: batch_norm_act kernel launch failed: ", cudaGetErrorString(status));
  return {out, mean, rstd};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  // The public op's defaults too: the dispatcher leaves trailing default arguments out of the
  // Python kernel's call that forwards them here.
  m.def("cuda_batch_norm_act(Tensor x, Tensor weight, Tensor bias, float eps=1e-05, bool relu=True) "
        "-> (Tensor out, Tensor mean, Tensor rstd)");
}

TORCH_LIBRARY_IMPL(revkernels, CUDA, m) { m.impl("cuda_batch_norm_act", &batch_norm_act_cuda_impl); }

}  // namespace revkernels
