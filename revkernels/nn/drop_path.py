"""Stochastic depth: drops a residual branch for whole samples."""
import torch
from torch import nn


def check_drop_probability(value, name):
    """`value` as a float when it is a drop probability in [0, 1); otherwise a ValueError naming
    `name` (the caller's argument) and the value given."""
    if not 0.0 <= value < 1.0:  # NaN fails too
        raise ValueError(f"revkernels: {name} must be in [0, 1), got {value!r}")
    return float(value)


class DropPath(nn.Module):
    """Multiplies each sample (dim 0) by 0 with probability `p`, else by 1 / (1 - p).

    The keep mask is drawn from the global generator (one uniform per sample), so a reversible
    engine's RNG replay redraws the same mask in the recompute.
    """

    def __init__(self, p=0.0):
        super().__init__()
        self.p = check_drop_probability(p, "DropPath's p")

    def draws_random(self):
        """Whether a forward now draws a mask (the engines replay randomness only then)."""
        return self.training and self.p > 0.0

    def sample_scale(self, x):
        """The per-sample multiplier (shape (N, 1, ..., 1), x's dtype), or None when inactive."""
        if not self.training or self.p == 0.0:
            return None
        keep = torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), device=x.device) >= self.p
        return keep.to(x.dtype) / (1.0 - self.p)

    def forward(self, x):
        scale = self.sample_scale(x)
        return x if scale is None else x * scale

    def extra_repr(self):
        return f"p={self.p}"
