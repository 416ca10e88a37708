// Autograd kernels of revkernels::fixed_point_add / fixed_point_sub (straight-through: the
// rounding's derivative taken as 1; revkernels/ops/fixed_point.py):
//   d f = ±(d view)      (the int64 stream and the flag have no gradient; x is int64)
// That is the derivative of ATen's `view + f` / `view - f` with respect to f, so the view gets
// ATen's own node for it (AddBackward0 / SubBackward0 with alpha 1 and no edge for the first
// operand), as the coupling ops do; d f reaches f in f's dtype (the engine casts every grad to its
// input's dtype). from_float and view have no autograd formula (as without the library).
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>

#include "autograd.h"

namespace revkernels {
namespace {

using StepResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using StepOp = StepResult(const at::Tensor&, const at::Tensor&, int64_t, at::ScalarType);

template <bool kSub>
StepResult fixed_point_step_autograd(const at::Tensor& x, const at::Tensor& f, int64_t bits, at::ScalarType dtype) {
  using Backward = std::conditional_t<kSub, torch::autograd::generated::SubBackward0,
                                      torch::autograd::generated::AddBackward0>;
  static const auto op = typed_op<StepOp>(kSub ? "revkernels::fixed_point_sub" : "revkernels::fixed_point_add");
  check_defined(x, kSub ? "y" : "x");
  check_defined(f, "f");
  StepResult result = call_below_autograd(op, x, f, bits, dtype);
  if (records_grad({x, f})) {
    auto node = make_node<Backward>();
    node->set_next_edges(torch::autograd::collect_next_edges(at::Tensor(), f));
    node->alpha = 1;
    node->self_scalar_type = dtype;
    node->other_scalar_type = f.scalar_type();
    torch::autograd::set_history(std::get<0>(result), node);
  }
  return result;
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, Autograd, m) {
  m.impl("fixed_point_add", &fixed_point_step_autograd<false>);
  m.impl("fixed_point_sub", &fixed_point_step_autograd<true>);
}

}  // namespace revkernels
