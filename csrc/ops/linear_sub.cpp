// revkernels::linear_sub: the GEMM-side rebuild x = y - (a @ W^T + b) as one addmm with y as the
// accumulator (math and semantics: revkernels/ops/linear_sub.py). A composite of ATen calls, so one
// kernel serves every device (CompositeExplicitAutograd); its autograd formula is in
// linear_sub_autograd.cpp.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "coupling_layout.h"  // scalar_kind (the float dtype check)

namespace revkernels {
namespace {

void check_device(const at::Tensor& t, const char* name, const at::Tensor& y) {
  TORCH_CHECK_VALUE(t.device() == y.device(), "revkernels: ", name, " must be on the device of y (", y.device(),
                    "), got ", t.device());
}

// y (..., N), a (..., K), weight (N, K), bias (N,) or None: float dtypes, y's device.
void check_linear_sub_args(const at::Tensor& y, const at::Tensor& a, const at::Tensor& weight,
                           const std::optional<at::Tensor>& bias) {
  scalar_kind(y, "y");
  scalar_kind(a, "a");
  scalar_kind(weight, "weight");
  if (bias) scalar_kind(*bias, "bias");
  TORCH_CHECK_VALUE(weight.dim() == 2, "revkernels: weight must be 2-D (out_features, in_features), got shape ",
                    weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK_VALUE(a.dim() >= 1 && a.size(-1) == k, "revkernels: a must have last dim ", k,
                    " (weight's in_features), got shape ", a.sizes());
  std::vector<int64_t> y_shape(a.sizes().begin(), a.sizes().end() - 1);
  y_shape.push_back(n);
  TORCH_CHECK_VALUE(y.sizes() == at::IntArrayRef(y_shape), "revkernels: y must have shape ", at::IntArrayRef(y_shape),
                    " (a's leading dims, weight's out_features), got ", y.sizes());
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "revkernels: bias must have shape (", n, ",), got ",
                      bias->sizes());
  }
  check_device(a, "a", y);
  check_device(weight, "weight", y);
  if (bias) check_device(*bias, "bias", y);
}

// The GEMM runs in the autocast dtype when autocast is on for a's device, as F.linear would, except
// with a float64 operand (autocast leaves float64 alone); else in the promoted dtype of a and weight.
at::ScalarType gemm_dtype(const at::Tensor& a, const at::Tensor& weight) {
  const auto device_type = a.device().type();
  if (at::autocast::is_autocast_available(device_type) && at::autocast::is_autocast_enabled(device_type) &&
      a.scalar_type() != at::kDouble && weight.scalar_type() != at::kDouble) {
    return at::autocast::get_autocast_dtype(device_type);
  }
  return at::promote_types(a.scalar_type(), weight.scalar_type());
}

// `t` in `dtype`, contiguous (the result's layout whatever y's: the fake kernel's), copied at most once.
at::Tensor contiguous_in(const at::Tensor& t, at::ScalarType dtype) {
  return t.is_contiguous() ? t.to(dtype) : at::empty(t.sizes(), t.options().dtype(dtype)).copy_(t);
}

at::Tensor linear_sub_composite(const at::Tensor& y, const at::Tensor& a, const at::Tensor& weight,
                                const std::optional<at::Tensor>& bias) {
  check_linear_sub_args(y, a, weight, bias);
  const at::ScalarType gemm = gemm_dtype(a, weight);
  // The casts are explicit; ATen's autocast must not recast the GEMM's operands.
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t rows = c10::multiply_integers(a.sizes().slice(0, a.dim() - 1));  // k or n may be 0: no -1
  const at::Tensor a2d = a.reshape({rows, k}).to(gemm), w = weight.to(gemm);
  at::Tensor acc = y.reshape({rows, n});  // addmm reads its accumulator and writes a new tensor: y is not modified
  const at::ScalarType acc_dtype = at::promote_types(y.scalar_type(), gemm);
  if (bias && at::isReducedFloatingType(acc_dtype)) {
    // A 16-bit accumulator would round y - b before the GEMM adds to it: F.linear's single rounding of
    // a @ W^T + b, then the subtraction's (see revkernels/ops/linear_sub.py).
    const at::Tensor out = acc.to(acc_dtype) - at::addmm(bias->to(gemm), a2d, w.t());
    return contiguous_in(out.reshape(y.sizes()), y.scalar_type());
  }
  // The accumulator in acc_dtype, bias or not (a 16-bit y, fp32 GEMM: no 16-bit rounding of the product);
  // y - b formed in the wider of acc_dtype and b's dtype, not in y's and b's (bf16 y and b: one bf16
  // rounding of y - b before an fp32 GEMM would be the result's whole error).
  if (bias) {
    const at::ScalarType sub = at::promote_types(acc_dtype, bias->scalar_type());
    acc = (acc.to(sub) - bias->to(sub)).to(acc_dtype);
  } else {
    acc = acc.to(acc_dtype);
  }
  const bool own_acc = bias || y.scalar_type() != acc_dtype;  // y - b, or y converted: not y itself
  at::Tensor out;
  if (acc.scalar_type() == gemm && own_acc) {
    // the GEMM accumulates into this call's own tensor in place (addmm would copy it first)
    out = acc.addmm_(a2d, w.t(), /*beta=*/1, /*alpha=*/-1);
  } else if (acc.scalar_type() == gemm) {
    out = at::addmm(acc, a2d, w.t(), /*beta=*/1, /*alpha=*/-1);
  } else if (acc.is_cuda() && acc.scalar_type() == at::kFloat) {
    // bf16/fp16 GEMM accumulating into the fp32 stream: cuBLAS with an fp32 C matrix.
    out = at::addmm(acc, a2d, w.t(), at::kFloat, /*beta=*/1, /*alpha=*/-1);
  } else {  // CPU BLAS has no mixed-dtype GEMM: subtract the product in the wider dtype
    out = acc - at::mm(a2d, w.t()).to(acc.scalar_type());
  }
  return contiguous_in(out.reshape(y.sizes()), y.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(revkernels, m) {
  // y - (a @ weight^T + bias) in y's dtype; y (..., N), a (..., K), weight (N, K), bias (N,) or None.
  m.def("linear_sub(Tensor y, Tensor a, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(revkernels, CompositeExplicitAutograd, m) { m.impl("linear_sub", &linear_sub_composite); }

}  // namespace revkernels
