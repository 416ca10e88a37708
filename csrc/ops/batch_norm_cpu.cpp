// CPU implementations of revkernels::batch_norm_act / batch_norm_act_bwd: the kernels of
// cpu/vec_kernels.h (semantics: kernels/batch_norm.h), channels split across threads with
// at::parallel_for.
//
// Layouts: a data tensor (N, C, *spatial) is used as it is when NCHW-contiguous or channels_last
// (4-d) / channels_last_3d (5-d), and copied with .contiguous() otherwise; outputs are allocated
// with empty_like of that tensor (same layout). weight, bias, mean and rstd are converted to the
// accumulation type (C elements).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "../cpu/vec_kernels.h"
#include "../kernels/batch_norm.h"
#include "coupling_layout.h"  // scalar_kind, element_aligned

namespace revkernels {

// Shared with batch_norm_cuda.cpp (declared there).
bool batch_norm_is_channels_last(const at::Tensor& t);
at::Tensor batch_norm_laid_out(const at::Tensor& t);
void check_batch_norm_act_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps);

namespace {

constexpr int64_t kGrainSize = 32768;  // elements per parallel_for task, at least

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "revkernels: ", name, " must be on the device of ", ref_name, " (",
                    ref.device(), "), got ", t.device());
}

int64_t channels_of(const at::Tensor& x, const char* name) {
  TORCH_CHECK_VALUE(x.dim() >= 2, "revkernels: ", name, " must have shape (N, C, *spatial), got ", x.dim(), " dims");
  TORCH_CHECK_VALUE(x.size(1) > 0, "revkernels: ", name, " must have at least one channel (dim 1)");
  return x.size(1);
}

void check_channel_vector(const at::Tensor& p, const char* name, int64_t c, const char* data_name) {
  scalar_kind(p, name);
  TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == c, "revkernels: ", name, " must have shape (", c,
                    ",), the channels of ", data_name, ", got ", p.sizes());
}

bool is_channels_last(const at::Tensor& t) { return batch_norm_is_channels_last(t); }
at::Tensor laid_out(const at::Tensor& t) { return batch_norm_laid_out(t); }

// The (N, C, S) view of a tensor laid out by laid_out (or allocated like one).
BnView view_of(const at::Tensor& t) {
  BnView v;
  v.n = t.size(0);
  const int64_t c = t.size(1);
  v.s = t.numel() / std::max<int64_t>(1, v.n * c);
  if (t.dim() > 2 && t.numel() > 0 && !t.is_contiguous() && is_channels_last(t)) {
    v.n_stride = c * v.s, v.c_stride = 1, v.s_stride = c;
  } else {
    v.n_stride = c * v.s, v.c_stride = v.s, v.s_stride = 1;
  }
  return v;
}

void check_eps(double eps) {
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, "revkernels: eps must be finite and non-negative, got ", eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_act_op(const at::Tensor& x, const at::Tensor& weight,
                                                                 const at::Tensor& bias, double eps, bool relu) {
  check_batch_norm_act_args(x, weight, bias, eps);
  const ScalarKind x_kind = scalar_kind(x, "x");
  const int64_t c = x.size(1);
  TORCH_CHECK_VALUE(x.device().is_cpu(), "revkernels: x must be a CPU tensor here");

  const auto acc_dtype = x_kind == ScalarKind::Float64 ? at::kDouble : at::kFloat;
  const at::Tensor xl = element_aligned(laid_out(x));
  at::Tensor out = at::empty_like(xl);
  at::Tensor mean = at::empty({c}, x.options().dtype(acc_dtype));
  at::Tensor rstd = at::empty({c}, x.options().dtype(acc_dtype));
  const BnView xv = view_of(xl), ov = view_of(out);
  const at::Tensor w = acc_vector(weight, acc_dtype), b = acc_vector(bias, acc_dtype);
  const int64_t per_channel = std::max<int64_t>(1, xv.n * xv.s);
  const CpuKernels& kernels = cpu_kernels();
  at::parallel_for(0, c, std::max<int64_t>(1, kGrainSize / per_channel), [&](int64_t begin, int64_t end) {
    kernels.batch_norm_act(out.data_ptr(), mean.data_ptr(), rstd.data_ptr(), xl.const_data_ptr(), x_kind, xv, ov,
                           w.const_data_ptr(), b.const_data_ptr(), eps, relu, begin, end);
  });
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> batch_norm_act_bwd_op(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, bool relu) {
  const ScalarKind x_kind = scalar_kind(x, "x");
  scalar_kind(dout, "dout");
  TORCH_CHECK_TYPE(dout.scalar_type() == x.scalar_type(), "revkernels: dout must have the dtype of x (",
                   x.scalar_type(), "), got ", dout.scalar_type());
  const int64_t c = channels_of(x, "x");
  TORCH_CHECK_VALUE(dout.sizes() == x.sizes(), "revkernels: dout must have the shape of x ", x.sizes(), ", got ",
                    dout.sizes());
  check_channel_vector(weight, "weight", c, "x");
  check_channel_vector(bias, "bias", c, "x");
  check_channel_vector(mean, "mean", c, "x");
  check_channel_vector(rstd, "rstd", c, "x");
  check_same_device(dout, "dout", x, "x");
  check_same_device(weight, "weight", x, "x");
  check_same_device(bias, "bias", x, "x");
  check_same_device(mean, "mean", x, "x");
  check_same_device(rstd, "rstd", x, "x");
  TORCH_CHECK_VALUE(x.device().is_cpu(), "revkernels: x must be a CPU tensor here");

  const auto acc_dtype = x_kind == ScalarKind::Float64 ? at::kDouble : at::kFloat;
  const at::Tensor xl = element_aligned(laid_out(x)), dl = element_aligned(laid_out(dout));
  at::Tensor dx = at::empty_like(xl);
  const at::Tensor dweight_acc = at::empty({c}, x.options().dtype(acc_dtype));
  const at::Tensor dbias_acc = at::empty({c}, x.options().dtype(acc_dtype));
  const BnView xv = view_of(xl), dv = view_of(dl), dxv = view_of(dx);
  const at::Tensor w = acc_vector(weight, acc_dtype), b = acc_vector(bias, acc_dtype);
  const at::Tensor mu = acc_vector(mean, acc_dtype), rs = acc_vector(rstd, acc_dtype);
  const int64_t per_channel = std::max<int64_t>(1, xv.n * xv.s);
  const CpuKernels& kernels = cpu_kernels();
  at::parallel_for(0, c, std::max<int64_t>(1, kGrainSize / per_channel), [&](int64_t begin, int64_t end) {
    kernels.batch_norm_act_bwd(dx.data_ptr(), dweight_acc.data_ptr(), dbias_acc.data_ptr(), dl.const_data_ptr(), dv,
                               xl.const_data_ptr(), x_kind, xv, dxv, w.const_data_ptr(), b.const_data_ptr(),
                               mu.const_data_ptr(), rs.const_data_ptr(), relu, begin, end);
  });
  return {dx, dweight_acc.to(weight.scalar_type()), dbias_acc.to(bias.scalar_type())};
}

}  // namespace

bool batch_norm_is_channels_last(const at::Tensor& t) {
  return (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
         (t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d));
}

// t as the kernels read it: itself when NCHW-contiguous or channels_last, else a contiguous copy.
at::Tensor batch_norm_laid_out(const at::Tensor& t) {
  if (t.is_contiguous() || batch_norm_is_channels_last(t)) return t;
  return t.contiguous();
}

// The argument checks of batch_norm_act (any device).
void check_batch_norm_act_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  scalar_kind(x, "x");
  const int64_t c = channels_of(x, "x");
  check_channel_vector(weight, "weight", c, "x");
  check_channel_vector(bias, "bias", c, "x");
  check_eps(eps);
  check_same_device(weight, "weight", x, "x");
  check_same_device(bias, "bias", x, "x");
}

TORCH_LIBRARY_IMPL(revkernels, CPU, m) {
  m.impl("batch_norm_act", &batch_norm_act_op);
  m.impl("batch_norm_act_bwd", &batch_norm_act_bwd_op);
}

}  // namespace revkernels
