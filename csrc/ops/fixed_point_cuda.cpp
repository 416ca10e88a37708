// CUDA C++ implementations of the fixed-point ops, registered as the internal ops
// revkernels::cuda_fixed_point_*: the public ops' CUDA kernel (registered in Python) calls them
// when the CUDA backend is "cuda", or "auto" (the default) for calls below 2^24 elements (Triton at
// and above; revkernels/ops/_library.py).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../kernels/fixed_point_cuda.h"
#include "fixed_point_glue.h"

namespace revkernels {
namespace {

FixedPointResult step_cuda(FixedPointOp op, const at::Tensor& x, const char* x_name, const at::Tensor& f,
                           int64_t bits, at::ScalarType dtype) {
  const FixedPointCall c = prepare_fixed_point(op, x, x_name, f, bits, dtype, /*align=*/false);
  const c10::cuda::CUDAGuard guard(c.view.device());
  // (a view has no flag: its kernel never sets one)
  at::Tensor overflow = op == FixedPointOp::View ? at::Tensor() : at::zeros({}, c.view.options().dtype(at::kBool));
  const cudaError_t status = fixed_point_cuda(
      c.op, c.f_kind, c.view_kind, c.out.defined() ? c.out.data_ptr<int64_t>() : nullptr, c.view.data_ptr(),
      c.x.defined() ? c.x.const_data_ptr<int64_t>() : nullptr, c.f.defined() ? c.f.const_data_ptr() : nullptr, c.bits,
      overflow.defined() ? overflow.data_ptr<bool>() : nullptr, c.layout, c.view.numel(),
      at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "revkernels: fixed-point kernel launch failed: ", cudaGetErrorString(status));
  return {c.view, c.out, overflow};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  m.def("cuda_fixed_point_from_float(Tensor x, int bits=32) -> (Tensor, Tensor, Tensor)");
  m.def("cuda_fixed_point_add(Tensor x, Tensor f, int bits=32, ScalarType dtype=float) -> (Tensor, Tensor, Tensor)");
  m.def("cuda_fixed_point_sub(Tensor y, Tensor f, int bits=32, ScalarType dtype=float) -> (Tensor, Tensor, Tensor)");
  m.def("cuda_fixed_point_view(Tensor x, int bits=32, ScalarType dtype=float) -> Tensor");
}

TORCH_LIBRARY_IMPL(revkernels, CUDA, m) { register_fixed_point_kernels<&step_cuda>(m, "cuda_"); }

}  // namespace revkernels
