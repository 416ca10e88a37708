"""Rev-ViT: a vision transformer whose blocks are reversible (`RevViTBlock`).

    image -> 16x16 patch embedding + learned position embedding -> two copies (x1 = x2 = tokens)
          -> RevViTBlocks (one ReversibleSequential, engine of your choice)
          -> stream fusion (y1 + y2) / 2 -> LayerNorm -> mean over tokens -> linear head

No class token: the head pools the tokens, as Rev-ViT does. Stochastic depth grows linearly with
depth up to `drop_path_rate`. Sizes follow ViT: S/16 (384 wide, 12 blocks, 6 heads), B/16
(768, 12, 12), L/16 (1024, 24, 16).
"""
import torch
from torch import nn

from revkernels.models.staged import OneRunModel, check_images, check_positive_int
from revkernels.nn.drop_path import check_drop_probability
from revkernels.nn.reversible import ReversibleSequential
from revkernels.nn.revvit import RevViTBlock

CONFIGS = {
    "vit_s16": dict(dim=384, depth=12, heads=6),
    "vit_b16": dict(dim=768, depth=12, heads=12),
    "vit_l16": dict(dim=1024, depth=24, heads=16),
}
PATCH = 16


class RevViT(OneRunModel, nn.Module):
    def __init__(self, dim, depth, heads, num_classes=1000, img_size=224, patch_size=PATCH, in_chans=3,
                 mlp_ratio=4.0, drop_path_rate=0.0, engine="auto", exact=False):
        super().__init__()
        check_drop_probability(drop_path_rate, "drop_path_rate")
        check_positive_int(num_classes, "num_classes")
        if img_size % patch_size:
            raise ValueError(f"revkernels: img_size ({img_size}) must be a multiple of the patch size ({patch_size})")
        self.img_size = img_size
        self.patch_embed = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.randn(1, (img_size // patch_size) ** 2, dim) * 0.02)
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = ReversibleSequential(*[RevViTBlock(dim, heads, mlp_ratio, drop_path=r) for r in rates],
                                           engine=engine, exact=exact)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, images):
        check_images(images, self.img_size)
        tokens = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
        y1, y2 = self.blocks(tokens, tokens)
        return self.head(self.norm((y1 + y2) * 0.5).mean(dim=1))


def revvit(name, num_classes=1000, img_size=224, drop_path_rate=0.0, engine="auto", exact=False):
    """`RevViT` of size `name` in {"vit_s16", "vit_b16", "vit_l16"}; `exact`: fixed-point streams
    (`revkernels.nn.ReversibleSequential`'s exact mode)."""
    if name not in CONFIGS:
        raise ValueError(f"revkernels: name must be one of {sorted(CONFIGS)}, got {name!r}")
    return RevViT(**CONFIGS[name], num_classes=num_classes, img_size=img_size, drop_path_rate=drop_path_rate,
                  engine=engine, exact=exact)
