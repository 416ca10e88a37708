// The vectorised CPU kernels (at::vec::Vectorized), one table of entry points per instruction set.
// vec_kernels_impl.h holds the kernels; vec_kernels_{default,avx2,avx512}.cpp compile it once per
// ISA into the namespaces revkernels::DEFAULT / AVX2 / AVX512, as ATen compiles its own kernels;
// cpu_kernels() picks one at run time (dispatch.cpp). Each entry covers one range (elements, rows
// or channels) of the op, with the semantics of the torch-free kernel of the same name in
// csrc/kernels/*.h; the op glue splits ranges across threads. Data pointers have the dtype
// `*_kind`; weight, bias, mean, rstd and the partial sums are in the accumulation type (double
// when a data dtype is double, float otherwise). Mixed dtype pairs involving double run the
// torch-free scalar kernel (no vector path for converting to double).
//
// `stream_out` (coupling_axpy, sub_layer_norm): write the outputs with non-temporal stores, which
// bypass the caches and skip reading each output line before it is overwritten, for calls whose
// data the last-level cache cannot hold anyway (stream_outputs). The values are the same either
// way; the DEFAULT build ignores it.
#pragma once

#include <cstdint>
#include <vector>

#include "../kernels/batch_norm.h"
#include "../kernels/bias_gelu.h"
#include "../kernels/coupling.h"
#include "../kernels/fixed_point.h"

namespace revkernels {

enum class CpuIsa : int { Default = 0, Avx2 = 1, Avx512 = 2, Avx512Bf16 = 3 };

struct CpuKernels {
  CpuIsa isa;
  const char* name;
  // coupling_axpy_cpu: out = a + alpha * b over elements [begin, end).
  void (*coupling_axpy)(void* out, const void* a, ScalarKind out_kind, const void* b, ScalarKind b_kind,
                        double alpha, const CouplingLayout& layout, int64_t begin, int64_t end, bool stream_out);
  // sub_layer_norm_cpu over rows [row_begin, row_end).
  void (*sub_layer_norm)(void* x, void* ln, void* mean, void* rstd, ScalarKind x_kind, const void* y,
                         int64_t y_row_stride, const void* g, ScalarKind g_kind, int64_t g_row_stride,
                         const void* weight, const void* bias, double eps, int64_t n, int64_t row_begin,
                         int64_t row_end, bool stream_out);
  // layer_norm_bwd_add_cpu over rows [row_begin, row_end) (partials overwritten).
  void (*layer_norm_bwd_add)(void* dx, ScalarKind dres_kind, void* dweight_partial, void* dbias_partial,
                             const void* dln, int64_t dln_row_stride, const void* x, ScalarKind x_kind,
                             int64_t x_row_stride, const void* weight, const void* mean, const void* rstd,
                             const void* dres, int64_t dres_row_stride, int64_t n, int64_t row_begin,
                             int64_t row_end);
  // bias_gelu_cpu over rows [row_begin, row_end).
  void (*bias_gelu)(void* out, const void* x, ScalarKind x_kind, int64_t x_row_stride, const void* bias,
                    ScalarKind bias_kind, int64_t n, GeluApprox approx, int64_t row_begin, int64_t row_end);
  // bias_gelu_bwd_cpu over rows [row_begin, row_end) (adds into dbias_partial).
  void (*bias_gelu_bwd)(void* dx, const void* dy, int64_t dy_row_stride, const void* x, ScalarKind x_kind,
                        int64_t x_row_stride, const void* bias, ScalarKind bias_kind, int64_t n, GeluApprox approx,
                        int64_t row_begin, int64_t row_end, void* dbias_partial);
  // batch_norm_act_cpu over channels [c_begin, c_end).
  void (*batch_norm_act)(void* out, void* mean, void* rstd, const void* x, ScalarKind x_kind, const BnView& xv,
                         const BnView& ov, const void* weight, const void* bias, double eps, bool relu,
                         int64_t c_begin, int64_t c_end);
  // batch_norm_act_bwd_cpu over channels [c_begin, c_end).
  void (*batch_norm_act_bwd)(void* dx, void* dweight, void* dbias, const void* dout, const BnView& dv,
                             const void* x, ScalarKind x_kind, const BnView& xv, const BnView& dxv,
                             const void* weight, const void* bias, const void* mean, const void* rstd, bool relu,
                             int64_t c_begin, int64_t c_end);
  // fixed_point_cpu: `op` over elements [begin, end); returns whether one of them overflowed. `out`
  // and `f` are null for View, `x` for FromFloat (whose view is in f's dtype: view_kind == f_kind).
  bool (*fixed_point)(FixedPointOp op, int64_t* out, void* view, ScalarKind view_kind, const int64_t* x,
                      const void* f, ScalarKind f_kind, int bits, const CouplingLayout& layout, int64_t begin,
                      int64_t end);
};

// The kernels for this CPU: the widest compiled ISA that ATen would use (at::get_cpu_capability(),
// which honours the ATEN_CPU_CAPABILITY environment variable). Chosen once. (The AVX512 table runs
// some all-fp32 calls with the AVX2 code: vec_kernels.cpp says which and why.)
const CpuKernels& cpu_kernels();

// The kernels compiled for `isa`, or nullptr when they were not compiled or this CPU lacks the ISA
// (for tests that run every variant).
const CpuKernels* cpu_kernels_for(CpuIsa isa);

// Every kernel table compiled into the library, narrowest first, whether or not this CPU runs it.
std::vector<const CpuKernels*> compiled_cpu_kernels();

// The size of this CPU's last-level cache in bytes (Linux sysfs: the largest data or unified cache
// of CPU 0; sysconf's figure can be a whole package's), or 0 where unknown.
int64_t last_level_cache_bytes();

// The size above which a call streams its outputs: REVKERNELS_STREAM_ABOVE_BYTES where set (read
// once per process; 0: never), else the last-level cache. A bad value raises ValueError at the
// first call that asks.
int64_t stream_above_bytes();

// Whether a call that reads and writes `bytes` in all should write its outputs with streaming
// stores: when they exceed stream_above_bytes() (by default the last-level cache, so its outputs
// would not stay cached for the next op anyway). Never where that size is 0 (cache unknown).
bool stream_outputs(int64_t bytes);

}  // namespace revkernels
