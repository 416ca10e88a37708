// Shared by the Autograd-key kernels (csrc/ops/<family>_autograd.cpp). Each differentiable op has a
// torch::autograd::Function whose forward calls the op again below autograd, reaching the device
// kernel (which checks the arguments), and whose backward calls the ops or ATen. The formulas are
// device-agnostic: every device's kernel gets them. Math: revkernels/ops/<family>.py.
// A backward returns one grad per forward argument (undefined for the non-tensor ones); the edge
// indices of ctx->needs_input_grad count tensor arguments only (the ops take them first).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include "coupling_layout.h"  // check_defined: Function::apply reads every tensor argument's device

namespace revkernels {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The dispatcher handle of the op `qualified_name` ("revkernels::<op>") with C++ signature `Signature`.
template <typename Signature>
c10::TypedOperatorHandle<Signature> typed_op(const char* qualified_name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(qualified_name, "").typed<Signature>();
}

}  // namespace revkernels
