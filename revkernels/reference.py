r"""The reversible backward written as its equations: the specification the engines implement.

Nothing here is fast or fused; it is short so that it can be read against the math, used as an
oracle in tests and timed as the minREV-style baseline of the benchmarks.

Coupling (`Coupling`, F and G modules whose outputs have their input's shape)::

    forward    y1 = x1 + F(x2)              inverse    x2 = y2 - G(y1)
               y2 = x2 + G(y1)                         x1 = y1 - F(x2)

Vector-Jacobian product: given dy1 = dL/dy1 and dy2 = dL/dy2, the grads of the block's outputs,
rebuild (x1, x2) with the inverse while recomputing G(y1) and F(x2) under autograd, then::

    dy1'  = dy1 + (dG/dy1)^T dy2            (y1 reaches L directly and through G)
    dx1   = dy1'
    dx2   = dy2 + (dF/dx2)^T dy1'
    dθ_G  = (dG/dθ_G)^T dy2
    dθ_F  = (dF/dθ_F)^T dy1'

Half coupling (`HalfCoupling`, one module F; PETRA's reversible stage, RevNet's half block)::

    forward    (y1, y2) = (x2, x1 + F(x2))  inverse    (x1, x2) = (y2 - F(y1), y1)
    VJP        dx1 = dy2,   dx2 = dy1 + (dF/dx2)^T dy2,   dθ_F = (dF/dθ_F)^T dy2

A stack (`ReferenceSequential`) runs its blocks in one `torch.autograd.Function`,
`ReversibleFunction`: the forward runs every block without a graph and saves only the last
outputs; the backward walks the blocks last to first, each block's `backward_step` rebuilding its
inputs from its outputs and applying the VJP above, so the memory kept for backward does not grow
with depth. As in minREV, the parameter grads dθ are accumulated into each parameter's ``.grad``
inside the backward (call ``loss.backward()``; ``torch.autograd.grad`` with respect to parameters
does not see them), while dx1 and dx2 flow on through autograd.

Contract: F and G are deterministic (no dropout or other random draws: the recompute would draw
again) and keep no state that the forward changes (BatchNorm in training mode would update its
running statistics twice). The recompute runs under the forward's autocast state.
"""
import torch
from torch import nn


class Coupling(nn.Module):
    """y1 = x1 + F(x2), y2 = x2 + G(y1) (see the module docstring)."""

    def __init__(self, f, g):
        super().__init__()
        self.f, self.g = f, g

    def forward(self, x1, x2):
        y1 = x1 + self.f(x2)
        return y1, x2 + self.g(y1)

    def inverse(self, y1, y2):
        x2 = y2 - self.g(y1)
        return y1 - self.f(x2), x2

    def backward_step(self, y1, y2, dy1, dy2):
        """(x1, x2, dx1, dx2) from the outputs and their grads; F's and G's parameter grads are
        accumulated into their ``.grad``."""
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_()
            g = self.g(y1)
            torch.autograd.backward(g, dy2.to(g.dtype))  # dθ_G; y1.grad = (dG/dy1)^T dy2
        with torch.no_grad():
            x2 = y2 - g
            dy1 = dy1 + _grad_of(y1)
        with torch.enable_grad():
            x2.requires_grad_()
            f = self.f(x2)
            torch.autograd.backward(f, dy1.to(f.dtype))  # dθ_F; x2.grad = (dF/dx2)^T dy1'
        with torch.no_grad():
            return y1.detach() - f, x2.detach(), dy1, dy2 + _grad_of(x2)


class HalfCoupling(nn.Module):
    """(y1, y2) = (x2, x1 + F(x2)) (see the module docstring)."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, x1, x2):
        return x2, x1 + self.f(x2)

    def inverse(self, y1, y2):
        return y2 - self.f(y1), y1

    def backward_step(self, y1, y2, dy1, dy2):
        """(x1, x2, dx1, dx2) from the outputs and their grads; F's parameter grads are accumulated
        into their ``.grad``."""
        with torch.enable_grad():
            x2 = y1.detach().requires_grad_()
            f = self.f(x2)
            torch.autograd.backward(f, dy2.to(f.dtype))  # dθ_F; x2.grad = (dF/dx2)^T dy2
        with torch.no_grad():
            return y2 - f, x2.detach(), dy2, dy1 + _grad_of(x2)


def _grad_of(leaf):
    """The grad autograd accumulated into `leaf` (zeros where the output did not depend on it)."""
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad


class ReversibleFunction(torch.autograd.Function):
    """A stack of blocks (each with ``forward`` and ``backward_step``) as one autograd node that
    saves only its outputs."""

    @staticmethod
    def forward(ctx, x1, x2, blocks):
        with torch.no_grad():
            for block in blocks:
                x1, x2 = block(x1, x2)
        ctx.blocks = blocks
        # The recompute runs under the forward's autocast state (the backward does not inherit it).
        ctx.device_type = x1.device.type
        ctx.autocast = torch.is_autocast_enabled(ctx.device_type)
        ctx.autocast_dtype = torch.get_autocast_dtype(ctx.device_type)
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        with torch.autocast(ctx.device_type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            for block in reversed(ctx.blocks):
                y1, y2, dy1, dy2 = block.backward_step(y1, y2, dy1, dy2)
        return dy1, dy2, None


class ReferenceSequential(nn.Module):
    """Blocks (`Coupling`, `HalfCoupling`, or any module with ``forward(x1, x2)`` and
    ``backward_step(y1, y2, dy1, dy2)``) run through `ReversibleFunction`: ``(y1, y2) = seq(x1, x2)``."""

    def __init__(self, *blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x1, x2):
        if torch.is_grad_enabled() and not (x1.requires_grad or x2.requires_grad):
            # autograd calls a Function's backward only for an input that requires grad: without
            # one, the parameters would get no grads (the caller's tensor is left as it is).
            x1 = x1.detach().requires_grad_()
        return ReversibleFunction.apply(x1, x2, tuple(self.blocks))

    def inverse(self, y1, y2):
        """(x1, x2) rebuilt from the outputs, last block first, without a graph."""
        with torch.no_grad():
            for block in reversed(self.blocks):
                y1, y2 = block.inverse(y1, y2)
        return y1, y2
