r"""Exact mode: the streams between blocks in fixed point, so the rebuild returns the forward's
inputs bit for bit (``ReversibleSequential(..., exact=True)``).

The streams are int64 tensors X holding x = X · 2^-b (b = ``seq.exact_bits``, 32 by default: values
up to 2^30 in magnitude, a grid of 2^-32). F and G see the streams' float views, in the dtype of
the run's input, and their outputs are added rounded to the grid (`revkernels.ops.fixed_point`)::

    forward   Y1 = X1 + q(F(view(X2)))        rebuild   X2 = Y2 - q(G(view(Y1)))
              Y2 = X2 + q(G(view(Y1)))                  X1 = Y1 - q(F(view(X2)))

An integer sum is exact, so the rebuild subtracts what the forward added whenever F and G
recompute the same bits from the same input, which the engines arrange (replayed randomness, the
forward's autocast state, the same kernels). The run takes and returns float tensors: the input is
rounded onto the grid, the output is the view of the last streams.

Gradient: that of the same network with every branch output (and the input) rounded to the grid,
the rounding's derivative taken as 1 (straight-through). The autograd engine in exact mode
(`run_exact_autograd`) is the reference every memory-saving engine reproduces.

Overflow: a value that does not fit (|x| >= 2^(62-b), inf or NaN) is flagged by the ops; the run
reads the flags once after its forward and raises `OverflowError` naming the first block that
overflowed, so no wrapped integer is ever returned.

A block runs in exact mode through its F and G (``block.f``, ``block.g``) and the coupling it
declares (``coupling = "full"`` or ``"half"``): the generic steps below, or steps of its own on the
fixed-point streams (`RevTransformerBlock`'s fused ones; see `ExactSteps`).
"""
from dataclasses import dataclass

import torch

from revkernels.engine.state import NO_CONTEXT, BlockState, RngState, cuda_devices_of, maybe_replay
from revkernels.engine.structure import (buffers_as_before, buffers_kept, check_residual, coupling_kind,
                                         recompute_context)
from revkernels.nn.reversible import BlockRecompute, HalfCouplingBlock, ReversibleBlock, _call_with_aliases, \
    takes_missing_dy2
from revkernels.ops.fixed_point import (fixed_point_add, fixed_point_from_float, fixed_point_sub,
                                        fixed_point_view)

_INPUT = "the run's input"


class FixedPointStreams:
    """The fixed-point format of one call of an exact run (fraction `bits`, float views in `dtype`)
    and its overflow flags. Keeps the views of the last few streams it made, so a step reading a
    stream the previous step wrote reuses its view instead of converting again."""

    def __init__(self, bits, dtype):
        self.bits, self.dtype = bits, dtype
        self._flags = []  # (label, 0-dim bool tensor)
        self._views = []  # (stream, its view), the most recent last
        self.outputs = None  # a memory-saving run's int64 output streams, once it ran

    def _keep(self, view, stream, flag, label):
        if label is not None:
            self._flags.append((label, flag))
        return view, self.remember(view, stream)

    def remember(self, view, stream):
        """Keeps `view` as `stream`'s (a reshaped pair the next step reads); returns `stream`."""
        self._views = [*self._views[-3:], (stream, view)]
        return stream

    def enter(self, x, label=_INPUT):
        """``(view, stream)`` of a float input rounded onto the grid."""
        view, stream, flag = fixed_point_from_float(x, self.bits)
        return self._keep(view, stream, flag, label)

    def view(self, stream):
        for kept, view in reversed(self._views):
            if kept is stream:
                return view
        return fixed_point_view(stream, self.bits, self.dtype)

    def add(self, x, f, label):
        """``(view(Y), Y)`` with Y = X + q(f); an overflow is flagged for `label`."""
        return self._keep(*fixed_point_add(x, f, self.bits, self.dtype), label)

    def sub(self, y, f, label=None):
        """``(view(X), X)`` with X = Y - q(f) (a rebuild: it reproduces values the forward checked)."""
        return self._keep(*fixed_point_sub(y, f, self.bits, self.dtype), label)

    def raise_on_overflow(self):
        """Raises `OverflowError` naming the first value that did not fit since the last call (one
        read of the device for all the flags)."""
        flags, self._flags = self._flags, []
        if not flags:
            return
        bad = torch.stack([flag for _, flag in flags])
        if not bad.any():
            return
        label = flags[int(bad.nonzero()[0, 0])][0]
        limit = 62 - self.bits
        raise OverflowError(
            f"revkernels: exact mode: {label} made a value that does not fit the fixed-point streams (|x| must "
            f"be < 2^{limit} with exact_bits={self.bits}; or a branch returned inf/NaN). Lower exact_bits for a "
            "larger range, or check the block for a blow-up")

    def forget_views(self):
        """Drops the views kept for the next step (a finished forward: they are not saved)."""
        self._views = []

    def steps(self, blocks, first=0):
        """Each block's steps on these streams (`ExactSteps`), in order; `first`: the index of
        blocks[0] in its run (what an overflow names)."""
        return [ExactSteps(block, self, first + i) for i, block in enumerate(blocks)]

    def run_autograd(self, blocks, x1, x2, context, fixed=None, first=0):
        """The autograd engine's run in exact mode (`run_exact_autograd`)."""
        return run_exact_autograd(blocks, x1, x2, context, self, fixed, first)


def check_exact_block(block, index):
    """TypeError unless `block` can run in exact mode: a declared coupling of its F (and G)."""
    kind = coupling_kind(block)
    if kind not in ("full", "half"):
        raise TypeError(f"revkernels: exact mode runs each block's F and G on fixed-point streams, but blocks[{index}] "
                        f"({type(block).__name__}) has a forward step of its own and declares no coupling "
                        "(a class attribute coupling = 'full' or 'half')")
    return kind


@dataclass
class ExactRecompute:
    """A block input rebuilt on the fixed-point streams (`x1`, `x2`: int64) with the local graphs
    of its branches on their float views (`local`, what the generic gradient steps read)."""

    x1: torch.Tensor
    x2: torch.Tensor
    local: BlockRecompute


class ExactSteps:
    """The steps of `block` (blocks[`index`] of a run) on `streams`: what the engines' walkers and
    forward loops call in exact mode instead of the block's own steps (same signatures, int64
    streams in and out, float grads)."""

    def __init__(self, block, streams, index):
        self.block, self.streams = block, streams
        self.kind = check_exact_block(block, index)
        self.label = f"blocks[{index}] ({type(block).__name__})"
        # A block may step the fixed-point streams itself: ``forward_with_state_exact(x1, x2,
        # preserve_rng_state, context, streams, label)`` and ``recompute_exact(y1, y2, state,
        # context, streams)`` (whose recompute its ``grads`` takes), each returning None where it
        # does not apply
        self.fused_forward = getattr(block, "forward_with_state_exact", None)
        self.fused_recompute = getattr(block, "recompute_exact", None)

    def forward_with_state(self, x1, x2, preserve_rng_state=True, context=NO_CONTEXT):
        block, streams = self.block, self.streams
        if self.fused_forward is not None:  # a block's own exact steps (RevTransformerBlock's fused ones)
            out = self.fused_forward(x1, x2, preserve_rng_state, context, streams, self.label)
            if out is not None:
                return out
        keep = preserve_rng_state and block.draws_random()
        devices = cuda_devices_of(x1, x2) if keep else ()
        rng_f = RngState(devices) if keep else None
        v2 = streams.view(x2)
        f = block.f(v2, **context)
        check_residual(f, v2, "f", "x1")
        v1, y1 = streams.add(x1, f, self.label)
        if self.kind == "half":
            return x2, y1, BlockState(rng_f, None) if keep else None
        rng_g = RngState(devices) if keep else None
        g = block.g(v1, **context)
        check_residual(g, v1, "g", "x2")
        _, y2 = streams.add(x2, g, self.label)
        return y1, y2, BlockState(rng_f, rng_g) if keep else None

    def inverse(self, y1, y2, state=None, context=NO_CONTEXT):
        """The block's input streams from its output streams, without autograd."""
        changed = getattr(state, "buffers", ())
        with torch.no_grad(), buffers_kept(self.block) if state is None else buffers_as_before(changed):
            rec = self.recompute(y1, y2, state, context, grad=False)
        return rec.x1, rec.x2

    def recompute(self, y1, y2, state=None, context=NO_CONTEXT, grad=True):
        block, streams = self.block, self.streams
        if self.fused_recompute is not None:
            rec = self.fused_recompute(y1, y2, state, context, streams)
            if rec is not None:
                return rec
        with torch.set_grad_enabled(grad), recompute_context(block):
            if self.kind == "half":  # (x1, x2) = (Y2 - q(F(view(Y1))), Y1)
                x2_leaf = streams.view(y1).detach().requires_grad_()
                with maybe_replay(None if state is None else state.rng_f):
                    f_out, f_aliases = _call_with_aliases(block.f, x2_leaf, context)
                v1, x1 = streams.sub(y2, f_out.detach())
                return ExactRecompute(x1, y1, BlockRecompute(x1=v1, x2=x2_leaf, y1=None, f_out=f_out, g_out=None,
                                                             f_aliases=f_aliases, g_aliases={}))
            y1_leaf = streams.view(y1).detach().requires_grad_()
            with maybe_replay(None if state is None else state.rng_g):
                g_out, g_aliases = _call_with_aliases(block.g, y1_leaf, context)
            v2, x2 = streams.sub(y2, g_out.detach())
            x2_leaf = v2.detach().requires_grad_()
            with maybe_replay(None if state is None else state.rng_f):
                f_out, f_aliases = _call_with_aliases(block.f, x2_leaf, context)
            v1, x1 = streams.sub(y1, f_out.detach())
        return ExactRecompute(x1, x2, BlockRecompute(x1=v1, x2=x2_leaf, y1=y1_leaf, f_out=f_out, g_out=g_out,
                                                     f_aliases=f_aliases, g_aliases=g_aliases))

    @takes_missing_dy2
    def grads(self, rec, dy1, dy2):
        # the generic VJP of the coupling on the float views
        if not isinstance(rec, ExactRecompute):  # the block's own exact recompute: its own grads
            return self.block.grads(rec, dy1, dy2)
        generic = HalfCouplingBlock.grads if self.kind == "half" else ReversibleBlock.grads
        return generic(self.block, rec.local, dy1, dy2)


class _FixedPointCoupling(torch.autograd.Function):
    """``(view(Y), Y)`` with Y = X + q(f), differentiable in the previous view `x_view` and in `f`
    (straight-through: d x_view = d f = d view(Y))."""

    @staticmethod
    def forward(ctx, x_view, f, x, streams, label):
        view, y = streams.add(x, f, label)
        ctx.mark_non_differentiable(y)
        ctx.f_dtype = f.dtype
        return view, y

    @staticmethod
    def backward(ctx, d_view, _):
        return d_view, d_view.to(ctx.f_dtype), None, None, None


class _FixedPointInput(torch.autograd.Function):
    """``(view(q(x)), q(x))``, differentiable in `x` (straight-through)."""

    @staticmethod
    def forward(ctx, x, streams, label):
        view, stream = streams.enter(x, label)
        ctx.mark_non_differentiable(stream)
        return view, stream

    @staticmethod
    def backward(ctx, d_view, _):
        return d_view, None, None


def run_exact_autograd(blocks, x1, x2, context, streams, fixed=None, first=0):
    """The exact-mode reference: every block under ordinary autograd on fixed-point streams
    (straight-through gradients); float views of the last streams out. `fixed`: the int64 streams
    whose views x1 and x2 are (blocks[`first`:] of a run going on from the memory-saving node of
    the blocks before, under a memory budget), else x1 and x2 are rounded onto the grid."""
    steps = streams.steps(blocks, first)
    if fixed is None:
        (v1, s1), (v2, s2) = _FixedPointInput.apply(x1, streams, _INPUT), _FixedPointInput.apply(x2, streams, _INPUT)
    else:
        (v1, s1), (v2, s2) = (x1, fixed[0]), (x2, fixed[1])
    for step in steps:
        block = step.block
        f = block.f(v2, **context)
        check_residual(f, v2, "f", "x1")
        n1, t1 = _FixedPointCoupling.apply(v1, f, s1, streams, step.label)
        if step.kind == "half":
            (v1, s1), (v2, s2) = (v2, s2), (n1, t1)
            continue
        g = block.g(n1, **context)
        check_residual(g, n1, "g", "x2")
        (v1, s1), (v2, s2) = (n1, t1), _FixedPointCoupling.apply(v2, g, s2, streams, step.label)
    streams.raise_on_overflow()
    return v1, v2
