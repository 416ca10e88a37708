// Autograd kernel of revkernels::batch_norm_act; its VJP is batch_norm_act_bwd (which itself has no
// autograd formula). mean and rstd are not differentiable; with grad dout of out:
//   (dx, dweight, dbias) = batch_norm_act_bwd(dout in x's dtype, x, weight, bias, mean, rstd, relu)
//   d x = dx,   d weight = dweight,   d bias = dbias.
#include <torch/library.h>

#include <tuple>

#include "autograd.h"

namespace revkernels {
namespace {

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using BatchNormActOp = Tensors3(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool);
using BatchNormActBwdOp = Tensors3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, bool);

struct BatchNormAct : torch::autograd::Function<BatchNormAct> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& bias, double eps, bool relu) {
    static const auto op = typed_op<BatchNormActOp>("revkernels::batch_norm_act");
    at::Tensor out, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(out, mean, rstd) = op.call(x, weight, bias, eps, relu);
    }
    ctx->save_for_backward({x, weight, bias, mean, rstd});
    ctx->saved_data["relu"] = relu;
    ctx->mark_non_differentiable({mean, rstd});
    return {out, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = typed_op<BatchNormActBwdOp>("revkernels::batch_norm_act_bwd");
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &bias = s[2];
    auto [dx, dweight, dbias] = bwd.call(grads[0].to(x.scalar_type()), x, s[1], bias, s[3], s[4],
                                         ctx->saved_data["relu"].toBool());
    return {ctx->needs_input_grad(0) ? dx : at::Tensor(), ctx->needs_input_grad(1) ? dweight : at::Tensor(),
            ctx->needs_input_grad(2) ? dbias : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

Tensors3 batch_norm_act_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps,
                                 bool relu) {
  check_defined(x, "x");
  check_defined(weight, "weight");
  check_defined(bias, "bias");
  if (!records_grad({x, weight, bias})) {
    static const auto op = typed_op<BatchNormActOp>("revkernels::batch_norm_act");
    return call_below_autograd(op, x, weight, bias, eps, relu);
  }
  const variable_list out = BatchNormAct::apply(x, weight, bias, eps, relu);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, Autograd, m) { m.impl("batch_norm_act", &batch_norm_act_autograd); }

}  // namespace revkernels
