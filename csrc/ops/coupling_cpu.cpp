// CPU implementations of revkernels::coupling_sub / coupling_add: the vectorised kernel of
// cpu/vec_kernels.h (semantics: kernels/coupling.h), split across threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../cpu/vec_kernels.h"
#include "coupling_layout.h"

namespace revkernels {
namespace {

constexpr int64_t kGrainSize = 32768;

at::Tensor coupling_axpy_cpu_impl(const at::Tensor& a_in, const char* a_name, const at::Tensor& b_in,
                                  const char* b_name, double alpha) {
  check_coupling_args(a_in, a_name, b_in, b_name);
  TORCH_CHECK_VALUE(a_in.device().is_cpu(), "revkernels: ", a_name, " must be a CPU tensor here");
  const at::Tensor a = element_aligned(a_in), b = element_aligned(b_in);
  at::Tensor out = at::empty_like(a);
  if (out.numel() == 0) return out;
  CouplingLayout layout;
  if (!make_coupling_layout(out, a, b, &layout)) {
    // Too many strided dims: copies of a and b in out's dense layout (a's), where all dims merge.
    return coupling_axpy_cpu_impl(at::empty_like(out).copy_(a), a_name, at::empty_like(out, b.options()).copy_(b),
                                  b_name, alpha);
  }
  const ScalarKind out_kind = scalar_kind(a, a_name), b_kind = scalar_kind(b, b_name);
  const CpuKernels& kernels = cpu_kernels();
  const bool stream = stream_outputs(out.numel() * (2 * out.element_size() + b.element_size()));
  at::parallel_for(0, out.numel(), kGrainSize, [&](int64_t begin, int64_t end) {
    kernels.coupling_axpy(out.data_ptr(), a.const_data_ptr(), out_kind, b.const_data_ptr(), b_kind, alpha, layout,
                          begin, end, stream);
  });
  return out;
}

at::Tensor coupling_sub_cpu(const at::Tensor& y, const at::Tensor& f) {
  return coupling_axpy_cpu_impl(y, "y", f, "f", -1.0);
}

at::Tensor coupling_add_cpu(const at::Tensor& a, const at::Tensor& b) {
  return coupling_axpy_cpu_impl(a, "a", b, "b", 1.0);
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, CPU, m) {
  m.impl("coupling_sub", &coupling_sub_cpu);
  m.impl("coupling_add", &coupling_add_cpu);
}

}  // namespace revkernels
