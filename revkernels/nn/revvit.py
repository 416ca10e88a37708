r"""`RevViTBlock`: a reversible transformer block whose rebuild and gradient steps run on fused ops.

    F(x) = drop_path(proj(attention(LN1(x))))        G(x) = drop_path(fc2(gelu(fc1(LN2(x)))))
    y1 = x1 + F(x2)                                  y2 = x2 + G(y1)

The forward is the ordinary module composition (so the block is its own reference). The engines'
two steps are written out with fused ops, one pass over the activations per step where eager
PyTorch spends several:

recompute(y1, y2), G first (local autograd graphs start at the LayerNorm outputs)::

    ln2, mean2, rstd2 = layer_norm(y1)                              (ATen native_layer_norm)
    g  = drop_path(fc2(gelu(fc1(ln2))))                             (graph from ln2; MlpBranch's ops)
    x2, ln1, mean1, rstd1 = sub_layer_norm(y2, g, w_ln1, b_ln1)     (rebuild + LN1: one pass)
    o  = attention(ln1)                                             (graph from ln1)
    x1 = coupling_sub(y1, drop_path(proj(o)))                       (cuBLAS linear, bias in its
                                                                     epilogue, + the fused subtract)

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
rebuild. The composition for x1 is also the faster one:
on an H200 in bf16, F.linear + coupling_sub took 1.77 ms against 2.10 ms for the single
addmm(alpha=-1, beta=1) of ``linear_sub`` at 32768 rows x 4096, and 0.117 ms against 0.177 ms at
25216 x 1024.

grads(dy1, dy2)::

    dln2, dW1, db1, dW2, db2 = vjp of g at ln2 with dy2
    dy1', dw_ln2, db_ln2 = layer_norm_bwd_add(dln2, y1, ..., dres=dy1)     dy1' = dy1 + dG^T dy2
    dP = s * dy1';  dO = dP @ Wp;  dWp = dP^T o;  dbp = sum_rows(dP)       (proj by hand: o is kept,
                                                                            proj's output is not)
    dln1, dWqkv, dbqkv = vjp of o at ln1 with dO
    dx2, dw_ln1, db_ln1 = layer_norm_bwd_add(dln1, x2, ..., dres=dy2)      dx2 = dy2 + dF^T dy1'
    dx1 = dy1'

The branch modules' forward hooks do not fire in these steps (they are computed from the
parameters directly).
"""
import torch
import torch.nn.functional as F
from torch import nn

from revkernels.engine.state import maybe_replay
from revkernels.nn.drop_path import DropPath
from revkernels.nn.reversible import BlockGrads, ReversibleBlock
from revkernels.ops.coupling import coupling_sub
from revkernels.ops.layer_norm import layer_norm_bwd_add, sub_layer_norm


class AttentionBranch(nn.Module):
    """F: LayerNorm -> multi-head self-attention (scaled_dot_product_attention) -> proj -> drop-path.
    Input (batch, tokens, dim)."""

    def __init__(self, dim, num_heads, qkv_bias=True, drop_path=0.0, eps=1e-6):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"revkernels: dim ({dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.drop_path = DropPath(drop_path)

    def attend(self, h, qkv_weight, qkv_bias):
        """Attention output before the projection, (batch, tokens, dim)."""
        batch, tokens, dim = h.shape
        qkv = F.linear(h, qkv_weight, qkv_bias).reshape(batch, tokens, 3, self.num_heads, dim // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, dim)

    def forward(self, x):
        if x.dim() != 3:
            raise ValueError(f"revkernels: RevViTBlock input must be (batch, tokens, dim), got shape {tuple(x.shape)}")
        return self.drop_path(self.proj(self.attend(self.norm(x), self.qkv.weight, self.qkv.bias)))


class MlpBranch(nn.Module):
    """G: LayerNorm -> fc1 -> GELU -> fc2 -> drop-path."""

    def __init__(self, dim, hidden_dim, drop_path=0.0, eps=1e-6, approximate="none"):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop_path = DropPath(drop_path)
        self.approximate = approximate

    def forward(self, x):
        return self.drop_path(self.fc2(F.gelu(self.fc1(self.norm(x)), approximate=self.approximate)))


def _leaf(p):
    # A detached alias of a parameter: differentiating the local graph fires no hook of `p`.
    return p.detach().requires_grad_(p.requires_grad)


class RevViTBlock(ReversibleBlock):
    """Reversible ViT block (F = attention, G = MLP) with fused recompute and gradient steps.

    Args: dim, num_heads, mlp_ratio (hidden = dim * mlp_ratio), drop_path (stochastic depth of
    both branches), qkv_bias, eps (LayerNorm), approximate ("none" or "tanh" GELU).
    Streams are (batch, tokens, dim).
    """

    def __init__(self, dim, num_heads, mlp_ratio=4.0, drop_path=0.0, qkv_bias=True, eps=1e-6, approximate="none"):
        super().__init__(AttentionBranch(dim, num_heads, qkv_bias, drop_path, eps),
                         MlpBranch(dim, int(dim * mlp_ratio), drop_path, eps, approximate))

    def recompute(self, y1, y2, state=None):
        f, g = self.f, self.g
        y1, y2 = y1.detach(), y2.detach()
        dim = y1.shape[-1]
        leaves = {name: _leaf(p) for name, p in self.named_parameters()}
        with torch.enable_grad():
            with torch.no_grad():
                ln2, mean2, rstd2 = torch.native_layer_norm(y1, [dim], g.norm.weight, g.norm.bias, g.norm.eps)
            ln2 = ln2.requires_grad_()
            with maybe_replay(None if state is None else state.rng_g):
                # The ops (and so the kernels and dtypes) of MlpBranch.forward: g_out is bitwise the G
                # the forward added, under autocast too.
                hidden = F.gelu(F.linear(ln2, leaves["g.fc1.weight"], leaves["g.fc1.bias"]), approximate=g.approximate)
                g_out = F.linear(hidden, leaves["g.fc2.weight"], leaves["g.fc2.bias"])
                g_scale = g.drop_path.sample_scale(g_out)
                if g_scale is not None:
                    g_out = g_out * g_scale
            x2, ln1, mean1, rstd1 = sub_layer_norm(y2, g_out.detach(), f.norm.weight.detach(), f.norm.bias.detach(), f.norm.eps)
            ln1 = ln1.detach().requires_grad_()
            with maybe_replay(None if state is None else state.rng_f):
                o = f.attend(ln1, leaves["f.qkv.weight"], leaves.get("f.qkv.bias"))
                # proj then drop-path exactly as AttentionBranch.forward / DropPath.forward compute
                # them: the rebuild subtracts the value the forward added.
                f_out = F.linear(o.detach(), f.proj.weight.detach(), f.proj.bias.detach())
                f_scale = f.drop_path.sample_scale(f_out)
            if f_scale is not None:
                f_out = f_out * f_scale
            x1 = coupling_sub(y1, f_out)
        return _RevViTRecompute(x1=x1, x2=x2, y1=y1, ln1=ln1, ln2=ln2, mean1=mean1, rstd1=rstd1,
                                mean2=mean2.reshape(mean2.shape[:-1]), rstd2=rstd2.reshape(rstd2.shape[:-1]),
                                o=o, g_out=g_out, f_scale=f_scale, leaves=leaves)

    def grads(self, rec, dy1, dy2):
        f, g = self.f, self.g
        leaves = rec.leaves
        # G: dy1' = dy1 + dG^T dy2, LayerNorm2's backward fused with the residual add.
        g_names = [n for n in ("g.fc1.weight", "g.fc1.bias", "g.fc2.weight", "g.fc2.bias") if leaves[n].requires_grad]
        dln2, *g_param_grads = torch.autograd.grad(rec.g_out, [rec.ln2] + [leaves[n] for n in g_names],
                                                   dy2.to(rec.g_out.dtype))
        dy1_total, dw_ln2, db_ln2 = layer_norm_bwd_add(dln2, rec.y1, g.norm.weight, rec.mean2, rec.rstd2, dy1)
        # F's projection by hand: the rebuild keeps o but not the projection's output.
        o = rec.o.detach()
        dproj = dy1_total if rec.f_scale is None else dy1_total * rec.f_scale
        dproj2d = dproj.reshape(-1, dproj.shape[-1]).to(o.dtype)
        proj_w = f.proj.weight
        d_o = (dproj2d @ proj_w.to(o.dtype)).reshape(o.shape)
        d_proj_w = (dproj2d.t() @ o.reshape(-1, o.shape[-1])).to(proj_w.dtype)
        d_proj_b = dproj.reshape(-1, dproj.shape[-1]).float().sum(0).to(f.proj.bias.dtype)
        f_names = [n for n in ("f.qkv.weight", "f.qkv.bias") if n in leaves and leaves[n].requires_grad]
        dln1, *f_param_grads = torch.autograd.grad(rec.o, [rec.ln1] + [leaves[n] for n in f_names], d_o)
        dx2, dw_ln1, db_ln1 = layer_norm_bwd_add(dln1, rec.x2, f.norm.weight, rec.mean1, rec.rstd1, dy2)

        named = dict(zip(g_names + f_names, g_param_grads + f_param_grads))
        named.update({"g.norm.weight": dw_ln2, "g.norm.bias": db_ln2, "f.norm.weight": dw_ln1,
                      "f.norm.bias": db_ln1, "f.proj.weight": d_proj_w, "f.proj.bias": d_proj_b})
        params, param_grads = [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                params.append(p)
                param_grads.append(named[name])
        return BlockGrads(dx1=dy1_total, dx2=dx2, params=params, param_grads=param_grads)


class _RevViTRecompute:
    """What `RevViTBlock.grads` needs from `recompute` (x1, x2: the rebuilt input)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)
