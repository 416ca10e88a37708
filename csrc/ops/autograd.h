// Shared by the Autograd-key kernels (csrc/ops/<family>_autograd.cpp). Each differentiable op has a
// torch::autograd::Function whose forward calls the op again below autograd, reaching the device
// kernel (which checks the arguments), and whose backward calls the ops or ATen (the coupling ops,
// whose derivative is that of ATen's sub / add, attach ATen's own nodes instead). The formulas are
// device-agnostic: every device's kernel gets them. Math: revkernels/ops/<family>.py.
// A backward returns one grad per forward argument (undefined for the non-tensor ones); the edge
// indices of ctx->needs_input_grad count tensor arguments only (the ops take them first).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <utility>

#include "coupling_layout.h"  // check_defined: Function::apply reads every tensor argument's device

namespace revkernels {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The dispatcher handle of the op `qualified_name` ("revkernels::<op>") with C++ signature `Signature`.
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").typed<Signature>();
}

// Whether an autograd kernel must build a graph node: grad mode on and a tensor argument that
// requires grad. Otherwise the kernel calls the op below autograd directly: no node is built, and
// torch.func transforms (which refuse a C++ autograd::Function) see a plain call.
// The ops have no forward-mode formula: a dual tensor (forward AD) raises instead of losing its
// tangent.
inline bool records_grad(std::initializer_list<std::reference_wrapper<const at::Tensor>> tensors) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK_NOT_IMPLEMENTED(!t.defined() || !t._fw_grad(/*level=*/0).defined(),
                                "revkernels: the ops have no forward-mode AD formula (an input is a dual tensor of "
                                "torch.autograd.forward_ad); differentiate them in reverse mode");
  }
  if (!at::GradMode::is_enabled()) return false;
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.requires_grad()) return true;
  }
  return false;
}

// The dtype the ops accumulate in: fp64 where an argument is fp64, else fp32.
inline at::ScalarType accumulate_dtype(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == at::kDouble || b.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A new graph node of type T, held as torch's autograd Edge holds nodes: by std::shared_ptr up to
// torch 2.11 at least, by c10::intrusive_ptr in 2.13 and later (pyproject allows torch >= 2.11).
template <typename T>
auto make_node() {
  using Handle = decltype(std::declval<torch::autograd::Edge>().function);
  if constexpr (std::is_same_v<Handle, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

// `op.call(args...)` below autograd (a kernel whose inputs need no graph node).
template <typename Signature, typename... Args>
decltype(auto) call_below_autograd(const c10::TypedOperatorHandle<Signature>& op, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(std::forward<Args>(args)...);
}

}  // namespace revkernels
