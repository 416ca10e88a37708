"""Every model's forward against an independent plain-PyTorch definition written here (issue 44).

Each reference reads the model's parameters by their state_dict names (copied, so the model cannot
change them) and computes the function the model's docstrings document with its own math: LayerNorm,
BatchNorm, GELU and softmax attention written out, explicit boolean masks (causal and padding
together), convolutional patch embeddings as matrix products over unfolded patches, Swin's shifted
windows as one masked global attention over the token grid. It calls no revkernels code, and it must
read every state_dict entry the model has (a parameter the model holds but the documented function
does not use is a bug too). float64, eval mode unless said otherwise, toy sizes.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import revkernels as rk
from revkernels.nn.revvit import RevTransformerBlock, RevViTBlock
from tests.helpers import CPU_ENGINES, rel_err

TOL = 1e-10  # float64: the model and the reference differ only in summation orders


class Params:
    """A copy of `module`'s state_dict that records which entries were read."""

    def __init__(self, module, prefix=""):
        self.values = {prefix + k: v.detach().clone() for k, v in module.state_dict().items()}
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return self.values[key]

    def get(self, key):
        return self[key] if key in self.values else None

    def assert_all_read(self, ignore=("num_batches_tracked",)):
        unread = sorted(k for k in set(self.values) - self.read if not k.endswith(ignore))
        assert not unread, f"state_dict entries the documented forward does not use: {unread}"


def assert_close(actual, expected, what, tol=TOL):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"


@torch.no_grad()
def randomize(model):
    """Non-identity norms, non-zero biases, a visible position bias, non-trivial running statistics."""
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)):
            m.weight.normal_(1.0, 0.3)
            m.bias.normal_(0.0, 0.3)
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0.0, 0.5)
            m.running_var.uniform_(0.5, 2.0)
        if isinstance(m, (nn.Linear, nn.Conv2d)) and m.bias is not None:
            m.bias.normal_(0.0, 0.2)
    for name, p in model.named_parameters():
        if name.endswith("relative_position_bias_table"):
            p.normal_(0.0, 0.5)
    return model


# ---------------------------------------------------------------------------------------------
# The reference math
# ---------------------------------------------------------------------------------------------

def layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    assert approximate == "none"
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def linear(x, weight, bias=None):
    out = x @ weight.t()
    return out if bias is None else out + bias


def softmax_attention(q, k, v, allowed=None, additive=None):
    """softmax(q k^T / sqrt(head_dim) + additive, -inf where not allowed) v; q, k, v (batch, heads, tokens, head_dim)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if additive is not None:
        scores = scores + additive
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    return (weights / weights.sum(-1, keepdim=True)) @ v


def multi_head(P, pre, h, heads, allowed=None, additive=None):
    """proj(attention over the heads of qkv(h)): qkv's output rows are q, then k, then v, each split
    into heads of consecutive features."""
    batch, tokens, dim = h.shape
    qkv = linear(h, P[pre + "qkv.weight"], P.get(pre + "qkv.bias"))
    q, k, v = (qkv[..., i * dim:(i + 1) * dim].reshape(batch, tokens, heads, dim // heads).transpose(1, 2)
               for i in range(3))
    o = softmax_attention(q, k, v, allowed, additive).transpose(1, 2).reshape(batch, tokens, dim)
    return linear(o, P[pre + "proj.weight"], P[pre + "proj.bias"])


def attention_branch(P, pre, x, heads, eps, allowed=None, additive=None):
    """F = proj(attention(LN1(x))) (dropout and drop-path are the identity in eval mode)."""
    return multi_head(P, pre, layer_norm(x, P[pre + "norm.weight"], P[pre + "norm.bias"], eps), heads,
                      allowed, additive)


def mlp_branch(P, pre, x, eps, approximate):
    """G = fc2(gelu(fc1(LN2(x))))."""
    h = layer_norm(x, P[pre + "norm.weight"], P[pre + "norm.bias"], eps)
    return linear(gelu(linear(h, P[pre + "fc1.weight"], P[pre + "fc1.bias"]), approximate),
                  P[pre + "fc2.weight"], P[pre + "fc2.bias"])


def transformer_block(P, pre, x1, x2, heads, eps, approximate, allowed=None, additive=None):
    """y1 = x1 + F(x2), y2 = x2 + G(y1)."""
    y1 = x1 + attention_branch(P, pre + "f.", x2, heads, eps, allowed, additive)
    return y1, x2 + mlp_branch(P, pre + "g.", y1, eps, approximate)


def transformer_block_inverse(P, pre, y1, y2, heads, eps, approximate, allowed=None, additive=None):
    """x2 = y2 - G(y1), x1 = y1 - F(x2)."""
    x2 = y2 - mlp_branch(P, pre + "g.", y1, eps, approximate)
    return y1 - attention_branch(P, pre + "f.", x2, heads, eps, allowed, additive), x2


def causal_allowed(tokens):
    """(tokens, tokens) bool: query i may attend to keys j <= i."""
    i = torch.arange(tokens)
    return i[None, :] <= i[:, None]


def patch_tokens(P, pre, images, patch):
    """A patch x patch convolution with stride patch, as a matrix product over the unfolded patches:
    (batch, (H/p) * (W/p) in raster order, dim)."""
    b, c, h, w = images.shape
    patches = images.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    patches = patches.reshape(b, (h // patch) * (w // patch), c * patch * patch)
    weight = P[pre + "weight"]
    return linear(patches, weight.reshape(weight.shape[0], -1), P[pre + "bias"])


# ---------------------------------------------------------------------------------------------
# RevTransformerBlock / RevViTBlock
# ---------------------------------------------------------------------------------------------

BATCH, TOKENS, DIM, HEADS = 3, 7, 12, 3


def _block_masks(case):
    """(causal, attn_mask for the block, allowed (batch, 1, T, T) or None, additive (batch, 1, 1, T) or None)."""
    if case == "causal+bool_padding":
        keep = torch.ones(BATCH, TOKENS, dtype=torch.bool)
        keep[1, 4:] = False  # right padding
        keep[2, 2] = False  # a hole in the middle
        allowed = causal_allowed(TOKENS)[None, None] & keep[:, None, None, :]
        return True, keep, allowed, None
    if case == "float_additive":
        add = torch.randn(BATCH, TOKENS, dtype=torch.float64)
        add[0, 3] = float("-inf")
        return False, add, None, add[:, None, None, :]
    if case == "causal+4d_bool":
        keep = torch.rand(1, 1, TOKENS, TOKENS) < 0.6
        keep |= torch.eye(TOKENS, dtype=torch.bool)  # every query keeps a key
        return True, keep, causal_allowed(TOKENS)[None, None] & keep, None
    assert case == "causal"
    return True, None, causal_allowed(TOKENS)[None, None], None


@pytest.mark.parametrize("path", ["fused", "modules"])
@pytest.mark.parametrize("case", ["causal", "causal+bool_padding", "float_additive", "causal+4d_bool"])
def test_rev_transformer_block_forward_and_inverse(case, path):
    causal, mask, allowed, additive = _block_masks(case)
    block = randomize(RevTransformerBlock(DIM, HEADS, mlp_ratio=2.5, causal=causal, eps=0.05, approximate="tanh",
                                          dropout=0.2, drop_path=0.3)).double().eval()
    if path == "modules":  # a forward hook below the block: its branches run as modules
        block.f.qkv.register_forward_hook(lambda *args: None)
    P = Params(block)
    assert P.values["g.fc1.weight"].shape == (30, DIM)  # hidden = int(dim * mlp_ratio)
    x1, x2 = torch.randn(2, BATCH, TOKENS, DIM, dtype=torch.float64)
    context = {} if mask is None else {"attn_mask": mask}
    y1, y2 = block(x1, x2, **context)
    r1, r2 = transformer_block(P, "", x1, x2, HEADS, 0.05, "tanh", allowed, additive)
    P.assert_all_read()
    assert_close(y1, r1, "y1")
    assert_close(y2, r2, "y2")

    i1, i2 = transformer_block_inverse(P, "", r1, r2, HEADS, 0.05, "tanh", allowed, additive)
    inv1, inv2 = block.inverse(y1, y2, context=context)
    assert_close(inv1, i1, "inverse x1")
    assert_close(inv2, i2, "inverse x2")
    rec = block.recompute(y1, y2, context=context)  # the engines' rebuild (fused or the modules')
    assert_close(rec.x1, i1, "recompute x1")
    assert_close(rec.x2, i2, "recompute x2")
    assert_close(i1, x1, "reference inverse x1", 1e-9)  # (the reference inverts itself)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_rev_vit_block_forward_and_inverse(qkv_bias):
    # RevViTBlock's defaults: non-causal, LayerNorm eps 1e-6, exact GELU, MLP ratio 4
    block = randomize(RevViTBlock(DIM, HEADS, qkv_bias=qkv_bias)).double().eval()
    P = Params(block)
    assert P.values["g.fc1.weight"].shape == (4 * DIM, DIM)
    assert ("f.qkv.bias" in P.values) == qkv_bias
    x1, x2 = torch.randn(2, BATCH, TOKENS, DIM, dtype=torch.float64)
    r1, r2 = transformer_block(P, "", x1, x2, HEADS, 1e-6, "none")
    P.assert_all_read()
    y1, y2 = block(x1, x2)
    assert_close(y1, r1, "y1")
    assert_close(y2, r2, "y2")
    i1, i2 = transformer_block_inverse(P, "", r1, r2, HEADS, 1e-6, "none")
    inv1, inv2 = block.inverse(y1, y2)
    assert_close(inv1, i1, "inverse x1")
    assert_close(inv2, i2, "inverse x2")
    rec = block.recompute(y1, y2)
    assert_close(rec.x1, i1, "recompute x1")
    assert_close(rec.x2, i2, "recompute x2")


# ---------------------------------------------------------------------------------------------
# Rev-Text
# ---------------------------------------------------------------------------------------------

VOCAB, MAX_LEN, TEXT_DEPTH, TEXT_DIM, TEXT_HEADS = 37, 9, 2, 12, 3
# the module docstring: gpt2_small causal, tanh GELU, tied LM head; roberta_base bidirectional,
# exact GELU, LayerNorm after the embeddings, hidden states out. LayerNorm eps 1e-5 (both originals).
TEXT = {"gpt2_small": dict(causal=True, approximate="tanh", embed_norm=False, lm_head=True),
        "roberta_base": dict(causal=False, approximate="none", embed_norm=True, lm_head=False)}


def revtext_reference(P, name, tokens, attention_mask):
    cfg, eps = TEXT[name], 1e-5
    batch, tokens_n = tokens.shape
    h = P["tok_embed.weight"][tokens] + P["pos_embed.weight"][torch.arange(tokens_n)]
    if cfg["embed_norm"]:
        h = layer_norm(h, P["embed_norm.weight"], P["embed_norm.bias"], eps)
    allowed = torch.ones(batch, 1, tokens_n, tokens_n, dtype=torch.bool)
    if cfg["causal"]:
        allowed &= causal_allowed(tokens_n)
    if attention_mask is not None:
        allowed &= (attention_mask != 0)[:, None, None, :]  # padded keys get no weight
    x1 = x2 = h
    for i in range(TEXT_DEPTH):
        x1, x2 = transformer_block(P, f"blocks.blocks.{i}.", x1, x2, TEXT_HEADS, eps, cfg["approximate"], allowed)
    out = layer_norm((x1 + x2) / 2, P["norm.weight"], P["norm.bias"], eps)
    return out @ P["tok_embed.weight"].t() if cfg["lm_head"] else out


@pytest.mark.parametrize("mask", ["none", "padding"])
@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("name", ["gpt2_small", "roberta_base"])
def test_revtext_forward(name, engine, mask):
    model = rk.models.revtext(name, VOCAB, MAX_LEN, depth=TEXT_DEPTH, dim=TEXT_DIM, heads=TEXT_HEADS,
                              mlp_ratio=2.0, engine=engine)
    model = randomize(model).double().eval()
    P = Params(model)
    tokens = torch.randint(0, VOCAB, (BATCH, 7))  # fewer than max_len positions
    attention_mask = None
    if mask == "padding":
        attention_mask = torch.ones(BATCH, 7, dtype=torch.long)  # HF's mask: 1 a token, 0 padding
        attention_mask[1, 4:] = 0
        attention_mask[2, 2] = 0
        attention_mask[0, 5] = 2  # any non-zero value is a token
    expected = revtext_reference(P, name, tokens, attention_mask)
    P.assert_all_read()
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    got = model(tokens, **kwargs)
    assert_close(got, expected, f"{name} output")
    with torch.no_grad():  # inference: the same function
        assert_close(model(tokens, **kwargs), expected, f"{name} output under no_grad")
    assert got.shape == ((BATCH, 7, VOCAB) if TEXT[name]["lm_head"] else (BATCH, 7, TEXT_DIM))


# ---------------------------------------------------------------------------------------------
# Rev-ViT
# ---------------------------------------------------------------------------------------------

def test_revvit_forward():
    # The module docstring: patch embedding + learned positions (no class token), RevViTBlocks,
    # (y1 + y2) / 2, LayerNorm (eps 1e-6), mean over the tokens, linear head.
    dim, depth, heads, patch, img = 16, 2, 2, 4, 16
    model = rk.models.RevViT(dim, depth, heads, num_classes=5, img_size=img, patch_size=patch, mlp_ratio=2.0)
    model = randomize(model).double().eval()
    P = Params(model)
    images = torch.randn(2, 3, img, img, dtype=torch.float64)
    x = patch_tokens(P, "patch_embed.", images, patch) + P["pos_embed"][0]
    x1 = x2 = x
    for i in range(depth):
        x1, x2 = transformer_block(P, f"blocks.blocks.{i}.", x1, x2, heads, 1e-6, "none")
    pooled = layer_norm((x1 + x2) / 2, P["norm.weight"], P["norm.bias"], 1e-6).mean(1)
    expected = linear(pooled, P["head.weight"], P["head.bias"])
    P.assert_all_read()
    assert_close(model(images), expected, "RevViT logits")
    with torch.no_grad():
        assert_close(model(images), expected, "RevViT logits under no_grad")


# ---------------------------------------------------------------------------------------------
# Rev-Swin
# ---------------------------------------------------------------------------------------------

def swin_window_bias(P, pre, grid, window, shift):
    """The window attention of one block as a global attention over the grid's tokens: (allowed
    (N, N), additive bias (heads, N, N)). Token n sits at (n // grid, n % grid); the shifted block
    rolls the grid by (-shift, -shift), so the token lands at ((r - s) mod grid, (c - s) mod grid);
    two tokens attend to each other iff they share a window of the rolled grid and, shifted, a
    region (row bands [0, grid - w), [grid - w, grid - s), [grid - s, grid), the same for columns);
    the bias is the table row of their relative position inside the window."""
    n = torch.arange(grid * grid)
    r, c = (n // grid - shift) % grid, (n % grid - shift) % grid
    allowed = ((r // window)[:, None] == (r // window)[None, :]) & ((c // window)[:, None] == (c // window)[None, :])
    if shift:
        def band(p):
            return (p >= grid - window).long() + (p >= grid - shift).long()
        allowed &= (band(r)[:, None] == band(r)[None, :]) & (band(c)[:, None] == band(c)[None, :])
    wr, wc = r % window, c % window
    index = (wr[:, None] - wr[None, :] + window - 1) * (2 * window - 1) + (wc[:, None] - wc[None, :] + window - 1)
    bias = P[pre + "relative_position_bias_table"][index].permute(2, 0, 1)
    return allowed, bias


def swin_attention_branch(P, pre, x, heads, grid, window, shift):
    allowed, bias = swin_window_bias(P, pre, grid, window, shift)
    h = layer_norm(x, P[pre + "norm.weight"], P[pre + "norm.bias"], 1e-5)
    return multi_head(P, pre, h, heads, allowed, bias)


def patch_merging(P, pre, x1, x2, grid):
    """(x1 + x2) / 2 -> per 2x2 neighbourhood the tokens (2i, 2j), (2i+1, 2j), (2i, 2j+1), (2i+1, 2j+1)
    concatenated -> LayerNorm -> linear without bias."""
    x = (x1 + x2) / 2
    b, _, dim = x.shape
    x = x.reshape(b, grid // 2, 2, grid // 2, 2, dim)  # (b, i, row offset, j, column offset, dim)
    x = x.permute(0, 1, 3, 4, 2, 5).reshape(b, (grid // 2) ** 2, 4 * dim)  # column offset major
    return linear(layer_norm(x, P[pre + "norm.weight"], P[pre + "norm.bias"], 1e-5), P[pre + "reduction.weight"])


@pytest.mark.parametrize("engine", CPU_ENGINES)
@pytest.mark.parametrize("window", [4, 2])
def test_revswin_forward(window, engine):
    # img 32, patch 4: stage 1 on an 8x8 grid (its second block shifted by window // 2), patch
    # merging, stage 2 on 4x4 (window 4: global attention, never shifted; window 2: shifted by 1).
    embed, heads, img, patch = 16, (2, 4), 32, 4
    model = rk.models.RevSwin(embed_dim=embed, depths=(2, 2), num_heads=heads, num_classes=5, img_size=img,
                              patch_size=patch, window_size=window, mlp_ratio=2.0, drop_path_rate=0.2,
                              engine=engine)
    model = randomize(model).double().eval()
    P = Params(model)
    images = torch.randn(2, 3, img, img, dtype=torch.float64)
    x = layer_norm(patch_tokens(P, "segments.0.proj.", images, patch), P["segments.0.norm.weight"],
                   P["segments.0.norm.bias"], 1e-5)
    x1 = x2 = x
    grid = img // patch
    for stage, segment in ((0, 1), (1, 3)):
        if stage:
            x1 = x2 = patch_merging(P, "segments.2.", x1, x2, grid)
            grid //= 2
        w = min(window, grid)
        for j in range(2):
            shift = w // 2 if j % 2 and grid > window else 0
            pre = f"segments.{segment}.blocks.{j}."
            x1 = x1 + swin_attention_branch(P, pre + "f.", x2, heads[stage], grid, w, shift)
            x2 = x2 + mlp_branch(P, pre + "g.", x1, 1e-5, "none")
    pooled = layer_norm((x1 + x2) / 2, P["segments.4.norm.weight"], P["segments.4.norm.bias"], 1e-5).mean(1)
    expected = linear(pooled, P["segments.4.fc.weight"], P["segments.4.fc.bias"])
    P.assert_all_read()
    assert model.layout == "S r r D r r H"
    assert_close(model(images), expected, "RevSwin logits")


# ---------------------------------------------------------------------------------------------
# RevNet
# ---------------------------------------------------------------------------------------------

def conv(P, pre, x, stride=1):
    weight = P[pre + "weight"]
    return F.conv2d(x, weight, P.get(pre + "bias"), stride=stride, padding=weight.shape[-1] // 2)


def batch_norm(P, pre, x, train, eps=1e-5):
    if train:  # batch statistics (biased variance)
        mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
    else:
        mean, var = P[pre + "running_mean"], P[pre + "running_var"]
    shape = (1, -1, 1, 1)
    return ((x - mean.view(shape)) / torch.sqrt(var.view(shape) + eps) * P[pre + "weight"].view(shape)
            + P[pre + "bias"].view(shape))


def basic_residual(P, pre, x, train):
    """conv3x3-BN-ReLU-conv3x3-BN."""
    h = torch.relu(batch_norm(P, pre + "bn1.", conv(P, pre + "conv1.", x), train))
    return batch_norm(P, pre + "bn2.", conv(P, pre + "conv2.", h), train)


def bottleneck_residual(P, pre, x, train, stride=1):
    """conv1x1-BN-ReLU-conv3x3(stride)-BN-ReLU-conv1x1-BN."""
    h = torch.relu(batch_norm(P, pre + "bn1.", conv(P, pre + "conv1.", x), train))
    h = torch.relu(batch_norm(P, pre + "bn2.", conv(P, pre + "conv2.", h, stride), train))
    return batch_norm(P, pre + "bn3.", conv(P, pre + "conv3.", h), train)


def projection(P, pre, x, train, stride):
    """1x1 strided conv + BN."""
    return batch_norm(P, pre + "1.", conv(P, pre + "0.", x, stride), train)


def revnet_reference(P, block, layout, images, stem, train):
    """`layout`: the stages as the RevNet docstring lists them, each (kind, state_dict prefix, stride)."""
    x1 = x2 = None
    for kind, pre, stride in layout:
        if kind == "S":  # conv - BN - ReLU [- max-pool 3x3/2], split into the channel halves
            h = torch.relu(batch_norm(P, pre + "bn.", conv(P, pre + "conv.", images, stride), train))
            if stem == "imagenet":
                h = F.max_pool2d(h, 3, stride=2, padding=1)
            half = h.shape[1] // 2
            x1, x2 = h[:, :half], h[:, half:]
        elif kind == "r":  # (y1, y2) = (x2, x1 + F(x2))
            f = basic_residual if block == "basic" else bottleneck_residual
            x1, x2 = x2, x1 + f(P, pre + "f.", x2, train)
        elif kind == "D" and block == "basic":  # h = BN(conv3x3_s(x2)); (h, P(x1) + BN(conv3x3(relu(h))))
            h = batch_norm(P, pre + "bn1.", conv(P, pre + "conv1.", x2, stride), train)
            y2 = projection(P, pre + "shortcut.", x1, train, stride) + batch_norm(
                P, pre + "bn2.", conv(P, pre + "conv2.", torch.relu(h)), train)
            x1, x2 = h, y2
        elif kind == "D":  # (Q(x2), P(x1) + F(x2)), F a strided bottleneck
            x1, x2 = (projection(P, pre + "carry.", x2, train, stride),
                      projection(P, pre + "shortcut.", x1, train, stride)
                      + bottleneck_residual(P, pre + "f.", x2, train, stride))
        else:  # H: linear(global average pool(cat(x1, x2)))
            pooled = torch.cat([x1, x2], dim=1).mean((2, 3))
            return linear(pooled, P[pre + "fc.weight"], P[pre + "fc.bias"])


REVNET_CASES = {
    # block, layers, stem, input side, layout (kind, state_dict prefix, stride)
    "basic": ("basic", (2, 2, 1, 1), "cifar", 16, [
        ("S", "segments.0.", 1), ("r", "segments.1.blocks.0.", 1), ("r", "segments.1.blocks.1.", 1),
        ("D", "segments.2.", 2), ("r", "segments.3.blocks.0.", 1), ("D", "segments.4.", 2),
        ("D", "segments.5.", 2), ("H", "segments.6.", 1)]),
    "bottleneck": ("bottleneck", (2, 1, 1, 1), "imagenet", 32, [
        ("S", "segments.0.", 2), ("D", "segments.1.", 1), ("r", "segments.2.blocks.0.", 1),
        ("D", "segments.3.", 2), ("D", "segments.4.", 2), ("D", "segments.5.", 2), ("H", "segments.6.", 1)]),
}


@pytest.mark.parametrize("case,mode,engine,conv_bias", [
    ("basic", "eval", "sequential", False),
    ("basic", "eval", "autograd", True),
    ("basic", "train", "sequential", True),  # BatchNorm on batch statistics (the fused op)
    ("bottleneck", "eval", "sequential", False),
])
def test_revnet_forward(case, mode, engine, conv_bias):
    block, layers, stem, side, layout = REVNET_CASES[case]
    model = rk.models.RevNet(block, layers, num_classes=5, stem=stem, engine=engine, conv_bias=conv_bias)
    model = randomize(model).double().train(mode == "train")
    assert model.layout == " ".join(kind for kind, _, _ in layout)
    P = Params(model)
    images = torch.randn(2, 3, side, side, dtype=torch.float64)
    expected = revnet_reference(P, block, layout, images, stem, mode == "train")
    P.assert_all_read(ignore=("num_batches_tracked", "running_mean", "running_var") if mode == "train"
                      else ("num_batches_tracked",))
    assert_close(model(images), expected, f"RevNet ({case}) logits")
