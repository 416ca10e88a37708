// Autograd kernel of revkernels::batch_norm_act; its VJP is batch_norm_act_bwd (which itself has no
// autograd formula). mean and rstd are not differentiable; with grad dout of out:
//   (dx, dweight, dbias) = batch_norm_act_bwd(dout in x's dtype, x, weight, bias, mean, rstd, relu)
//   d x = dx,   d weight = dweight,   d bias = dbias.
// A backward that builds a graph (create_graph=True: a double backward) computes the same VJP with
// ATen's differentiable native_batch_norm_backward (its derivative accounts for mean and rstd as
// functions of x) in the accumulation dtype, after ReLU's mask from y recomputed as the forward
// formed it (a NaN y passes dout; the mask is constant almost everywhere: no second-order term).
#include <torch/library.h>

#include <tuple>
#include <vector>

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
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({mean, rstd});
    return {out, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = typed_op<BatchNormActBwdOp>("revkernels::batch_norm_act_bwd");
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &weight = s[1], &bias = s[2], &mean = s[3], &rstd = s[4];
    const bool relu = ctx->saved_data["relu"].toBool();
    at::Tensor dx, dweight, dbias;
    if (at::GradMode::is_enabled()) {
      const auto acc = mean.scalar_type();  // the statistics are in the accumulation dtype
      std::vector<int64_t> channel_shape(x.dim(), 1);
      channel_shape[1] = x.size(1);
      const at::Tensor xa = x.to(acc), wa = weight.to(acc);
      at::Tensor dy = grads[0].to(acc);
      if (relu) {
        at::Tensor y;
        {
          at::NoGradGuard no_grad;
          y = (xa - mean.view(channel_shape)) * rstd.view(channel_shape) * wa.view(channel_shape) +
              bias.to(acc).view(channel_shape);
        }
        dy = dy * (y.gt(0) | y.isnan()).to(acc);
      }
      std::tie(dx, dweight, dbias) = at::native_batch_norm_backward(
          dy, xa, wa, /*running_mean=*/{}, /*running_var=*/{}, mean, rstd, /*train=*/true,
          ctx->saved_data["eps"].toDouble(), {true, true, true});
      dx = dx.to(x.scalar_type());
      dweight = dweight.to(weight.scalar_type());
      dbias = dbias.to(bias.scalar_type());
    } else {
      std::tie(dx, dweight, dbias) = bwd.call(grads[0].to(x.scalar_type()), x, weight, bias, mean, rstd, relu);
    }
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
