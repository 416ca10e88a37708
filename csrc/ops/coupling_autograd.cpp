// Autograd kernels of revkernels::coupling_sub / coupling_add. Both are linear (out = a + alpha * b,
// alpha = -1 or 1), so the backward needs nothing saved but b's dtype:
//   d a = g,   d b = alpha * g in b's dtype.
#include <torch/library.h>

#include "autograd.h"

namespace revkernels {
namespace {

using CouplingOp = at::Tensor(const at::Tensor&, const at::Tensor&);

template <bool kSub>
struct Coupling : torch::autograd::Function<Coupling<kSub>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b) {
    static const auto op = typed_op<CouplingOp>(kSub ? "revkernels::coupling_sub" : "revkernels::coupling_add");
    ctx->saved_data["b_dtype"] = b.scalar_type();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(a, b);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& g = grads[0];
    at::Tensor db;
    if (ctx->needs_input_grad(1)) db = (kSub ? g.neg() : g).to(ctx->saved_data["b_dtype"].toScalarType());
    return {g, db};
  }
};

at::Tensor coupling_sub_autograd(const at::Tensor& y, const at::Tensor& f) {
  check_defined(y, "y");
  check_defined(f, "f");
  if (!records_grad({y, f})) {
    static const auto op = typed_op<CouplingOp>("revkernels::coupling_sub");
    return call_below_autograd(op, y, f);
  }
  return Coupling<true>::apply(y, f);
}

at::Tensor coupling_add_autograd(const at::Tensor& a, const at::Tensor& b) {
  check_defined(a, "a");
  check_defined(b, "b");
  if (!records_grad({a, b})) {
    static const auto op = typed_op<CouplingOp>("revkernels::coupling_add");
    return call_below_autograd(op, a, b);
  }
  return Coupling<false>::apply(a, b);
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, Autograd, m) {
  m.impl("coupling_sub", &coupling_sub_autograd);
  m.impl("coupling_add", &coupling_add_autograd);
}

}  // namespace revkernels
