"""Rev-Text: transformer language models whose blocks are reversible (`RevTransformerBlock`).

    tokens -> token embedding + learned position embedding (-> LayerNorm: roberta) -> dropout
           -> two copies (x1 = x2 = h) -> RevTransformerBlocks (one ReversibleSequential, engine of
              your choice; the padding mask reaches every attention as the ``attn_mask`` context)
           -> stream fusion (y1 + y2) / 2 -> LayerNorm
           -> gpt2_small: logits (batch, tokens, vocab) = h @ token_embedding^T (tied weights)
              roberta_base: hidden states (batch, tokens, dim)

"gpt2_small" is a causal LM (12 blocks, 768 wide, 12 heads, tanh GELU, as GPT-2); "roberta_base"
a bidirectional encoder of the same geometry (exact GELU, LayerNorm after the embeddings, as
RoBERTa). Blocks are pre-norm, so the last LayerNorm follows the blocks in both. The layers are the
originals' one for one (the second stream adds no parameter): GPT-2 small's 124.44M parameters
exactly with vocab 50257 and 1024 positions; RoBERTa-base 124.06M with vocab 50265 and 514
positions, its 124.65M less the pooler and the token-type embedding. Dropout (default 0.1, as
both) is applied to the embeddings and to each branch's output; the attention probabilities are
not dropped.
"""
import torch
import torch.nn.functional as F
from torch import nn

from revkernels.models.staged import OneRunModel, check_positive_int
from revkernels.nn.drop_path import check_drop_probability
from revkernels.nn.reversible import ReversibleSequential
from revkernels.nn.revvit import RevTransformerBlock

CONFIGS = {
    "gpt2_small": dict(dim=768, depth=12, heads=12, causal=True, lm_head=True, embed_norm=False, approximate="tanh"),
    "roberta_base": dict(dim=768, depth=12, heads=12, causal=False, lm_head=False, embed_norm=True,
                         approximate="none"),
}


class RevText(OneRunModel, nn.Module):
    """See the module docstring. ``model(tokens, attention_mask=None)``: tokens (batch, tokens) of
    ints; attention_mask (batch, tokens), HF's padding mask (1 or True: a real token, 0: padding;
    padded keys get no attention weight; any non-zero value is a real token, so an additive float
    mask, 0 for real tokens, would be read inverted)."""

    def __init__(self, vocab_size, max_len, dim, depth, heads, causal, lm_head, embed_norm, mlp_ratio=4.0,
                 dropout=0.1, drop_path_rate=0.0, eps=1e-5, approximate="none", engine="auto", exact=False):
        super().__init__()
        check_drop_probability(drop_path_rate, "drop_path_rate")
        check_positive_int(vocab_size, "vocab_size")
        check_positive_int(max_len, "max_len")
        self.vocab_size, self.max_len, self.lm_head = vocab_size, max_len, lm_head
        self.tok_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_len, dim)
        nn.init.normal_(self.tok_embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed.weight, std=0.02)
        self.embed_norm = nn.LayerNorm(dim, eps=eps) if embed_norm else None
        self.dropout = nn.Dropout(dropout)
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = ReversibleSequential(
            *[RevTransformerBlock(dim, heads, mlp_ratio, causal=causal, drop_path=r, eps=eps, approximate=approximate,
                                  dropout=dropout) for r in rates], engine=engine, exact=exact)
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, tokens, attention_mask=None):
        if tokens.dim() != 2 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"revkernels: tokens must be integer ids of shape (batch, tokens), got "
                             f"{tokens.dtype} of shape {tuple(tokens.shape)}")
        # (on CPU only: on a GPU the check would wait for the device; the embedding asserts there.
        # Compiled or exported, an assert op: a branch on the values would break the graph)
        if tokens.device.type == "cpu" and tokens.numel() and torch.compiler.is_compiling():
            torch._assert_async((tokens.min() >= 0) & (tokens.max() < self.vocab_size),
                                f"revkernels: tokens must be ids in [0, vocab_size={self.vocab_size})")
        elif tokens.device.type == "cpu" and tokens.numel() and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(f"revkernels: tokens must be ids in [0, vocab_size={self.vocab_size}), got ids from "
                             f"{tokens.min().item()} to {tokens.max().item()}")
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"revkernels: tokens has {tokens.shape[1]} positions, more than max_len ({self.max_len})")
        context = {}
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(f"revkernels: attention_mask must be a torch.Tensor or None, got "
                                f"{type(attention_mask).__name__}")
            if attention_mask.shape != tokens.shape:
                raise ValueError(f"revkernels: attention_mask must have the shape of tokens {tuple(tokens.shape)}, "
                                 f"got {tuple(attention_mask.shape)}")
            context["attn_mask"] = attention_mask != 0
        h = self.tok_embed(tokens) + self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        h = self.dropout(h)
        y1, y2 = self.blocks(h, h, **context)
        out = self.norm((y1 + y2) * 0.5)
        return F.linear(out, self.tok_embed.weight) if self.lm_head else out


def revtext(name, vocab_size, max_len, **overrides):
    """`RevText` `name` in {"gpt2_small", "roberta_base"} for `vocab_size` tokens and `max_len`
    positions. `overrides`: depth, dim, heads, dropout, mlp_ratio, drop_path_rate, eps, engine, exact
    (fixed-point streams: `revkernels.nn.ReversibleSequential`'s exact mode)."""
    if name not in CONFIGS:
        raise ValueError(f"revkernels: name must be one of {sorted(CONFIGS)}, got {name!r}")
    allowed = {"depth", "dim", "heads", "dropout", "mlp_ratio", "drop_path_rate", "eps", "engine", "exact"}
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise TypeError(f"revkernels: revtext got unknown overrides {unknown}; allowed: {sorted(allowed)}")
    return RevText(vocab_size, max_len, **{**CONFIGS[name], **overrides})
