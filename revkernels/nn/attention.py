r"""Scaled dot-product attention for the library's attention modules (`AttentionBranch` of
`revkernels.nn.revvit`, Rev-Swin's `WindowAttention`)::

    attention(q, k, v) = softmax(q k^T / sqrt(head_dim) + mask) v      (causal: future keys masked)

`scaled_dot_product_attention` is ``F.scaled_dot_product_attention`` with one choice of kernel
made for compiled CPU graphs: inside ``torch.compile`` on CPU, with at most `MATH_MAX_KEYS` keys,
it asks for SDPA's math formula (``SDPBackend.MATH``). Inductor then compiles the scale, the mask,
the softmax and its backward into its own loops beside two batched GEMMs, fused with the heads'
permutes around them; the flash kernel it would pick otherwise (and its backward) is an opaque
call with a cost per call that short sequences do not amortise. Beyond the limit the math
formula's lead shrinks while its scores (batch x heads x queries x keys) grow with the square of
the length, and each call's scores may land on fresh pages (glibc returns large blocks to the
system unless told otherwise), so longer sequences keep the flash kernel and its memory linear in
the length. ``python benchmarks/bench_attention.py`` measures both ways of a compiled forward +
backward across sequence lengths (``benchmarks/results/attention_cpu.csv``). Eager code, and
every other device, call ``F.scaled_dot_product_attention`` unchanged. Both ways compute the same
function; they differ by fp32 rounding (~1e-7 relative). bf16/fp16 q, k, v (under autocast) go
through the formula in fp32, as the flash kernel computes scores and softmax, and the output is
cast back.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

MATH_MAX_KEYS = 200


def uses_math(q, k):
    """Whether `scaled_dot_product_attention` asks for the math formula for these q, k."""
    return torch.compiler.is_compiling() and q.device.type == "cpu" and k.shape[-2] <= MATH_MAX_KEYS


def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)``; in a
    compiled CPU graph with at most `MATH_MAX_KEYS` keys, through SDPA's math backend (module doc)."""
    if uses_math(q, k):
        if q.dtype in (torch.bfloat16, torch.float16):
            # The formula in fp32, as the flash kernel computes its scores and softmax (in bf16/fp16
            # the causal mask's softmax lost precision: grads 3x the eager error)
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.float()
            with torch.autocast("cpu", enabled=False), sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask,
                                                      is_causal=is_causal).to(q.dtype)
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
