// Torch-free coupling kernels: out = a + alpha * b, elementwise, one pass.
//   rebuild       x  = y  - F(x2)   (alpha = -1)
//   gradient add  dx = dy + vjp     (alpha = +1)
// `out` is dense in the iteration order; `a` and `b` are strided views of the same shape (any
// strides, including 0 for broadcast dims). `a` and `out` share one dtype; `b` may have another,
// and the sum is formed in the accumulation type (float, or double when either input is double)
// and rounded once to out's dtype (a double sum stored to fp16/bf16 goes through float, as torch's
// conversion does).
#pragma once

#include <cstdint>

#include "scalar.h"

namespace revkernels {

constexpr int kMaxDims = 12;

// Iteration space of a coupling op, dims ordered outermost first. `out` is contiguous in it.
struct CouplingLayout {
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t a_strides[kMaxDims] = {};
  int64_t b_strides[kMaxDims] = {};
};

// The offsets in a and b of the element `linear` of the iteration space (row-major over `layout`).
RK_HOST_DEVICE inline void layout_offsets(const CouplingLayout& layout, int64_t linear, int64_t& a_off, int64_t& b_off) {
  a_off = b_off = 0;
  for (int d = layout.ndim - 1; d >= 0; --d) {
    const int64_t index = linear % layout.sizes[d];
    linear /= layout.sizes[d];
    a_off += index * layout.a_strides[d];
    b_off += index * layout.b_strides[d];
  }
}

// fn(linear, a_off, b_off, run) for each run of consecutive elements of [begin, end) along the
// innermost dim of `layout`: out index `linear` + i reads a[a_off + i * a_inner], b[b_off + i * b_inner].
template <typename Fn>
void for_each_layout_run(const CouplingLayout& layout, int64_t begin, int64_t end, Fn&& fn) {
  const int64_t inner = layout.ndim > 0 ? layout.sizes[layout.ndim - 1] : 1;
  for (int64_t linear = begin; linear < end;) {
    int64_t a_off, b_off;
    layout_offsets(layout, linear, a_off, b_off);
    const int64_t run = (inner - linear % inner) < (end - linear) ? (inner - linear % inner) : (end - linear);
    fn(linear, a_off, b_off, run);
    linear += run;
  }
}

// Elements [begin, end) of the iteration space (a linear index into `out`).
template <typename acc_t, typename out_t, typename b_t>
void coupling_axpy_cpu(out_t* out, const out_t* a, const b_t* b, acc_t alpha,
                       const CouplingLayout& layout, int64_t begin, int64_t end) {
  if (begin >= end) return;
  const int nd = layout.ndim;
  if (nd == 0) {  // one element
    store<acc_t>(out, load<acc_t>(a) + alpha * load<acc_t>(b));
    return;
  }
  // Multi-index of `begin`, then walk the innermost dim in a tight loop.
  int64_t index[kMaxDims];
  int64_t rest = begin;
  for (int d = nd - 1; d >= 0; --d) {
    index[d] = rest % layout.sizes[d];
    rest /= layout.sizes[d];
  }
  int64_t a_off = 0, b_off = 0;
  for (int d = 0; d < nd; ++d) {
    a_off += index[d] * layout.a_strides[d];
    b_off += index[d] * layout.b_strides[d];
  }
  const int64_t inner = layout.sizes[nd - 1];
  const int64_t a_inner = layout.a_strides[nd - 1];
  const int64_t b_inner = layout.b_strides[nd - 1];
  int64_t linear = begin;
  while (linear < end) {
    const int64_t run = (inner - index[nd - 1]) < (end - linear) ? (inner - index[nd - 1]) : (end - linear);
    out_t* o = out + linear;
    const out_t* pa = a + a_off;
    const b_t* pb = b + b_off;
    if (a_inner == 1 && b_inner == 1) {  // unit stride: vectorisable
      for (int64_t i = 0; i < run; ++i) store<acc_t>(o + i, load<acc_t>(pa + i) + alpha * load<acc_t>(pb + i));
    } else {
      for (int64_t i = 0; i < run; ++i) {
        store<acc_t>(o + i, load<acc_t>(pa + i * a_inner) + alpha * load<acc_t>(pb + i * b_inner));
      }
    }
    linear += run;
    // Advance the multi-index by `run` elements: the inner dim wraps, carry into the outer ones.
    a_off += run * a_inner;
    b_off += run * b_inner;
    index[nd - 1] += run;
    for (int d = nd - 1; d > 0 && index[d] == layout.sizes[d]; --d) {
      a_off += layout.a_strides[d - 1] - layout.sizes[d] * layout.a_strides[d];
      b_off += layout.b_strides[d - 1] - layout.sizes[d] * layout.b_strides[d];
      index[d] = 0;
      ++index[d - 1];
    }
  }
}

}  // namespace revkernels
