// Autograd kernel of revkernels::linear_sub (x = y - (a @ W^T + b), linear in every input), with g
// the grad of x viewed as (rows, N):
//   d y = g in y's dtype,   d a = -g @ W in a's dtype,   d W = -g^T a in W's dtype,
//   d b = -sum_rows(g), summed in fp32 (fp64 for an fp64 g), in b's dtype.
// The GEMMs run in the promoted dtype of a and W, as the forward's (an fp32 a with a bf16 W: an
// fp32 da, not one of bf16 accuracy), and their results are cast to the parameter's dtype.
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <optional>

#include "autograd.h"

namespace revkernels {
namespace {

using LinearSubOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&);

struct LinearSub : torch::autograd::Function<LinearSub> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& a, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
    static const auto op = typed_op<LinearSubOp>("revkernels::linear_sub");
    at::Tensor x;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      x = op.call(y, a, weight, bias);
    }
    ctx->save_for_backward({a, weight});
    ctx->saved_data["y_dtype"] = y.scalar_type();
    if (bias) ctx->saved_data["bias_dtype"] = bias->scalar_type();
    return x;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &a = saved[0], &weight = saved[1];
    const int64_t rows = c10::multiply_integers(a.sizes().slice(0, a.dim() - 1));  // k or n may be 0: no -1
    const at::Tensor g = grads[0].reshape({rows, weight.size(0)});
    at::Tensor da, dweight, dbias;
    const auto gemm = at::promote_types(a.scalar_type(), weight.scalar_type());
    if (ctx->needs_input_grad(1)) {
      da = at::mm(g.to(gemm).neg(), weight.to(gemm)).reshape(a.sizes()).to(a.scalar_type());
    }
    if (ctx->needs_input_grad(2)) {
      dweight = at::mm(g.to(gemm).t().neg(), a.reshape({rows, a.size(-1)}).to(gemm)).to(weight.scalar_type());
    }
    // Without a bias the node has edges for y, a and weight only.
    const auto bias_dtype = ctx->saved_data.find("bias_dtype");
    if (bias_dtype != ctx->saved_data.end() && ctx->needs_input_grad(3)) {
      const auto acc = g.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
      dbias = g.to(acc).sum(0).neg().to(bias_dtype->second.toScalarType());
    }
    return {grads[0].to(ctx->saved_data["y_dtype"].toScalarType()), da, dweight, dbias};
  }
};

at::Tensor linear_sub_autograd(const at::Tensor& y, const at::Tensor& a, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias) {
  check_defined(y, "y");
  check_defined(a, "a");
  check_defined(weight, "weight");
  const at::Tensor no_bias;
  if (!records_grad({y, a, weight, bias.has_value() ? *bias : no_bias})) {
    static const auto op = typed_op<LinearSubOp>("revkernels::linear_sub");
    return call_below_autograd(op, y, a, weight, bias);
  }
  return LinearSub::apply(y, a, weight, bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, Autograd, m) { m.impl("linear_sub", &linear_sub_autograd); }

}  // namespace revkernels
