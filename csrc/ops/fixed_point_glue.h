// ATen glue shared by the CPU and CUDA bindings of the fixed-point ops (math: revkernels/ops/
// fixed_point.py): argument checks, the outputs and the iteration layout handed to the torch-free
// kernels (kernels/fixed_point.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "../kernels/fixed_point.h"
#include "coupling_layout.h"

namespace revkernels {

// One call of a fixed-point op, checked: the outputs in the layout of torch.empty_like(its first
// tensor argument) and the inputs' iteration layout against them (x's strides as the layout's a
// strides, f's as its b strides; FromFloat takes f's for both, View x's).
struct FixedPointCall {
  FixedPointOp op;
  at::Tensor x, f;       // the stream (undefined for FromFloat) and the branch value (undefined for View)
  at::Tensor out, view;  // the int64 result (undefined for View) and its float view
  ScalarKind f_kind = ScalarKind::Float32, view_kind = ScalarKind::Float32;
  int bits = 0;
  CouplingLayout layout;
};

// Checks the arguments as the Python checks do (errors naming them: revkernels/ops/fixed_point.py):
// `x` an int64 stream named `x_name` (FromFloat: the float input, named "x"), `f` a float tensor
// of x's shape and device, bits in [1, 60], `dtype` a float dtype; then allocates the outputs.
// `align` (CPU): inputs whose data pointer is not a multiple of their element size are copied
// (element_aligned). An input layout with more dims than the kernels take is copied into the
// outputs' layout.
FixedPointCall prepare_fixed_point(FixedPointOp op, const at::Tensor& x, const char* x_name, const at::Tensor& f,
                                   int64_t bits, at::ScalarType dtype, bool align);

// One device's kernel of the ops: `op` with the arguments of prepare_fixed_point (x undefined for
// FromFloat, f for View), returning (view, stream, overflow) (stream and overflow undefined for View).
using FixedPointResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using FixedPointStep = FixedPointResult (*)(FixedPointOp op, const at::Tensor& x, const char* x_name,
                                            const at::Tensor& f, int64_t bits, at::ScalarType dtype);

// Registers `step` as the kernels of the four ops `<prefix>fixed_point_*` (their schemas' signatures).
template <FixedPointStep step>
void register_fixed_point_kernels(torch::Library& m, const std::string& prefix) {
  m.impl((prefix + "fixed_point_from_float").c_str(), [](const at::Tensor& x, int64_t bits) {
    return step(FixedPointOp::FromFloat, at::Tensor(), "x", x, bits, at::kFloat);
  });
  m.impl((prefix + "fixed_point_add").c_str(), [](const at::Tensor& x, const at::Tensor& f, int64_t bits,
                                                  at::ScalarType dtype) {
    return step(FixedPointOp::Add, x, "x", f, bits, dtype);
  });
  m.impl((prefix + "fixed_point_sub").c_str(), [](const at::Tensor& y, const at::Tensor& f, int64_t bits,
                                                  at::ScalarType dtype) {
    return step(FixedPointOp::Sub, y, "y", f, bits, dtype);
  });
  m.impl((prefix + "fixed_point_view").c_str(), [](const at::Tensor& x, int64_t bits, at::ScalarType dtype) {
    return std::get<0>(step(FixedPointOp::View, x, "x", at::Tensor(), bits, dtype));
  });
}

}  // namespace revkernels
