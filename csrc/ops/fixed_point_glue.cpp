#include "fixed_point_glue.h"

namespace revkernels {
namespace {

void check_stream(const at::Tensor& t, const char* name) {
  check_defined(t, name);
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "revkernels: ", name, " must be an int64 fixed-point stream, got ",
                   t.scalar_type());
}

void check_bits(int64_t bits) {
  TORCH_CHECK_VALUE(bits >= kFixedPointMinBits && bits <= kFixedPointMaxBits,
                    "revkernels: bits must be in [1, 60] (fraction bits of the int64 streams), got ", bits);
}

}  // namespace

FixedPointCall prepare_fixed_point(FixedPointOp op, const at::Tensor& x_in, const char* x_name, const at::Tensor& f_in,
                                   int64_t bits, at::ScalarType dtype, bool align) {
  FixedPointCall c;
  c.op = op;
  if (op == FixedPointOp::FromFloat) {
    c.f_kind = c.view_kind = scalar_kind(f_in, "x");
  } else {
    check_stream(x_in, x_name);
    if (op != FixedPointOp::View) c.f_kind = scalar_kind(f_in, "f");
  }
  check_bits(bits);
  c.bits = static_cast<int>(bits);
  if (op != FixedPointOp::FromFloat) c.view_kind = scalar_kind(dtype, "dtype");
  if (op == FixedPointOp::Add || op == FixedPointOp::Sub) {
    check_same_shape_and_device(x_in, x_name, f_in, "f");
  }
  if (op != FixedPointOp::FromFloat) c.x = align ? element_aligned(x_in) : x_in;
  if (op != FixedPointOp::View) c.f = align ? element_aligned(f_in) : f_in;
  const at::Tensor& first = op == FixedPointOp::FromFloat ? c.f : c.x;
  c.view = at::empty_like(first, first.options().dtype(op == FixedPointOp::FromFloat ? first.scalar_type() : dtype));
  if (op != FixedPointOp::View) c.out = at::empty_like(first, first.options().dtype(at::kLong));
  if (first.numel() == 0) return c;
  const at::Tensor& a = c.x.defined() ? c.x : c.f;
  const at::Tensor& b = c.f.defined() ? c.f : c.x;
  if (!make_coupling_layout(c.view, a, b, &c.layout)) {
    // Too many strided dims: copies of the inputs in the outputs' dense layout, where all dims merge.
    if (c.x.defined()) c.x = at::empty_like(c.view, c.x.options()).copy_(c.x);
    if (c.f.defined()) c.f = at::empty_like(c.view, c.f.options()).copy_(c.f);
    const bool merged = make_coupling_layout(c.view, c.x.defined() ? c.x : c.f, c.f.defined() ? c.f : c.x, &c.layout);
    TORCH_INTERNAL_ASSERT(merged);
  }
  return c;
}

}  // namespace revkernels
