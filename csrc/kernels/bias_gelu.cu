// CUDA bias + GELU kernels (see bias_gelu.h). Torch-free, so it compile-checks with a bare nvcc.
// Blocks are 2-D: threadIdx.x walks columns (coalesced loads, one bias value per thread), threadIdx.y
// and blockIdx.y stride over rows. The backward keeps each thread's column sum of dx in a register,
// reduces the block's rows through shared memory into one partial row per blockIdx.y, and a second
// kernel sums those partial rows in order.
#include <algorithm>

#include "bias_gelu_cuda.h"

namespace revkernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kRowsPerThread = 4;     // rows a thread handles before another block row is worth it
constexpr int64_t kMaxRowBlocksFwd = 65535;
constexpr int64_t kMaxRowBlocksBwd = 256;  // bounds the partial sums: kMaxRowBlocksBwd * n

struct LaunchShape {
  dim3 block;
  dim3 grid;
};

// Pure function of (rows, n): the backward's summation order is reproducible.
LaunchShape launch_shape(int64_t rows, int64_t n, int64_t max_row_blocks) {
  const int threads_x = n >= 128 ? 128 : (n >= 64 ? 64 : 32);
  const int threads_y = kThreads / threads_x;
  const int64_t grid_x = (n + threads_x - 1) / threads_x;
  const int64_t rows_per_block = threads_y * kRowsPerThread;
  const int64_t grid_y = std::min<int64_t>((rows + rows_per_block - 1) / rows_per_block, max_row_blocks);
  return {dim3(threads_x, threads_y), dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y))};
}

template <typename acc_t, typename x_t, typename bias_t, GeluApprox kApprox>
__global__ void bias_gelu_kernel(x_t* __restrict__ out, const x_t* __restrict__ x, int64_t x_row_stride,
                                 const bias_t* __restrict__ bias, int64_t rows, int64_t n) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= n) return;
  const acc_t b = load<acc_t>(bias + col);
  const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += step) {
    store<acc_t>(out + r * n + col, gelu_value<acc_t>(load<acc_t>(x + r * x_row_stride + col) + b, kApprox));
  }
}

template <typename acc_t, typename x_t, typename bias_t, GeluApprox kApprox>
__global__ void bias_gelu_bwd_kernel(x_t* __restrict__ dx, acc_t* __restrict__ partials, const x_t* __restrict__ dy,
                                     int64_t dy_row_stride, const x_t* __restrict__ x, int64_t x_row_stride,
                                     const bias_t* __restrict__ bias, int64_t rows, int64_t n) {
  __shared__ acc_t sums[kThreads];  // blockDim.x * blockDim.y == kThreads
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  acc_t sum = 0;
  if (col < n) {
    const acc_t b = load<acc_t>(bias + col);
    const int64_t step = static_cast<int64_t>(gridDim.y) * blockDim.y;
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += step) {
      const acc_t z = load<acc_t>(x + r * x_row_stride + col) + b;
      const acc_t g = load<acc_t>(dy + r * dy_row_stride + col) * gelu_derivative<acc_t>(z, kApprox);
      store<acc_t>(dx + r * n + col, g);
      sum += g;
    }
  }
  sums[threadIdx.y * blockDim.x + threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    acc_t total = 0;
    for (unsigned y = 0; y < blockDim.y; ++y) total += sums[y * blockDim.x + threadIdx.x];
    partials[static_cast<int64_t>(blockIdx.y) * n + col] = total;
  }
}

template <typename acc_t, typename bias_t>
__global__ void reduce_partials_kernel(bias_t* __restrict__ dbias, const acc_t* __restrict__ partials,
                                       int64_t chunks, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += step) {
    acc_t sum = 0;
    for (int64_t c = 0; c < chunks; ++c) sum += partials[c * n + j];
    store<acc_t>(dbias + j, sum);
  }
}

template <typename acc_t, typename x_t, typename bias_t, GeluApprox kApprox>
cudaError_t launch_forward(void* out, const void* x, int64_t x_row_stride, const void* bias, int64_t rows, int64_t n,
                           cudaStream_t stream) {
  const LaunchShape shape = launch_shape(rows, n, kMaxRowBlocksFwd);
  bias_gelu_kernel<acc_t, x_t, bias_t, kApprox><<<shape.grid, shape.block, 0, stream>>>(
      static_cast<x_t*>(out), static_cast<const x_t*>(x), x_row_stride, static_cast<const bias_t*>(bias), rows, n);
  return cudaGetLastError();
}

template <typename acc_t, typename x_t, typename bias_t, GeluApprox kApprox>
cudaError_t launch_backward(void* dx, void* dbias, const void* dy, int64_t dy_row_stride, const void* x,
                            int64_t x_row_stride, const void* bias, int64_t rows, int64_t n, void* workspace,
                            cudaStream_t stream) {
  auto* partials = static_cast<acc_t*>(workspace);
  const LaunchShape shape = launch_shape(rows, n, kMaxRowBlocksBwd);
  const int64_t chunks = shape.grid.y;
  if (chunks > 0) {
    bias_gelu_bwd_kernel<acc_t, x_t, bias_t, kApprox><<<shape.grid, shape.block, 0, stream>>>(
        static_cast<x_t*>(dx), partials, static_cast<const x_t*>(dy), dy_row_stride, static_cast<const x_t*>(x),
        x_row_stride, static_cast<const bias_t*>(bias), rows, n);
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65535);
  reduce_partials_kernel<acc_t><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<bias_t*>(dbias), partials, chunks, n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t bias_gelu_cuda(ScalarKind x_kind, ScalarKind bias_kind, GeluApprox approx, void* out, const void* x,
                           int64_t x_row_stride, const void* bias, int64_t rows, int64_t n, cudaStream_t stream) {
  if (rows == 0 || n == 0) return cudaSuccess;
  return dispatch_float_pair(x_kind, bias_kind, [&](auto acc_tag, auto x_tag, auto bias_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    using x_t = typename decltype(x_tag)::type;
    using bias_t = typename decltype(bias_tag)::type;
    if (approx == GeluApprox::Tanh) {
      return launch_forward<acc_t, x_t, bias_t, GeluApprox::Tanh>(out, x, x_row_stride, bias, rows, n, stream);
    }
    return launch_forward<acc_t, x_t, bias_t, GeluApprox::None>(out, x, x_row_stride, bias, rows, n, stream);
  });
}

int64_t bias_gelu_bwd_cuda_workspace_bytes(ScalarKind x_kind, ScalarKind bias_kind, int64_t rows, int64_t n) {
  if (rows == 0 || n == 0) return 0;
  const bool acc_double = x_kind == ScalarKind::Float64 || bias_kind == ScalarKind::Float64;
  const int64_t acc_bytes = acc_double ? sizeof(double) : sizeof(float);
  return static_cast<int64_t>(launch_shape(rows, n, kMaxRowBlocksBwd).grid.y) * n * acc_bytes;
}

cudaError_t bias_gelu_bwd_cuda(ScalarKind x_kind, ScalarKind bias_kind, GeluApprox approx, void* dx, void* dbias,
                               const void* dy, int64_t dy_row_stride, const void* x, int64_t x_row_stride,
                               const void* bias, int64_t rows, int64_t n, void* workspace, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_float_pair(x_kind, bias_kind, [&](auto acc_tag, auto x_tag, auto bias_tag) {
    using acc_t = typename decltype(acc_tag)::type;
    using x_t = typename decltype(x_tag)::type;
    using bias_t = typename decltype(bias_tag)::type;
    if (approx == GeluApprox::Tanh) {
      return launch_backward<acc_t, x_t, bias_t, GeluApprox::Tanh>(dx, dbias, dy, dy_row_stride, x, x_row_stride,
                                                                   bias, rows, n, workspace, stream);
    }
    return launch_backward<acc_t, x_t, bias_t, GeluApprox::None>(dx, dbias, dy, dy_row_stride, x, x_row_stride, bias,
                                                                 rows, n, workspace, stream);
  });
}

}  // namespace revkernels
