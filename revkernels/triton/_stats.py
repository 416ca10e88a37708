"""Pieces shared by the Triton normalisation kernels."""
import triton
import triton.language as tl


@triton.jit
def stats_pivot(first):
    """The value the statistics are shifted by: a row's or channel's first value, or 0 where that is
    not finite (x - inf would make every shifted value NaN, and the mean NaN where torch's is inf)."""
    return tl.where(first - first == 0, first, 0.0)
