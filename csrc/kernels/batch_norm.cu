// CUDA BatchNorm (+ ReLU) apply kernel (see batch_norm_cuda.h). Torch-free, so it compile-checks
// with a bare nvcc. One thread per element in memory order (grid-stride loop): x and out share
// their layout, so element e of one is element e of the other; the channel follows from e.
#include <algorithm>

#include "batch_norm_cuda.h"

namespace revkernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535 * 16;

template <typename acc_t, typename x_t, bool kChannelsLast, bool kRelu>
__global__ void batch_norm_act_apply_kernel(x_t* __restrict__ out, const x_t* __restrict__ x,
                                            const acc_t* __restrict__ mean, const acc_t* __restrict__ rstd,
                                            const acc_t* __restrict__ weight, const acc_t* __restrict__ bias,
                                            int64_t total, int64_t c, int64_t s) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t ch = kChannelsLast ? e % c : (e / s) % c;
    acc_t y = (load<acc_t>(x + e) - mean[ch]) * rstd[ch] * weight[ch] + bias[ch];
    if (kRelu && y <= acc_t(0)) y = acc_t(0);  // a NaN stays NaN, as in torch.relu
    store<acc_t>(out + e, y);
  }
}

template <typename acc_t, typename x_t, bool kChannelsLast, bool kRelu>
cudaError_t launch(void* out, const void* x, const void* mean, const void* rstd, const void* weight, const void* bias,
                   int64_t total, int64_t c, int64_t s, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, kMaxBlocks);
  batch_norm_act_apply_kernel<acc_t, x_t, kChannelsLast, kRelu><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<x_t*>(out), static_cast<const x_t*>(x), static_cast<const acc_t*>(mean),
      static_cast<const acc_t*>(rstd), static_cast<const acc_t*>(weight), static_cast<const acc_t*>(bias), total, c, s);
  return cudaGetLastError();
}

}  // namespace

cudaError_t batch_norm_act_apply_cuda(ScalarKind x_kind, void* out, const void* x, const void* mean, const void* rstd,
                                      const void* weight, const void* bias, int64_t total, int64_t c, int64_t s,
                                      bool channels_last, bool relu, cudaStream_t stream) {
  if (total == 0) return cudaSuccess;
  return dispatch_float_type(x_kind, [&](auto x_tag) {
    using x_t = typename decltype(x_tag)::type;
    using acc_t = typename std::conditional<std::is_same<x_t, double>::value, double, float>::type;
    if (channels_last) {
      return relu ? launch<acc_t, x_t, true, true>(out, x, mean, rstd, weight, bias, total, c, s, stream)
                  : launch<acc_t, x_t, true, false>(out, x, mean, rstd, weight, bias, total, c, s, stream);
    }
    return relu ? launch<acc_t, x_t, false, true>(out, x, mean, rstd, weight, bias, total, c, s, stream)
                : launch<acc_t, x_t, false, false>(out, x, mean, rstd, weight, bias, total, c, s, stream);
  });
}

}  // namespace revkernels
