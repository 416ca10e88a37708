r"""Rev-Swin: a Swin Transformer (Liu et al., ICCV 2021) whose blocks are reversible.

    image -> S  4x4 patch embedding (conv, stride 4) + LayerNorm -> two copies (x1 = x2 = tokens)
          -> r  reversible Swin blocks of stage 1 (one ReversibleSequential, engine of your choice)
          -> D  patch merging -> r  stage 2 -> D -> r  stage 3 -> D -> r  stage 4
          -> H  stream fusion (y1 + y2) / 2 -> LayerNorm -> mean over tokens -> linear head

    r  ReversibleBlock(F, G):  y1 = x1 + F(x2),  y2 = x2 + G(y1)        (streams (batch, H*W, C))
       F = drop_path(proj(W-MSA(LN(x))))   window multi-head self-attention with a relative
           position bias; every second block of a stage shifts the windows by (w // 2, w // 2)
           (cyclic shift, attention masked between tokens that were not adjacent before it)
       G = drop_path(fc2(gelu(fc1(LN(x)))))                              (`MlpBranch`, ratio 4)
    D  non-reversible: fuse the streams (x1 + x2) / 2, concatenate each 2x2 neighbourhood
       (4C), LayerNorm, linear 4C -> 2C without bias; the result feeds both streams.

A Swin block ``x = x + F(x); x = x + G(x)`` becomes one coupling: F and G are exactly Swin's
attention and MLP residual branches, acting on two streams of the stage's width (as Rev-ViT does),
and the streams are fused by averaging where a stage ends (as `RevViT` does before its head). With
a memory-saving engine the stem and the merging stages keep only their input and recompute in the
backward (`revkernels.engine.recompute.run_recomputed`), so no activation inside a stage is stored.

Window attention on a stage of H x W tokens with window w (= min(window_size, H): a stage no
larger than the window attends globally and never shifts, as in Swin): tokens are split into
(H/w)(W/w) windows of N = w*w tokens, attention runs inside each window with the bias
``B[h, i, j] = table[(r_i - r_j + w - 1) * (2w - 1) + (c_i - c_j + w - 1), h]`` for tokens i, j at
(r, c) in the window. A shifted block rolls the token grid by (-s, -s), s = w // 2, first and back
after; in the rolled grid, rows (and columns) [0, H - w), [H - w, H - s), [H - s, H) are distinct
regions and a token attends only to tokens of its own region pair (masked with -inf, an exact zero
weight, where Swin's code adds -100).

Sizes (patch 4, window 7, MLP ratio 4): Swin-T 96 wide, depths (2, 2, 6, 2), heads (3, 6, 12, 24);
Swin-S 96, (2, 2, 18, 2), (3, 6, 12, 24); Swin-B 128, (2, 2, 18, 2), (4, 8, 16, 32). The layers
are Swin's, one for one (the second stream adds no parameter), so at 224 x 224 with 1000 classes
the parameter counts are Swin's: 28,288,354 / 49,606,258 / 87,768,224.

PETRA's view of the model is ``model.stages`` (stem, every block, merging stages, head, in order),
as for `RevNet`: ``stem(image) -> (x1, x2)``, ``stage(x1, x2) -> (y1, y2)``, ``head(x1, x2) ->
logits``; the reversible stages are the `ReversibleBlock`s the forward's runs hold.
"""
import torch
from torch import nn

from revkernels.engine.recompute import run_recomputed
from revkernels.nn.attention import scaled_dot_product_attention
from revkernels.nn.drop_path import DropPath, check_drop_probability
from revkernels.models.staged import StagedModel, check_images, check_positive_int, streams_in
from revkernels.nn.reversible import ReversibleBlock, ReversibleSequential, check_streams
from revkernels.nn.revvit import MlpBranch

CONFIGS = {
    "swin_t": dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    "swin_s": dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "swin_b": dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
}
PATCH = 4


def window_partition(x, window_size):
    """(batch, H, W, C) -> (batch, (H/w) * (W/w), w * w, C): windows in raster order, tokens in
    raster order inside each window."""
    b, h, w, c = x.shape
    x = x.view(b, h // window_size, window_size, w // window_size, window_size, c)
    windows = (h // window_size) * (w // window_size)  # (not -1: a batch of 0 has no size to infer it from)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, windows, window_size * window_size, c)


def window_reverse(windows, window_size, height, width):
    """Inverse of `window_partition`: (batch, windows, w * w, C) -> (batch, height, width, C)."""
    b, c = windows.shape[0], windows.shape[-1]
    x = windows.view(b, height // window_size, width // window_size, window_size, window_size, c)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(b, height, width, c)


def relative_position_index(window_size):
    """(N, N) long, N = w * w: row of the bias table for the token pair (i, j) of a window,
    ``(r_i - r_j + w - 1) * (2w - 1) + (c_i - c_j + w - 1)``."""
    pos = torch.arange(window_size)
    rows = pos.repeat_interleave(window_size)
    cols = pos.repeat(window_size)
    dr = rows[:, None] - rows[None, :] + window_size - 1
    dc = cols[:, None] - cols[None, :] + window_size - 1
    return dr * (2 * window_size - 1) + dc


def shifted_window_mask(height, width, window_size, shift_size):
    """(windows, N, N) bool, True where token i of a window of the rolled grid may attend to token j:
    both lie in the same region (row band and column band, module docstring)."""
    def bands(n):
        band = torch.zeros(n, dtype=torch.long)
        band[n - window_size:] = 1
        band[n - shift_size:] = 2
        return band

    region = (bands(height)[:, None] * 3 + bands(width)[None, :]).view(1, height, width, 1)
    region = window_partition(region, window_size).squeeze(-1)[0]
    return region[:, :, None] == region[:, None, :]


class WindowAttention(nn.Module):
    """F: LayerNorm -> (shifted) window multi-head self-attention with relative position bias ->
    proj -> drop-path, on a (batch, H*W, dim) stream of an H x W token grid."""

    def __init__(self, dim, resolution, num_heads, window_size, shift_size=0, drop_path=0.0, qkv_bias=True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"revkernels: dim ({dim}) must be divisible by num_heads ({num_heads})")
        height, width = resolution
        if height % window_size or width % window_size:
            raise ValueError(f"revkernels: the token grid {height}x{width} must be a multiple of window_size ({window_size})")
        if not 0 <= shift_size < window_size:
            raise ValueError(f"revkernels: shift_size must be in [0, window_size), got {shift_size}")
        self.dim, self.resolution, self.num_heads = dim, (height, width), num_heads
        self.window_size, self.shift_size = window_size, shift_size
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window_size - 1) ** 2, num_heads))
        self.proj = nn.Linear(dim, dim)
        self.drop_path = DropPath(drop_path)
        self.register_buffer("relative_position_index", relative_position_index(window_size), persistent=False)
        mask = shifted_window_mask(height, width, window_size, shift_size) if shift_size else None
        self.register_buffer("attn_mask", mask, persistent=False)

    def attention_bias(self):
        """Additive attention mask (windows * heads, N, N): the relative position bias, -inf where the
        shift mask forbids; (heads, N, N) without shift."""
        n = self.window_size ** 2
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        if self.attn_mask is None:
            return bias
        bias = bias.masked_fill(~self.attn_mask[:, None], float("-inf"))  # (windows, heads, N, N)
        return bias.reshape(-1, n, n)

    def forward(self, x):
        height, width = self.resolution
        if x.dim() != 3 or x.shape[1:] != (height * width, self.dim):
            raise ValueError(f"revkernels: WindowAttention input must be (batch, {height * width}, {self.dim}), "
                             f"got shape {tuple(x.shape)}")
        batch, s, heads = x.shape[0], self.shift_size, self.num_heads
        h = self.norm(x).view(batch, height, width, self.dim)
        if s:
            h = torch.roll(h, shifts=(-s, -s), dims=(1, 2))
        windows = window_partition(h, self.window_size)  # (batch, nW, N, dim)
        n_win, n = windows.shape[1], windows.shape[2]
        qkv = self.qkv(windows).view(batch, n_win, n, 3, heads, self.dim // heads)
        # Windows and heads share one dim so that the mask broadcasts over the batch only.
        q, k, v = qkv.permute(3, 0, 1, 4, 2, 5).reshape(3, batch, n_win * heads, n, self.dim // heads).unbind(0)
        bias = self.attention_bias()
        if self.attn_mask is None:
            bias = bias.repeat(n_win, 1, 1)
        o = scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        o = o.view(batch, n_win, heads, n, self.dim // heads).transpose(2, 3).reshape(batch, n_win, n, self.dim)
        o = window_reverse(self.proj(o), self.window_size, height, width)
        if s:
            o = torch.roll(o, shifts=(s, s), dims=(1, 2))
        return self.drop_path(o.reshape(batch, height * width, self.dim))

    def extra_repr(self):
        return (f"dim={self.dim}, resolution={self.resolution}, num_heads={self.num_heads}, "
                f"window_size={self.window_size}, shift_size={self.shift_size}")


class PatchEmbed(nn.Module):
    """Stem: image -> patch_size x patch_size conv (stride patch_size) -> LayerNorm -> (tokens, tokens)."""

    reversible = False
    kind = "stem"

    def __init__(self, img_size, patch_size, in_chans, dim):
        super().__init__()
        self.img_size = img_size
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.norm = nn.LayerNorm(dim)

    def forward(self, images):
        check_images(images, self.img_size)
        tokens = self.norm(self.proj(images).flatten(2).transpose(1, 2))
        return streams_in(self.proj.weight.dtype, tokens, tokens)


class PatchMerging(nn.Module):
    """Non-reversible stage: (x1 + x2) / 2 on an H x W grid of `dim` -> each 2x2 neighbourhood
    concatenated (4 * dim) -> LayerNorm -> linear to 2 * dim (no bias) -> (z, z) on H/2 x W/2."""

    reversible = False
    kind = "down"

    def __init__(self, dim, resolution):
        super().__init__()
        self.dim, self.resolution = dim, resolution
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x1, x2):
        check_streams(x1, x2)
        height, width = self.resolution
        if x1.dim() != 3 or x1.shape[1:] != (height * width, self.dim):
            raise ValueError(f"revkernels: PatchMerging input must be (batch, {height * width}, {self.dim}), "
                             f"got shape {tuple(x1.shape)}")
        x = ((x1 + x2) * 0.5).view(x1.shape[0], height, width, self.dim)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        z = self.reduction(self.norm(x.flatten(1, 2)))
        return streams_in(self.reduction.weight.dtype, z, z)


class Head(nn.Module):
    """(x1, x2) -> linear(mean over tokens(LayerNorm((x1 + x2) / 2)))."""

    reversible = False
    kind = "head"

    def __init__(self, dim, num_classes):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x1, x2):
        check_streams(x1, x2)
        return self.fc(self.norm((x1 + x2) * 0.5).mean(dim=1))


class RevSwin(StagedModel, nn.Module):
    """A Swin Transformer with reversible blocks (see the module docstring).

    Args:
        embed_dim: width of stage 1 (stage i has ``embed_dim * 2**i``).
        depths: Swin blocks per stage (one reversible block each).
        num_heads: attention heads per stage (same length as `depths`).
        num_classes: outputs of the linear head.
        img_size: side of the (square) input images; a multiple of `patch_size`, and each stage's
            token grid (img_size / patch_size / 2**i) a multiple of its window.
        patch_size, in_chans, mlp_ratio, qkv_bias: as in Swin (4, 3, 4.0, True).
        window_size: attention window side (clipped to the grid side for stages no larger).
        drop_path_rate: stochastic depth of the last block; it grows linearly from 0 over all blocks.
        engine: engine of every reversible run ("auto", the default, "sequential", "autograd", ...); see
            `set_engine`.
        exact: every reversible run in exact mode (fixed-point streams; see
            `revkernels.nn.ReversibleSequential`).

    Attributes:
        segments: the modules the forward runs, in order: stem, `ReversibleSequential` runs,
            merging stages, head.
        stages: the flat stage list for PETRA (the runs' blocks in place of the runs).
    """

    def __init__(self, embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), num_classes=1000, img_size=224,
                 patch_size=PATCH, window_size=7, mlp_ratio=4.0, drop_path_rate=0.1, in_chans=3, qkv_bias=True,
                 engine="auto", exact=False):
        super().__init__()
        for value, name in ((embed_dim, "embed_dim"), (num_classes, "num_classes"), (img_size, "img_size"),
                            (patch_size, "patch_size"), (window_size, "window_size"), (in_chans, "in_chans")):
            check_positive_int(value, name)
        depths, num_heads = tuple(depths), tuple(num_heads)
        if not depths or len(depths) != len(num_heads):
            raise ValueError(f"revkernels: depths and num_heads must be non-empty and equally long, "
                             f"got {depths!r} and {num_heads!r}")
        for i, (d, h) in enumerate(zip(depths, num_heads)):
            check_positive_int(d, f"depths[{i}]")
            check_positive_int(h, f"num_heads[{i}]")
        check_drop_probability(drop_path_rate, "drop_path_rate")
        if img_size % patch_size:
            raise ValueError(f"revkernels: img_size ({img_size}) must be a multiple of patch_size ({patch_size})")
        side = img_size // patch_size
        if side % 2 ** (len(depths) - 1):
            raise ValueError(f"revkernels: img_size / patch_size ({side}) must be divisible by "
                             f"2**{len(depths) - 1} (one halving per patch merging)")
        self.img_size = img_size

        total = sum(depths)
        rates = [drop_path_rate * k / max(total - 1, 1) for k in range(total)]
        segments = [PatchEmbed(img_size, patch_size, in_chans, embed_dim)]
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            dim, grid = embed_dim * 2 ** i, side // 2 ** i
            window = min(window_size, grid)
            if grid % window:
                raise ValueError(f"revkernels: stage {i + 1}'s token grid ({grid}x{grid} for img_size {img_size}) "
                                 f"must be a multiple of window_size ({window_size})")
            shift = window // 2 if grid > window_size else 0
            if dim % heads:
                raise ValueError(f"revkernels: stage {i + 1}'s width ({dim}) must be divisible by num_heads[{i}] ({heads})")
            blocks = []
            for j in range(depth):
                p = rates[sum(depths[:i]) + j]
                f = WindowAttention(dim, (grid, grid), heads, window, shift if j % 2 else 0, p, qkv_bias)
                blocks.append(ReversibleBlock(f, MlpBranch(dim, int(dim * mlp_ratio), p, eps=1e-5)))
            segments.append(ReversibleSequential(*blocks, engine=engine, exact=exact))
            if i < len(depths) - 1:
                segments.append(PatchMerging(dim, (grid, grid)))
        segments.append(Head(embed_dim * 2 ** (len(depths) - 1), num_classes))
        self.segments = nn.ModuleList(segments)
        self._engine = engine
        self._init_weights()

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, WindowAttention):
                nn.init.trunc_normal_(m.relative_position_bias_table, std=0.02)

    def forward(self, images):
        # With a memory-saving engine the stem and merging stages keep only their input and
        # recompute in the backward; the head's activations are stored (they are small).
        recompute = self.engine != "autograd"
        out = (images,)
        for segment in self.segments:
            if isinstance(segment, (ReversibleSequential, Head)) or not recompute:
                out = segment(*out)
            else:
                out = run_recomputed(segment, *out)
        return out


def revswin(name, num_classes=1000, img_size=224, window_size=7, drop_path_rate=0.1, engine="auto", exact=False,
            **overrides):
    """`RevSwin` of size `name` in {"swin_t", "swin_s", "swin_b"}; `overrides` replace any other
    `RevSwin` argument (e.g. ``embed_dim``, ``depths``, ``num_heads`` for small test models)."""
    if name not in CONFIGS:
        raise ValueError(f"revkernels: name must be one of {sorted(CONFIGS)}, got {name!r}")
    return RevSwin(**{**CONFIGS[name], **overrides}, num_classes=num_classes, img_size=img_size,
                   window_size=window_size, drop_path_rate=drop_path_rate, engine=engine, exact=exact)
