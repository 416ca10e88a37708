// CUDA C++ implementations of the coupling ops, registered as the internal ops
// revkernels::cuda_coupling_sub / cuda_coupling_add: the public ops' CUDA kernel (registered in
// Python) calls them when the CUDA backend is "cuda", or "auto" (the default) for calls below
// 2^24 elements (Triton at and above; revkernels/ops/_library.py).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../kernels/coupling_cuda.h"
#include "coupling_layout.h"

namespace revkernels {
namespace {

at::Tensor coupling_axpy_cuda_impl(const at::Tensor& a, const char* a_name, const at::Tensor& b,
                                   const char* b_name, double alpha) {
  check_coupling_args(a, a_name, b, b_name);
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty_like(a);
  if (out.numel() == 0) return out;
  CouplingLayout layout;
  if (!make_coupling_layout(out, a, b, &layout)) {
    // Too many strided dims: copies of a and b in out's dense layout (a's), where all dims merge.
    return coupling_axpy_cuda_impl(at::empty_like(out).copy_(a), a_name, at::empty_like(out, b.options()).copy_(b),
                                   b_name, alpha);
  }
  const cudaError_t status =
      coupling_axpy_cuda(scalar_kind(a, a_name), scalar_kind(b, b_name), out.data_ptr(), a.const_data_ptr(),
                         b.const_data_ptr(), alpha, layout, out.numel(), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == cudaSuccess, "revkernels: coupling kernel launch failed: ", cudaGetErrorString(status));
  return out;
}

at::Tensor coupling_sub_cuda(const at::Tensor& y, const at::Tensor& f) {
  return coupling_axpy_cuda_impl(y, "y", f, "f", -1.0);
}

at::Tensor coupling_add_cuda(const at::Tensor& a, const at::Tensor& b) {
  return coupling_axpy_cuda_impl(a, "a", b, "b", 1.0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  m.def("cuda_coupling_sub(Tensor y, Tensor f) -> Tensor");
  m.def("cuda_coupling_add(Tensor a, Tensor b) -> Tensor");
}

TORCH_LIBRARY_IMPL(revkernels, CUDA, m) {
  m.impl("cuda_coupling_sub", &coupling_sub_cuda);
  m.impl("cuda_coupling_add", &coupling_add_cuda);
}

}  // namespace revkernels
