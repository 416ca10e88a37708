// CPU implementations of the fixed-point ops (revkernels::fixed_point_*): the kernel of
// cpu/vec_kernels.h (semantics: kernels/fixed_point.h), split across threads with at::parallel_for;
// each range returns its overflow flag, OR-ed into the call's.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>

#include "../cpu/vec_kernels.h"
#include "fixed_point_glue.h"

namespace revkernels {
namespace {

constexpr int64_t kGrainSize = 32768;

// Runs the checked call; returns its overflow flag.
bool run_cpu(const FixedPointCall& c) {
  const int64_t numel = c.view.numel();
  if (numel == 0) return false;
  const CpuKernels& kernels = cpu_kernels();
  int64_t* out = c.out.defined() ? c.out.data_ptr<int64_t>() : nullptr;
  const int64_t* x = c.x.defined() ? c.x.const_data_ptr<int64_t>() : nullptr;
  const void* f = c.f.defined() ? c.f.const_data_ptr() : nullptr;
  std::atomic<bool> overflow{false};
  at::parallel_for(0, numel, kGrainSize, [&](int64_t begin, int64_t end) {
    if (kernels.fixed_point(c.op, out, c.view.data_ptr(), c.view_kind, x, f, c.f_kind, c.bits, c.layout, begin, end)) {
      overflow.store(true, std::memory_order_relaxed);
    }
  });
  return overflow.load(std::memory_order_relaxed);
}

FixedPointResult step_cpu(FixedPointOp op, const at::Tensor& x, const char* x_name, const at::Tensor& f, int64_t bits,
                          at::ScalarType dtype) {
  const FixedPointCall c = prepare_fixed_point(op, x, x_name, f, bits, dtype, /*align=*/true);
  TORCH_CHECK_VALUE(c.view.device().is_cpu(), "revkernels: ", x_name, " must be a CPU tensor here");
  const bool overflow = run_cpu(c);
  if (op == FixedPointOp::View) return {c.view, c.out, at::Tensor()};  // (a view has no flag)
  return {c.view, c.out, at::scalar_tensor(overflow, c.view.options().dtype(at::kBool))};
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, CPU, m) { register_fixed_point_kernels<&step_cpu>(m, ""); }

}  // namespace revkernels
