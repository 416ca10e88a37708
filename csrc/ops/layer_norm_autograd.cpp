// Autograd kernel of revkernels::sub_layer_norm; its VJP is layer_norm_bwd_add (which itself has
// no autograd formula). With grads (dx_out, dln) of the outputs (x, ln); mean and rstd are not
// differentiable:
//   (dx, dweight, dbias) = layer_norm_bwd_add(dln, x, weight, mean, rstd, dres=dx_out)
//   d y = dx,   d g = -dx in g's dtype,   d weight = dweight,   d bias = dbias in bias's dtype
// (weight passed in the accumulation dtype when bias has another dtype: neither sum is rounded twice).
// A backward that builds a graph (create_graph=True: a double backward) computes the same VJP with
// ATen's differentiable native_layer_norm_backward (its derivative accounts for mean and rstd as
// functions of x), on x, weight and bias in the op's accumulation dtype.
#include <torch/library.h>

#include <tuple>

#include "autograd.h"

namespace revkernels {
namespace {

using Tensors3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensors4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using SubLayerNormOp = Tensors4(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using LayerNormBwdAddOp = Tensors3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&);

struct SubLayerNorm : torch::autograd::Function<SubLayerNorm> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& g,
                               const at::Tensor& weight, const at::Tensor& bias, double eps) {
    static const auto op = typed_op<SubLayerNormOp>("revkernels::sub_layer_norm");
    at::Tensor x, ln, mean, rstd;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      std::tie(x, ln, mean, rstd) = op.call(y, g, weight, bias, eps);
    }
    ctx->save_for_backward({x, weight, mean, rstd, bias});
    ctx->saved_data["g_dtype"] = g.scalar_type();
    ctx->saved_data["bias_dtype"] = bias.scalar_type();
    ctx->mark_non_differentiable({mean, rstd});
    return {x, ln, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = typed_op<LayerNormBwdAddOp>("revkernels::layer_norm_bwd_add");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const auto bias_dtype = ctx->saved_data["bias_dtype"].toScalarType();
    const auto g_dtype = ctx->saved_data["g_dtype"].toScalarType();
    if (at::GradMode::is_enabled()) {
      const auto acc = saved[2].scalar_type();  // the statistics are in the accumulation dtype
      auto [dln_x, dweight, dbias] = at::native_layer_norm_backward(
          grads[1].to(acc), x.to(acc), {x.size(-1)}, saved[2], saved[3], weight.to(acc), saved[4].to(acc),
          {true, true, true});
      const at::Tensor dx = (dln_x + grads[0].to(acc)).to(x.scalar_type());
      return {dx, dx.neg().to(g_dtype), dweight.to(weight.scalar_type()), dbias.to(bias_dtype), at::Tensor()};
    }
    // The op returns dweight and dbias in the dtype of the weight it gets: where bias has another dtype, it gets
    // weight in the accumulation dtype, and each sum is rounded once, to its parameter's dtype.
    const at::Tensor w = weight.scalar_type() == bias_dtype ? weight : weight.to(accumulate_dtype(x, grads[0]));
    auto [dx, dweight, dbias] = bwd.call(grads[1], x, w, saved[2], saved[3], grads[0]);
    at::Tensor dg;
    if (ctx->needs_input_grad(1)) dg = dx.neg().to(g_dtype);
    return {dx, dg, dweight.to(weight.scalar_type()), dbias.to(bias_dtype), at::Tensor()};
  }
};

Tensors4 sub_layer_norm_autograd(const at::Tensor& y, const at::Tensor& g, const at::Tensor& weight,
                                 const at::Tensor& bias, double eps) {
  check_defined(y, "y");
  check_defined(g, "g");
  check_defined(weight, "weight");
  check_defined(bias, "bias");
  if (!records_grad({y, g, weight, bias})) {
    static const auto op = typed_op<SubLayerNormOp>("revkernels::sub_layer_norm");
    return call_below_autograd(op, y, g, weight, bias, eps);
  }
  const variable_list out = SubLayerNorm::apply(y, g, weight, bias, eps);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, Autograd, m) { m.impl("sub_layer_norm", &sub_layer_norm_autograd); }

}  // namespace revkernels
