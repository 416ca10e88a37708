#include "coupling_layout.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace revkernels {

void check_defined(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.defined(), "revkernels: ", name, " must be a torch.Tensor, got None");
}

ScalarKind scalar_kind(at::ScalarType dtype, const char* name) {
  switch (dtype) {
    case at::kFloat: return ScalarKind::Float32;
    case at::kDouble: return ScalarKind::Float64;
    case at::kHalf: return ScalarKind::Float16;
    case at::kBFloat16: return ScalarKind::BFloat16;
    default:
      TORCH_CHECK_TYPE(false, "revkernels: ", name, " must be float32, float64, float16 or bfloat16, got ", dtype);
  }
}

ScalarKind scalar_kind(const at::Tensor& t, const char* name) {
  check_defined(t, name);
  return scalar_kind(t.scalar_type(), name);
}

at::Tensor element_aligned(const at::Tensor& t) {
  if (!t.defined() || t.numel() == 0) return t;
  const auto address = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return address % static_cast<uintptr_t>(t.element_size()) == 0 ? t : t.clone();
}

at::Tensor acc_vector(const at::Tensor& t, at::ScalarType acc_dtype) {
  return element_aligned(t.to(acc_dtype).contiguous());
}

void check_coupling_args(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  scalar_kind(a, a_name);
  scalar_kind(b, b_name);
  check_same_shape_and_device(a, a_name, b, b_name);
}

void check_same_shape_and_device(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK_VALUE(a.sizes() == b.sizes(), "revkernels: ", b_name, " must have the shape of ", a_name, " ",
                    a.sizes(), ", got ", b.sizes());
  TORCH_CHECK_VALUE(a.device() == b.device(), "revkernels: ", b_name, " must be on the device of ", a_name, " (",
                    a.device(), "), got ", b.device());
}

bool make_coupling_layout(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                          CouplingLayout* layout) {
  const int64_t nd = out.dim();
  std::vector<int64_t> order(nd);
  std::iota(order.begin(), order.end(), 0);
  // `out` is dense: sorting its dims by stride (outermost first) makes it contiguous.
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t i, int64_t j) { return out.stride(i) > out.stride(j); });
  std::vector<int64_t> sizes, a_strides, b_strides;
  for (int64_t d : order) {
    if (out.size(d) == 1) continue;
    const int64_t sa = a.stride(d), sb = b.stride(d);
    if (!sizes.empty() && a_strides.back() == sa * out.size(d) && b_strides.back() == sb * out.size(d)) {
      sizes.back() *= out.size(d);  // the previous dim steps exactly over this one: merge
      a_strides.back() = sa;
      b_strides.back() = sb;
      continue;
    }
    sizes.push_back(out.size(d));
    a_strides.push_back(sa);
    b_strides.push_back(sb);
  }
  if (static_cast<int64_t>(sizes.size()) > kMaxDims) return false;
  layout->ndim = static_cast<int>(sizes.size());
  for (size_t d = 0; d < sizes.size(); ++d) {
    layout->sizes[d] = sizes[d];
    layout->a_strides[d] = a_strides[d];
    layout->b_strides[d] = b_strides[d];
  }
  return true;
}

}  // namespace revkernels
