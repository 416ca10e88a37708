// Autograd kernel of revkernels::bias_gelu; its VJP is bias_gelu_bwd (which itself has no autograd
// formula): (dx, dbias) = bias_gelu_bwd(g in x's dtype, x, bias, approximate); no grad for approximate.
// A backward that builds a graph (create_graph=True: a double backward) computes the same VJP with
// ATen's differentiable gelu_backward instead, in the op's accumulation dtype:
//   dz = gelu_backward(g, x + bias),   dx = dz in x's dtype,   dbias = dz summed over rows in bias's dtype
#include <torch/library.h>

#include <string>
#include <tuple>

#include "autograd.h"

namespace revkernels {
namespace {

using BiasGeluOp = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view);
using BiasGeluBwdOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                         c10::string_view);

struct BiasGelu : torch::autograd::Function<BiasGelu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bias,
                            c10::string_view approximate) {
    static const auto op = typed_op<BiasGeluOp>("revkernels::bias_gelu");
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      y = op.call(x, bias, approximate);
    }
    ctx->save_for_backward({x, bias});
    ctx->saved_data["approximate"] = std::string(approximate);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = typed_op<BiasGeluBwdOp>("revkernels::bias_gelu_bwd");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &bias = saved[1];
    const c10::string_view approximate = ctx->saved_data["approximate"].toStringView();
    at::Tensor dx, dbias;
    if (at::GradMode::is_enabled()) {
      const auto acc = accumulate_dtype(x, bias);
      const at::Tensor dz = at::gelu_backward(grads[0].to(acc), x.to(acc) + bias.to(acc), approximate);
      dx = dz.to(x.scalar_type());
      dbias = dz.reshape({-1, bias.size(0)}).sum(0).to(bias.scalar_type());
    } else {
      std::tie(dx, dbias) = bwd.call(grads[0].to(x.scalar_type()), x, bias, approximate);
    }
    return {ctx->needs_input_grad(0) ? dx : at::Tensor(), ctx->needs_input_grad(1) ? dbias : at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor bias_gelu_autograd(const at::Tensor& x, const at::Tensor& bias, c10::string_view approximate) {
  check_defined(x, "x");
  check_defined(bias, "bias");
  if (!records_grad({x, bias})) {
    static const auto op = typed_op<BiasGeluOp>("revkernels::bias_gelu");
    return call_below_autograd(op, x, bias, approximate);
  }
  return BiasGelu::apply(x, bias, approximate);
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, Autograd, m) { m.impl("bias_gelu", &bias_gelu_autograd); }

}  // namespace revkernels
