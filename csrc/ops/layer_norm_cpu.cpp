// CPU implementations of revkernels::sub_layer_norm / layer_norm_bwd_add: the vectorised kernels of
// cpu/vec_kernels.h (semantics: kernels/layer_norm.h), rows split across threads with
// at::parallel_for.
//
// Layouts: the last dim is the normalised one. An input is handed to the kernel as a (rows, n)
// view when its leading dims merge into one row stride and its last dim has unit stride (dense
// tensors, rows sliced out of a wider buffer, a row broadcast with stride 0); any other layout
// (a transposed last dim, leading dims that do not merge) is first copied with .contiguous().
// Outputs are contiguous. weight, bias, mean and rstd are converted to the accumulation type
// (n or rows elements; nothing next to the rows).
#include <ATen/Parallel.h>
#include <ATen/TensorUtils.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <tuple>

#include "../cpu/vec_kernels.h"
#include "../kernels/layer_norm.h"
#include "coupling_layout.h"  // scalar_kind, element_aligned

namespace revkernels {
namespace {

constexpr int64_t kGrainSize = 32768;  // elements per parallel_for task, at least
// Backward: rows are cut into at most kMaxRowBlocks blocks of at least kMinRowsPerBlock rows, each
// with its own fp32 (fp64) dweight/dbias partial sums, reduced afterwards in block order. The cut
// depends only on the shape, never on the thread count, so results are bitwise reproducible.
constexpr int64_t kMaxRowBlocks = 64;
constexpr int64_t kMinRowsPerBlock = 8;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "revkernels: ", name, " must be on the device of ", ref_name, " (",
                    ref.device(), "), got ", t.device());
}

// The width n of the normalised (last) dim of `t`.
int64_t normalised_width(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() >= 1, "revkernels: ", name, " must have at least one dim (the normalised one)");
  TORCH_CHECK_VALUE(t.size(-1) > 0, "revkernels: the last (normalised) dim of ", name, " must be non-empty");
  return t.size(-1);
}

void check_same_shape(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), "revkernels: ", name, " must have the shape of ", ref_name, " ",
                    ref.sizes(), ", got ", t.sizes());
}

void check_param(const at::Tensor& p, const char* name, int64_t n, const char* data_name) {
  scalar_kind(p, name);
  TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == n, "revkernels: ", name, " must have shape (", n,
                    ",), the last dim of ", data_name, ", got ", p.sizes());
}

void check_row_stat(const at::Tensor& s, const char* name, const at::Tensor& x) {
  scalar_kind(s, name);
  TORCH_CHECK_VALUE(s.sizes() == x.sizes().slice(0, x.dim() - 1), "revkernels: ", name,
                    " must have shape x.shape[:-1] ", x.sizes().slice(0, x.dim() - 1), ", got ", s.sizes());
}

// A (rows, n) view of `t` with unit stride along n (see the layouts note at the top), or a
// contiguous copy when there is none.
at::Tensor as_rows(const at::Tensor& t, int64_t rows, int64_t n) {
  const std::array<int64_t, 2> shape{rows, n};
  const auto strides = at::detail::computeStride(t.sizes(), t.strides(), at::IntArrayRef(shape));
  if (strides && ((*strides)[1] == 1 || n == 1)) {
    const std::array<int64_t, 2> row_strides{(*strides)[0], 1};
    return t.as_strided(shape, row_strides);
  }
  return t.contiguous().view({rows, n});
}

template <typename T> T* ptr(const at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }
template <typename T> const T* cptr(const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sub_layer_norm_op(
    const at::Tensor& y, const at::Tensor& g, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const ScalarKind y_kind = scalar_kind(y, "y");
  const ScalarKind g_kind = scalar_kind(g, "g");
  check_same_shape(g, "g", y, "y");
  const int64_t n = normalised_width(y, "y");
  check_param(weight, "weight", n, "y");
  check_param(bias, "bias", n, "y");
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, "revkernels: eps must be finite and non-negative, got ", eps);
  check_same_device(g, "g", y, "y");
  check_same_device(weight, "weight", y, "y");
  check_same_device(bias, "bias", y, "y");
  TORCH_CHECK_VALUE(y.device().is_cpu(), "revkernels: y must be a CPU tensor here");

  const bool acc_double = y_kind == ScalarKind::Float64 || g_kind == ScalarKind::Float64;
  const auto acc_options = y.options().dtype(acc_double ? at::kDouble : at::kFloat);
  at::Tensor x = at::empty(y.sizes(), y.options());
  at::Tensor ln = at::empty(y.sizes(), y.options());
  at::Tensor mean = at::empty(y.sizes().slice(0, y.dim() - 1), acc_options);
  at::Tensor rstd = at::empty(y.sizes().slice(0, y.dim() - 1), acc_options);
  const int64_t rows = y.numel() / n;
  if (rows == 0) return {x, ln, mean, rstd};

  const at::Tensor y_rows = element_aligned(as_rows(y, rows, n)), g_rows = element_aligned(as_rows(g, rows, n));
  const at::Tensor w = acc_vector(weight, acc_options.dtype().toScalarType()),
                   b = acc_vector(bias, acc_options.dtype().toScalarType());
  const CpuKernels& kernels = cpu_kernels();
  const bool stream = stream_outputs(y.numel() * (3 * y.element_size() + g.element_size()));  // y, g in; x, ln out
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainSize / n), [&](int64_t begin, int64_t end) {
    kernels.sub_layer_norm(x.data_ptr(), ln.data_ptr(), mean.data_ptr(), rstd.data_ptr(), y_kind,
                           y_rows.const_data_ptr(), y_rows.stride(0), g_rows.const_data_ptr(), g_kind, g_rows.stride(0),
                           w.const_data_ptr(), b.const_data_ptr(), eps, n, begin, end, stream);
  });
  return {x, ln, mean, rstd};
}

// out (weight's dtype) = the sum of `partials` (num_blocks, n) over blocks.
template <typename acc_t>
void reduce_partials(const at::Tensor& out, const at::Tensor& partials) {
  const int64_t num_blocks = partials.size(0), n = partials.size(1);
  dispatch_float_type(scalar_kind(out, "weight"), [&](auto out_tag) {
    using out_t = typename decltype(out_tag)::type;
    at::parallel_for(0, n, std::max<int64_t>(1, kGrainSize / num_blocks), [&](int64_t begin, int64_t end) {
      reduce_partials_cpu<acc_t>(ptr<out_t>(out), cptr<acc_t>(partials), num_blocks, n, begin, end);
    });
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_add_op(
    const at::Tensor& dln, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& mean,
    const at::Tensor& rstd, const at::Tensor& dres) {
  const ScalarKind x_kind = scalar_kind(x, "x");
  scalar_kind(dln, "dln");
  const ScalarKind dres_kind = scalar_kind(dres, "dres");
  TORCH_CHECK_TYPE(dln.scalar_type() == x.scalar_type(), "revkernels: dln must have the dtype of x (",
                   x.scalar_type(), "), got ", dln.scalar_type());
  const int64_t n = normalised_width(x, "x");
  check_same_shape(dln, "dln", x, "x");
  check_same_shape(dres, "dres", x, "x");
  check_param(weight, "weight", n, "x");
  check_row_stat(mean, "mean", x);
  check_row_stat(rstd, "rstd", x);
  check_same_device(dln, "dln", x, "x");
  check_same_device(weight, "weight", x, "x");
  check_same_device(mean, "mean", x, "x");
  check_same_device(rstd, "rstd", x, "x");
  check_same_device(dres, "dres", x, "x");
  TORCH_CHECK_VALUE(x.device().is_cpu(), "revkernels: x must be a CPU tensor here");

  const bool acc_double = x_kind == ScalarKind::Float64 || dres_kind == ScalarKind::Float64;
  const auto acc_dtype = acc_double ? at::kDouble : at::kFloat;
  at::Tensor dx = at::empty(x.sizes(), dres.options());
  at::Tensor dweight = at::empty({n}, weight.options());
  at::Tensor dbias = at::empty({n}, weight.options());
  const int64_t rows = x.numel() / n;
  if (rows == 0) {
    dweight.zero_();
    dbias.zero_();
    return {dx, dweight, dbias};
  }

  const at::Tensor dln_rows = element_aligned(as_rows(dln, rows, n)), x_rows = element_aligned(as_rows(x, rows, n));
  const at::Tensor dres_rows = element_aligned(as_rows(dres, rows, n));
  const at::Tensor w = acc_vector(weight, acc_dtype);
  const at::Tensor mu = acc_vector(mean, acc_dtype), rs = acc_vector(rstd, acc_dtype);
  const int64_t rows_per_block = ceil_div(rows, std::min(kMaxRowBlocks, ceil_div(rows, kMinRowsPerBlock)));
  const int64_t num_blocks = ceil_div(rows, rows_per_block);
  const at::Tensor partials = at::empty({2, num_blocks, n}, x.options().dtype(acc_dtype));
  const int64_t grain = std::max<int64_t>(1, kGrainSize / (rows_per_block * n));
  const CpuKernels& kernels = cpu_kernels();
  char* const dweight_partials = static_cast<char*>(partials.data_ptr());
  char* const dbias_partials = dweight_partials + num_blocks * n * partials.element_size();
  at::parallel_for(0, num_blocks, grain, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t blk = block_begin; blk < block_end; ++blk) {
      const int64_t offset = blk * n * partials.element_size();
      kernels.layer_norm_bwd_add(dx.data_ptr(), dres_kind, dweight_partials + offset, dbias_partials + offset,
                                 dln_rows.const_data_ptr(), dln_rows.stride(0), x_rows.const_data_ptr(), x_kind,
                                 x_rows.stride(0), w.const_data_ptr(), mu.const_data_ptr(), rs.const_data_ptr(),
                                 dres_rows.const_data_ptr(), dres_rows.stride(0), n, blk * rows_per_block,
                                 std::min(rows, (blk + 1) * rows_per_block));
    }
  });
  // dispatch_float_pair(first, second): acc_t is double when either dtype is double.
  dispatch_float_pair(dres_kind, x_kind, [&](auto acc_tag, auto, auto) {
    using acc_t = typename decltype(acc_tag)::type;
    reduce_partials<acc_t>(dweight, partials[0]);
    reduce_partials<acc_t>(dbias, partials[1]);
  });
  return {dx, dweight, dbias};
}

}  // namespace

TORCH_LIBRARY_IMPL(revkernels, CPU, m) {
  m.impl("sub_layer_norm", &sub_layer_norm_op);
  m.impl("layer_norm_bwd_add", &layer_norm_bwd_add_op);
}

}  // namespace revkernels
