// Autograd kernels of revkernels::coupling_sub / coupling_add. Both are linear (out = a + alpha * b,
// alpha = -1 or 1), so the backward needs nothing saved:
//   d a = g,   d b = alpha * g
// That is the derivative of ATen's a - b and a + b, so the graph gets ATen's own nodes for them
// (SubBackward0 / AddBackward0 with alpha 1, as the generated VariableType kernels build them): a
// third of the host cost of a torch::autograd::Function node, and compiled autograd knows them.
// d b reaches b in b's dtype: the autograd engine casts every grad to its input's dtype.
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/library.h>

#include <type_traits>

#include "autograd.h"

namespace revkernels {
namespace {

using CouplingOp = at::Tensor(const at::Tensor&, const at::Tensor&);

template <bool kSub>
at::Tensor coupling_autograd(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  using Backward = std::conditional_t<kSub, torch::autograd::generated::SubBackward0,
                                      torch::autograd::generated::AddBackward0>;
  static const auto op = typed_op<CouplingOp>(kSub ? "revkernels::coupling_sub" : "revkernels::coupling_add");
  check_defined(a, a_name);
  check_defined(b, b_name);
  at::Tensor out = call_below_autograd(op, a, b);
  if (records_grad({a, b})) {
    auto node = make_node<Backward>();
    node->set_next_edges(torch::autograd::collect_next_edges(a, b));
    node->alpha = 1;
    node->self_scalar_type = a.scalar_type();
    node->other_scalar_type = b.scalar_type();
    torch::autograd::set_history(out, node);
  }
  return out;
}

at::Tensor coupling_sub_autograd(const at::Tensor& y, const at::Tensor& f) {
  return coupling_autograd<true>(y, "y", f, "f");
}

at::Tensor coupling_add_autograd(const at::Tensor& a, const at::Tensor& b) {
  return coupling_autograd<false>(a, "a", b, "b");
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, Autograd, m) {
  m.impl("coupling_sub", &coupling_sub_autograd);
  m.impl("coupling_add", &coupling_add_autograd);
}

}  // namespace revkernels
