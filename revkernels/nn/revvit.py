r"""`RevTransformerBlock` (and `RevViTBlock`, its non-causal case): a reversible transformer block
whose rebuild and gradient steps run on fused ops.

    F(x) = drop_path(dropout(proj(attention(LN1(x)))))    G(x) = drop_path(dropout(fc2(gelu(fc1(LN2(x))))))
    y1 = x1 + F(x2)                                       y2 = x2 + G(y1)

The attention is causal or not (``causal``) and takes an ``attn_mask`` context keyword
(``seq(x1, x2, attn_mask=m)``): a bool or additive key padding mask (batch, tokens), or a 4-D
mask scaled_dot_product_attention accepts. `attention_mask` turns it (with the causal mask when
both are asked for) into one additive mask in q's dtype, which the forward and the rebuild both
hand to the same attention kernel. Dropout is residual dropout (on each branch's output, through
``torch.native_dropout``, whose keep mask the rebuild replays and keeps); the attention
probabilities are not dropped.

The forward is the module composition's ops called on the parameters directly (bitwise the same;
through the modules themselves when a forward hook is registered on any of them). The engines' two
steps are written out by hand with fused ops and no autograd graph (on CUDA, one graph node for
the attention kernel), one pass over the activations per step where eager PyTorch spends several:

recompute(y1, y2), G first::

    ln2, mean2, rstd2 = layer_norm(y1)                              (ATen native_layer_norm)
    pre = fc1(ln2);  h = gelu(pre);  g = drop_path(fc2(h))          (MlpBranch's ops; pre, h kept)
    x2, ln1, mean1, rstd1 = sub_layer_norm(y2, g, w_ln1, b_ln1)     (rebuild + LN1: one pass)
    q, k, v = heads(qkv(ln1));  a = attention(q, k, v, mask)        (CPU: the flash kernel's lse kept)
    o = merge_heads(a);  x1 = coupling_sub(y1, drop_path(proj(o)))  (cuBLAS linear, bias in its
                                                                     epilogue, + the fused subtract;
                                                                     dropout before drop-path in F
                                                                     and G)

The rebuild subtracts exactly what the forward added: g and drop_path(proj(o)) are computed with the
forward's own ops (F.linear with the bias in the GEMM, F.gelu, the same drop-path multiply), so the
same kernels in the same dtypes give bitwise the same values, and under autocast the rebuilt x1, x2
carry only the fp32 rounding of the residual streams (~1e-7 relative), not a 16-bit rounding of a
differently computed branch output. (The fused ``bias_gelu`` after a bias-free GEMM rounds the GEMM
output to bf16/fp16 before adding the bias, and ``linear_sub``, an addmm with y1 as the accumulator,
forms the projection in fp32 where the forward rounded it to the autocast dtype: both rebuilt the
inputs with 16-bit-level errors under autocast.) ln2 is bitwise nn.LayerNorm's (the same ATen op;
CUDA autocast runs both layer_norm and native_layer_norm in fp32). ln1 comes from the fused
sub_layer_norm, which agrees with nn.LayerNorm to fp32 rounding but not bitwise; under autocast the
rare ln1 element whose 16-bit cast then differs perturbs the attention, so x1's rebuild error at
ViT sizes is ~1e-5 relative (CPU, bf16, 197 tokens x 256-768), against ~1e-3 for a bf16-rounded
rebuild. The composition for x1 (F.linear, then coupling_sub) also measured faster on an H200 than
the single addmm(alpha=-1, beta=1) of ``linear_sub``, at 25216 x 1024 and 32768 x 4096 in bf16.

grads(dy1, dy2), in the forward's dtypes (parameter grads cast back to the parameters' dtypes)::

    dg = dropout'(s_g * dy2);  dW2 = dg^T h;  db2 = sum_rows(dg)
    dpre, db1 = gelu'(pre) * (dg @ W2), sum_rows(dpre)                      (bias_gelu_bwd: one pass)
    dW1 = dpre^T ln2;  dln2 = dpre @ W1
    dy1', dw_ln2, db_ln2 = layer_norm_bwd_add(dln2, y1, ..., dres=dy1)     dy1' = dy1 + dG^T dy2
    dP = dropout'(s_f * dy1');  dWp = dP^T o;  dbp = sum_rows(dP);  da = heads(dP @ Wp)
    dq, dk, dv = attention_backward(da)                                    (CPU: flash backward)
    dqkv = merge(dq, dk, dv);  dWqkv = dqkv^T ln1;  dbqkv = sum_rows(dqkv);  dln1 = dqkv @ Wqkv
    dx2, dw_ln1, db_ln1 = layer_norm_bwd_add(dln1, x2, ..., dres=dy2)      dx2 = dy2 + dF^T dy1'
    dx1 = dy1'

The branch modules' forward hooks do not fire in these steps (they are computed from the
parameters directly). A block whose branches hold other layers than these steps read by name (a
LoRA-style wrapper, a linear without bias where a bias is read, a parametrized linear, a LayerNorm
without affine, another norm; `_holds_fused_layers`) runs the generic `ReversibleBlock` steps on
its modules.
"""
import numbers

import torch
import torch.nn.functional as F
from torch import nn

from revkernels.engine.state import NO_CONTEXT, RngState, cuda_devices_of, maybe_replay
from revkernels.engine.structure import cached, param_slots, submodule_hooked
from revkernels.nn.attention import scaled_dot_product_attention
from revkernels.nn.drop_path import DropPath, check_drop_probability
from revkernels.nn.reversible import BlockGrads, BlockState, ReversibleBlock, takes_missing_dy2
from revkernels.ops.bias_gelu import bias_gelu_bwd
from revkernels.ops.coupling import coupling_sub
from revkernels.ops.layer_norm import layer_norm_bwd_add, sub_layer_norm


class ResidualDropout(nn.Dropout):
    """Dropout through ``torch.native_dropout``, which returns its keep mask: the fused rebuild
    replays the draw and keeps the mask for the gradient step (same op in every path)."""

    draws_with_symbolic_sizes = True  # (the compiled engine's branch steps may then take any shape)

    def draws_random(self):
        return self.training and self.p > 0.0

    def scale(self):
        """What a kept element is multiplied by (native_dropout's 1 / (1 - p); 0 when p is 1)."""
        return 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)

    def sample(self, x):
        """(dropout(x), keep mask), or (x, None) when inactive."""
        if not self.draws_random():
            return x, None
        return torch.native_dropout(x, self.p, True)

    def forward(self, x):
        return self.sample(x)[0]


def _check_tokens(x, dim=None):
    """ValueError unless `x` is (batch, tokens, dim), with width `dim` when given: a stream of a
    RevTransformerBlock."""
    if x.dim() != 3 or (dim is not None and x.shape[-1] != dim):
        raise ValueError(f"revkernels: RevTransformerBlock streams must be (batch, tokens, dim"
                         f"{'' if dim is None else f'={dim}'}), got shape {tuple(x.shape)}")


def attention_mask(attn_mask, q, causal):
    """``(mask, is_causal)`` for scaled_dot_product_attention on q (batch, heads, tokens, head_dim)
    from the `attn_mask` keyword: None, a key padding mask (batch, tokens) (bool: True attends;
    float: added to that key's scores) or a 4-D bool/additive mask. A mask becomes additive in
    q's dtype, with the causal mask added when `causal` (SDPA takes one or the other)."""
    if attn_mask is None:
        return None, causal
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"revkernels: attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.requires_grad:
        raise ValueError("revkernels: attn_mask must not require grad (the attention does not differentiate its mask)")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        # (an integer 0/1 mask, such as a tokenizer's attention_mask, would be added to the scores)
        raise TypeError(f"revkernels: attn_mask must be bool (True attends) or floating point (added to the "
                        f"scores), got {attn_mask.dtype}: pass attention_mask.bool() for a 0/1 mask")
    batch, heads, tokens, _ = q.shape
    if attn_mask.dim() == 2:
        if tuple(attn_mask.shape) != (batch, tokens):
            raise ValueError(f"revkernels: a 2-D attn_mask is a key padding mask of shape (batch, tokens) = "
                             f"{(batch, tokens)}, got {tuple(attn_mask.shape)}")
        attn_mask = attn_mask[:, None, None, :]
    elif attn_mask.dim() != 4 or any(m not in (1, n) for m, n in zip(attn_mask.shape, (batch, heads, tokens, tokens))):
        raise ValueError(f"revkernels: attn_mask must be (batch, tokens) or 4-D, broadcastable to (batch, heads, "
                         f"tokens, tokens) = {(batch, heads, tokens, tokens)}, got shape {tuple(attn_mask.shape)}")
    if attn_mask.dtype == torch.bool:
        mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask, float("-inf"))
    else:
        mask = attn_mask.to(device=q.device, dtype=q.dtype)
    if causal:
        future = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).triu_(1)
        mask = mask + torch.zeros(tokens, tokens, dtype=q.dtype, device=q.device).masked_fill_(future, float("-inf"))
    return mask, False


class AttentionBranch(nn.Module):
    """F: LayerNorm -> multi-head self-attention (scaled_dot_product_attention, causal or not,
    with the `attn_mask` keyword) -> proj -> dropout -> drop-path. Input (batch, tokens, dim)."""

    absorbs_context = True  # its **context takes the keywords meant for other branches (see check_context)

    def __init__(self, dim, num_heads, qkv_bias=True, drop_path=0.0, eps=1e-6, causal=False, dropout=0.0):
        super().__init__()
        if not isinstance(num_heads, numbers.Integral) or isinstance(num_heads, bool) or num_heads < 1:
            raise ValueError(f"revkernels: num_heads must be a positive int, got {num_heads!r}")
        if dim % num_heads:
            raise ValueError(f"revkernels: dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.causal = bool(causal)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.dropout = ResidualDropout(dropout)
        self.drop_path = DropPath(check_drop_probability(drop_path, "drop_path"))

    def heads(self, qkv):
        """q, k, v of shape (batch, heads, tokens, head_dim) from the qkv projection (batch, tokens, 3 dim)."""
        batch, tokens, dim3 = qkv.shape
        qkv = qkv.reshape(batch, tokens, 3, self.num_heads, dim3 // (3 * self.num_heads))
        return qkv.permute(2, 0, 3, 1, 4).unbind(0)

    def attend(self, qkv, attn_mask=None):
        """Attention output before the projection, (batch, tokens, dim), from the qkv projection
        (batch, tokens, 3 dim)."""
        batch, tokens, dim3 = qkv.shape
        q, k, v = self.heads(qkv)
        mask, is_causal = attention_mask(attn_mask, q, self.causal)
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
        return out.transpose(1, 2).reshape(batch, tokens, dim3 // 3)

    def forward(self, x, attn_mask=None, **context):
        _check_tokens(x)  # (the width: checked by the norm, which a user may have swapped for another)
        out = self.proj(self.attend(self.qkv(self.norm(x)), attn_mask))
        return self.drop_path(self.dropout(out))


class MlpBranch(nn.Module):
    """G: LayerNorm -> fc1 -> GELU -> fc2 -> dropout -> drop-path (context keywords are ignored)."""

    absorbs_context = True

    def __init__(self, dim, hidden_dim, drop_path=0.0, eps=1e-6, approximate="none", dropout=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.dropout = ResidualDropout(dropout)
        self.drop_path = DropPath(check_drop_probability(drop_path, "drop_path"))
        self.approximate = approximate

    def forward(self, x, **context):
        return self.drop_path(self.dropout(self.fc2(F.gelu(self.fc1(self.norm(x)), approximate=self.approximate))))


def _attention_with_saved(q, k, v, mask, is_causal):
    """scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal) and what
    `_attention_vjp` needs. On CPU the flash kernel F.scaled_dot_product_attention picks for these
    inputs, called directly, keeps its log-sum-exp so the backward runs without an autograd graph
    (bitwise the same output); elsewhere a one-node graph from q, k, v leaves."""
    if q.device.type == "cpu" and torch._fused_sdp_choice(q, k, v, mask, 0.0, is_causal) == _SDP_FLASH:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, attn_mask=mask)
        return out, (q, k, v, out, lse, mask, is_causal)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    return out.detach(), (q, k, v, out)


def _attention_vjp(saved, d_out):
    """(dq, dk, dv) of the attention saved by `_attention_with_saved` for the output grad d_out."""
    if len(saved) == 7:
        q, k, v, out, lse, mask, is_causal = saved
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask)
    q, k, v, out = saved
    return torch.autograd.grad(out, [q, k, v], d_out.to(out.dtype))


_SDP_FLASH = 1  # torch._fused_sdp_choice's code for the flash kernel (SDPBackend.FLASH_ATTENTION)


class RevTransformerBlock(ReversibleBlock):
    """Reversible transformer block (F = attention, G = MLP) with fused recompute and gradient steps.

    Args: dim, num_heads, mlp_ratio (hidden = dim * mlp_ratio), causal (each token attends to
    itself and earlier tokens only), drop_path (stochastic depth of both branches), qkv_bias,
    eps (LayerNorm), approximate ("none" or "tanh" GELU), dropout (residual dropout of both
    branches' outputs). Streams are (batch, tokens, dim). Context: ``attn_mask`` (see
    `attention_mask`; the mask gets no gradient); other context keywords are ignored.
    """

    coupling = "full"  # its fused steps compute ReversibleBlock's coupling (engine.structure.coupling_kind)

    def __init__(self, dim, num_heads, mlp_ratio=4.0, causal=False, drop_path=0.0, qkv_bias=True, eps=1e-6,
                 approximate="none", dropout=0.0):
        super().__init__(AttentionBranch(dim, num_heads, qkv_bias, drop_path, eps, causal, dropout),
                         MlpBranch(dim, int(dim * mlp_ratio), drop_path, eps, approximate, dropout))

    def _params(self):
        # {"f.norm.weight": parameter, ...}, computed once per module structure (and per FSDP
        # swap): a step reads parameters from it instead of walking submodules' __getattr__.
        return param_slots(self).by_name()

    def _parts(self):
        # The submodules the steps use, once per module structure (each Module.__getattr__ lookup
        # costs about what a small kernel does), and whether F and G hold the layers the fused steps
        # compute with (`fused`; else the generic ReversibleBlock steps run the modules as they are).
        return cached(self, "parts", _BlockParts)

    def forward_with_state(self, x1, x2, preserve_rng_state=True, context=NO_CONTEXT):
        m = self._parts()
        if not m.fused or submodule_hooked(self):
            # (a forward hook could observe F's or G's submodules: run them as modules)
            return super().forward_with_state(x1, x2, preserve_rng_state, context)
        return self._fused_forward(x1, x2, preserve_rng_state, context)

    def forward_with_state_exact(self, x1, x2, preserve_rng_state, context, streams, label):
        """`forward_with_state` on exact mode's int64 streams (``streams``, a
        `revkernels.nn.exact.FixedPointStreams`; `label` names the block in an overflow): the fused
        steps, or None where they do not apply (the generic exact steps run then)."""
        if not self._parts().fused or submodule_hooked(self):
            return None
        return self._fused_forward(x1, x2, preserve_rng_state, context, streams, label)

    def _fused_forward(self, x1, x2, preserve_rng_state, context, streams=None, label=None):
        # AttentionBranch.forward and MlpBranch.forward with the same ops on the parameters
        # directly (bitwise the module composition, without its per-module call overhead). With
        # `streams` the couplings are exact mode's integer adds, F and G reading the float views.
        m = self._parts()
        P = self._params()
        keep = preserve_rng_state and self.draws_random()
        devices = cuda_devices_of(x1, x2) if keep else ()
        rng_f = RngState(devices) if keep else None
        v2 = x2 if streams is None else streams.view(x2)
        _check_tokens(v2, P["f.qkv.weight"].shape[1])
        dim = v2.shape[-1]
        h = F.layer_norm(v2, (dim,), P["f.norm.weight"], P["f.norm.bias"], m.f_norm.eps)
        o = m.f.attend(F.linear(h, P["f.qkv.weight"], P.get("f.qkv.bias")), context.get("attn_mask"))
        f_out = m.f_drop_path(m.f_dropout.sample(F.linear(o, P["f.proj.weight"], P["f.proj.bias"]))[0])
        if streams is None:
            y1 = v1 = x1 + f_out
        else:
            v1, y1 = streams.add(x1, f_out, label)
        rng_g = RngState(devices) if keep else None
        h = F.layer_norm(v1, (dim,), P["g.norm.weight"], P["g.norm.bias"], m.g_norm.eps)
        h = F.gelu(F.linear(h, P["g.fc1.weight"], P["g.fc1.bias"]), approximate=m.g.approximate)
        g_out = m.g_drop_path(m.g_dropout.sample(F.linear(h, P["g.fc2.weight"], P["g.fc2.bias"]))[0])
        y2 = x2 + g_out if streams is None else streams.add(x2, g_out, label)[1]
        return y1, y2, BlockState(rng_f, rng_g) if keep else None

    def recompute(self, y1, y2, state=None, context=NO_CONTEXT):
        m = self._parts()
        if not m.fused or submodule_hooked(self, backward=True):
            # Hooks below the block (a forward hook may change a submodule's output, a pre-hook
            # compute a pruned weight) run in the rebuild as in the forward: the modules' own steps
            return super().recompute(y1, y2, state, context)
        return self._fused_recompute(y1, y2, state, context)

    def recompute_exact(self, y1, y2, state, context, streams):
        """`recompute` on exact mode's int64 streams (see `forward_with_state_exact`): the fused
        steps, whose `grads` then apply unchanged, or None where they do not apply."""
        if not self._parts().fused or submodule_hooked(self, backward=True):
            return None
        return self._fused_recompute(y1, y2, state, context, streams)

    def _fused_recompute(self, y1, y2, state, context, streams=None):
        m = self._parts()
        P = self._params()
        stream1 = y1
        if streams is not None:  # exact mode: F and G read the float views, the streams stay int64
            y1 = streams.view(y1)
        shape = y1.shape
        batch, tokens, dim = shape
        # The steps work on (batch * tokens, dim) rows: F.linear runs the same addmm/mm on them as on
        # the forward's contiguous 3-D inputs, and the gradient step's GEMMs need no reshapes.
        y1, y2 = y1.detach().reshape(-1, dim), y2.detach().reshape(-1, dim)
        with torch.no_grad():
            ln2, mean2, rstd2 = torch.native_layer_norm(y1, [dim], P["g.norm.weight"], P["g.norm.bias"], m.g_norm.eps)
            with maybe_replay(None if state is None else state.rng_g):
                # The ops (and so the kernels and dtypes) of MlpBranch.forward: g_out is bitwise the G
                # the forward added, under autocast too. No local graph: `grads` differentiates by hand.
                pre = F.linear(ln2, P["g.fc1.weight"], P["g.fc1.bias"])
                hidden = F.gelu(pre, approximate=m.g.approximate)
                g_out, g_keep, g_scale = _residual_noise(
                    m.g_dropout, m.g_drop_path, F.linear(hidden, P["g.fc2.weight"], P["g.fc2.bias"]), shape)
            if streams is None:
                x2, ln1, mean1, rstd1 = sub_layer_norm(y2, g_out, P["f.norm.weight"], P["f.norm.bias"], m.f_norm.eps)
                x2_stream = x2
            else:  # (the LayerNorm of F's input as the forward's F.layer_norm computed it)
                x2, x2_stream = streams.sub(y2, g_out)
                ln1, mean1, rstd1 = torch.native_layer_norm(x2, [dim], P["f.norm.weight"], P["f.norm.bias"],
                                                            m.f_norm.eps)
                mean1, rstd1 = mean1.view(-1), rstd1.view(-1)
            with maybe_replay(None if state is None else state.rng_f):
                # AttentionBranch.forward's ops, attention with what its backward needs kept.
                q, k, v = m.f.heads(F.linear(ln1, P["f.qkv.weight"], P.get("f.qkv.bias")).view(batch, tokens, 3 * dim))
                out, attention = _attention_with_saved(q, k, v, *attention_mask(context.get("attn_mask"), q, m.f.causal))
                o = out.transpose(1, 2).reshape(-1, dim)
                f_out, f_keep, f_scale = _residual_noise(
                    m.f_dropout, m.f_drop_path, F.linear(o, P["f.proj.weight"], P["f.proj.bias"]), shape)
            if streams is None:
                x1 = coupling_sub(y1, f_out).view(shape)
            else:
                v1, x1 = streams.sub(stream1.reshape(-1, dim), f_out)
                x1 = streams.remember(v1.view(shape), x1.view(shape))  # (the next recompute reads its view)
        return _RevViTRecompute(x1=x1, x2=x2_stream.view(shape), y1=y1, x2_rows=x2, ln1=ln1, ln2=ln2,
                                mean1=mean1, rstd1=rstd1, mean2=mean2.view(-1), rstd2=rstd2.view(-1), o=o,
                                attention=attention, pre=pre, hidden=hidden, g_scale=g_scale, f_scale=f_scale,
                                g_keep=g_keep, f_keep=f_keep)

    @takes_missing_dy2
    def grads(self, rec, dy1, dy2):
        if not isinstance(rec, _RevViTRecompute):  # the generic recompute's local graphs
            return super().grads(rec, dy1, dy2)
        P = self._params()
        shape = dy1.shape
        dy1 = dy1.reshape(-1, shape[-1])
        named = {}
        with torch.no_grad():
            if dy2 is None:  # the loss did not use y2: G is not differentiated (see ReversibleBlock.grads)
                dy1_total, dy2 = dy1, torch.zeros_like(dy1)  # (dx2 adds dy2)
            else:
                dy2 = dy2.reshape(-1, shape[-1])
                dy1_total = self._mlp_grads(rec, dy1, dy2, P, named)
            dx2 = self._attention_grads(rec, dy1_total, dy2, P, named)
        params, param_grads = [], []
        for name, p in P.items():
            if p.requires_grad and name in named:  # (P also has any other names a module holds them under)
                grad = named[name]
                params.append(p)
                param_grads.append(grad() if callable(grad) else grad)
        return BlockGrads(dx1=dy1_total.view(shape), dx2=dx2.view(shape), params=params, param_grads=param_grads)

    # Both VJPs work on (batch * tokens, features) rows in the forward's dtypes (under autocast the
    # GEMM inputs were cast to the autocast dtype) and cast parameter and input grads back, as the
    # casts' own backward would (`_to`: no call at all where the dtypes already agree).
    # Weight grads are thunks: a parameter that does not require grad never pays for its GEMM.

    def _mlp_grads(self, rec, dy1, dy2, P, named):
        """dy1' = dy1 + dG/dy1^T dy2 (fc2, GELU, fc1, then LayerNorm2's backward fused with the
        residual add); G's parameter grads into `named`."""
        hidden = rec.hidden
        dg = _to(dy2, hidden.dtype)
        if rec.g_scale is not None:
            dg = dg * rec.g_scale
        if rec.g_keep is not None:
            dg = torch.ops.aten.native_dropout_backward(dg, rec.g_keep.view(dg.shape), self._parts().g_dropout.scale())
        fc1_w, fc2_w, fc1_b = P["g.fc1.weight"], P["g.fc2.weight"], P["g.fc1.bias"]
        named["g.fc2.weight"] = lambda: _to(torch.mm(dg.t(), hidden), fc2_w.dtype)
        named["g.fc2.bias"] = lambda: _to(dg.sum(0), P["g.fc2.bias"].dtype)
        # GELU's backward and fc1's bias grad (the column sums of d_pre, from the unrounded fp32
        # values) in one pass: pre already holds fc1's bias, so the op's own bias is zero.
        d_pre, named["g.fc1.bias"] = bias_gelu_bwd(torch.mm(dg, _to(fc2_w, hidden.dtype)), rec.pre,
                                                   fc1_b.new_zeros(fc1_b.shape), self._parts().g.approximate)
        ln2 = rec.ln2
        named["g.fc1.weight"] = lambda: _to(torch.mm(d_pre.t(), _to(ln2, d_pre.dtype)), fc1_w.dtype)
        dln2 = _to(torch.mm(d_pre, _to(fc1_w, d_pre.dtype)), ln2.dtype)
        dy1_total, named["g.norm.weight"], named["g.norm.bias"] = layer_norm_bwd_add(
            dln2, rec.y1, P["g.norm.weight"], rec.mean2, rec.rstd2, dy1)
        return dy1_total

    def _attention_grads(self, rec, dy1_total, dy2, P, named):
        """dx2 = dy2 + dF/dx2^T dy1' (drop-path, proj, attention, qkv, then LayerNorm1's backward
        fused with the residual add); F's parameter grads into `named`."""
        o = rec.o
        q = rec.attention[0]
        batch, heads, tokens, head_dim = q.shape
        dproj = dy1_total if rec.f_scale is None else dy1_total * rec.f_scale
        dproj = _to(dproj, o.dtype)
        if rec.f_keep is not None:
            dproj = torch.ops.aten.native_dropout_backward(dproj, rec.f_keep.view(dproj.shape),
                                                           self._parts().f_dropout.scale())
        proj_w, qkv_w = P["f.proj.weight"], P["f.qkv.weight"]
        named["f.proj.weight"] = lambda: _to(torch.mm(dproj.t(), o), proj_w.dtype)
        named["f.proj.bias"] = lambda: _to(dproj.sum(0, dtype=torch.promote_types(dproj.dtype, torch.float32)),
                                           P["f.proj.bias"].dtype)
        d_out = torch.mm(dproj, _to(proj_w, o.dtype)).view(batch, tokens, heads, head_dim).transpose(1, 2)
        dq, dk, dv = _attention_vjp(rec.attention, d_out)
        # back to the qkv projection's layout (batch, tokens, 3, heads, head_dim) in one copy
        dqkv = torch.stack((dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)), dim=2)
        dqkv = dqkv.view(batch * tokens, 3 * heads * head_dim)
        ln1 = rec.ln1
        named["f.qkv.weight"] = lambda: _to(torch.mm(dqkv.t(), _to(ln1, dqkv.dtype)), qkv_w.dtype)
        if "f.qkv.bias" in P:
            named["f.qkv.bias"] = lambda: _to(dqkv.sum(0), P["f.qkv.bias"].dtype)
        dln1 = _to(torch.mm(dqkv, _to(qkv_w, dqkv.dtype)), ln1.dtype)
        dx2, named["f.norm.weight"], named["f.norm.bias"] = layer_norm_bwd_add(
            dln1, rec.x2_rows, P["f.norm.weight"], rec.mean1, rec.rstd1, dy2)
        return dx2


def _to(t, dtype):
    """`t` in `dtype`: `t` itself when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def _residual_noise(dropout, drop_path, out, shape):
    """A branch output's residual dropout and drop-path, as the branch's forward draws them.

    `out`: the branch output as (batch * tokens, dim) rows of a stream of `shape`. Returns (out after
    both, the dropout keep mask or None, the drop-path scale per row (batch * tokens, 1) or None)."""
    if not (dropout.draws_random() or drop_path.draws_random()):
        return out, None, None
    out, keep = dropout.sample(out.view(shape))
    scale = drop_path.sample_scale(out)
    if scale is None:
        return out.view(-1, shape[-1]), keep, None
    return (out * scale).view(-1, shape[-1]), keep, scale.expand(-1, shape[1], -1).reshape(-1, 1)


class RevViTBlock(RevTransformerBlock):
    """Reversible ViT block: the non-causal `RevTransformerBlock` without residual dropout.

    Args: dim, num_heads, mlp_ratio (hidden = dim * mlp_ratio), drop_path (stochastic depth of
    both branches), qkv_bias, eps (LayerNorm), approximate ("none" or "tanh" GELU).
    Streams are (batch, tokens, dim).
    """

    def __init__(self, dim, num_heads, mlp_ratio=4.0, drop_path=0.0, qkv_bias=True, eps=1e-6, approximate="none"):
        super().__init__(dim, num_heads, mlp_ratio, causal=False, drop_path=drop_path, qkv_bias=qkv_bias, eps=eps,
                         approximate=approximate)


def _holds_fused_layers(block):
    """Whether `block`'s F and G are the library's branches with the layers its fused steps read by
    name: exactly nn.LayerNorm (with weight and bias) and nn.Linear (biases where the steps read
    them), none parametrized, their weights and biases parameters."""
    f, g = block.f, block.g
    if type(f) is not AttentionBranch or type(g) is not MlpBranch or param_slots(block).parametrized:
        return False
    # The steps read weights and biases as parameters (`_params`): a pruned weight (weight_orig and a
    # mask) or one held as a buffer is not one.
    def held(layer, name):
        return layer._parameters.get(name) is not None

    linears = (f.qkv, f.proj, g.fc1, g.fc2)
    return (all(type(n) is nn.LayerNorm and held(n, "weight") and held(n, "bias") for n in (f.norm, g.norm))
            and all(type(layer) is nn.Linear and held(layer, "weight") for layer in linears)
            and all(held(layer, "bias") for layer in (f.proj, g.fc1, g.fc2))
            and (f.qkv.bias is None or held(f.qkv, "bias")))


class _BlockParts:
    """A `RevTransformerBlock`'s branches and the submodules its fused steps call (`fused`: whether
    it holds them, `_holds_fused_layers`)."""

    __slots__ = ("fused", "f", "g", "f_norm", "g_norm", "f_dropout", "g_dropout", "f_drop_path", "g_drop_path")

    def __init__(self, block):
        self.fused = _holds_fused_layers(block)
        self.f, self.g = block.f, block.g
        if self.fused:
            self.f_norm, self.f_dropout, self.f_drop_path = self.f.norm, self.f.dropout, self.f.drop_path
            self.g_norm, self.g_dropout, self.g_drop_path = self.g.norm, self.g.dropout, self.g.drop_path


class _RevViTRecompute:
    """What `RevViTBlock.grads` needs from `recompute` (x1, x2: the rebuilt input)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
