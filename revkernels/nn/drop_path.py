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

    The forward reads the rate as 0-d float64 CPU tensors (``_rate``, ``_keep``: p and 1 - p, the
    same values in the same float32 arithmetic as the Python floats) and whether it is active as a
    flag: code compiled by torch.compile then takes the rate as a graph input, so the blocks of a
    stochastic-depth schedule (a rate per block) share one graph instead of each compiling its own
    (Dynamo guards on a Python float attribute's value). Set `p` to change the rate.
    """

    draws_with_symbolic_sizes = True  # (the compiled engine's branch steps may then take any shape)

    def __init__(self, p=0.0):
        super().__init__()
        self.p = p

    @property
    def p(self):
        return self._p

    @p.setter
    def p(self, value):
        self._p = check_drop_probability(value, "DropPath's p")
        self._active = self._p > 0.0
        self._rate = torch.tensor(self._p, dtype=torch.float64)
        self._keep = torch.tensor(1.0 - self._p, dtype=torch.float64)

    def __setstate__(self, state):
        # A DropPath pickled before the rate became a property kept `p` in its __dict__
        p = state.pop("p", None)
        super().__setstate__(state)
        if p is not None:
            self.p = p

    def draws_random(self):
        """Whether a forward now draws a mask (the engines replay randomness only then)."""
        return self.training and self._active

    def sample_scale(self, x):
        """The per-sample multiplier (shape (N, 1, ..., 1), x's dtype), or None when inactive."""
        if not (self.training and self._active):
            return None
        keep = torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), device=x.device) >= self._rate
        return keep.to(x.dtype) / self._keep

    def forward(self, x):
        scale = self.sample_scale(x)
        return x if scale is None else x * scale

    def extra_repr(self):
        return f"p={self.p}"
