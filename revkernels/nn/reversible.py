r"""Reversible blocks and sequences (two-stream additive coupling).

    forward   y1 = x1 + F(x2)          inverse   x2 = y2 - G(y1)
              y2 = x2 + G(y1)                    x1 = y1 - F(x2)

A `ReversibleSequential` hands its blocks to an engine (`revkernels.engine`); the engines drive
each block through two steps that fused blocks may override:

    recompute(y1, y2, state, context) -> BlockRecompute   rebuild (x1, x2), keeping the local
                                                 graphs of G(y1) and F(x2) built under autograd
    grads(rec, dy1, dy2) -> BlockGrads           dy1' = dy1 + (dG/dy1)^T dy2
                                                 dx2  = dy2 + (dF/dx2)^T dy1',  dx1 = dy1'
                                                 and the parameter grads of F and G

Context: a run called as ``seq(x1, x2, **context)`` calls every F and G as ``f(x2, **context)``
and ``g(y1, **context)``; the steps take the keywords as one dict, `context`. Context tensors that
require grad are differentiated like parameters: the local graphs' `aliases` hold them too, so
`grads` returns their per-block grads among the parameter grads and the walker sums them.
"""
import contextlib
import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import _engine_run_backward
from torch.func import functional_call
from torch.nn.parameter import is_lazy

from revkernels.engine.state import (NO_CONTEXT, BlockState, RngState, call_with_context, check_context,
                                     check_context_grads, cuda_devices_of, grad_names, grad_tensors, maybe_replay,
                                     records_graph, with_grad_leaves)
from revkernels.engine.structure import (buffers_as_before, buffers_kept, cached, check_members, check_residual,
                                         detached_aliases, draws_random, module_input, param_slots,
                                         recompute_context, unique_grad_params)
from revkernels.ops.coupling import coupling_add, coupling_sub

_log = logging.getLogger("revkernels")


def check_streams(x1, x2, names=("x1", "x2"), fixed_point=False):
    """Raises TypeError/ValueError, naming the argument, unless x1 and x2 are matching float tensors
    (`fixed_point`: int64 fixed-point streams, what an exact run's steps make)."""
    for t, name in zip((x1, x2), names):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"revkernels: {name} must be a torch.Tensor, got {type(t).__name__}")
        if fixed_point and t.dtype != torch.int64:
            raise TypeError(f"revkernels: {name} must be an int64 fixed-point stream in exact mode (the int64 output "
                            f"of the forward's exact steps), got {t.dtype}")
        if not fixed_point and not t.is_floating_point():
            raise TypeError(f"revkernels: {name} must be a floating-point tensor, got {t.dtype}")
    a, b = names
    if x1.shape != x2.shape:
        raise ValueError(f"revkernels: {a} and {b} must have the same shape, got {tuple(x1.shape)} and {tuple(x2.shape)}")
    if x1.dtype != x2.dtype:
        raise ValueError(f"revkernels: {a} and {b} must have the same dtype, got {x1.dtype} and {x2.dtype}")
    if x1.device != x2.device:
        raise ValueError(f"revkernels: {a} and {b} must be on the same device, got {x1.device} and {x2.device}")


@dataclass
class BlockRecompute:
    """A rebuilt block input with the local graphs the gradient step differentiates."""

    x1: torch.Tensor
    x2: torch.Tensor  # leaf of F's local graph (requires grad)
    y1: torch.Tensor | None  # leaf of G's local graph (requires grad); None without G
    f_out: torch.Tensor
    g_out: torch.Tensor | None
    f_aliases: dict  # parameter (or context tensor) -> the tensor to differentiate for it in F's local graph
    g_aliases: dict


@dataclass
class BlockGrads:
    dx1: torch.Tensor
    dx2: torch.Tensor
    params: list  # parameters of F then G that require grad
    param_grads: list  # their grads (None where a parameter was unused)


def takes_missing_dy2(grads):
    """Marks a block's ``grads`` that takes ``dy2=None`` (the loss did not use the run's y2; see
    `revkernels.engine.sequential.block_grads`). A subclass's own ``grads`` gets zeros instead."""
    grads.takes_missing_dy2 = True
    return grads


class ReversibleBlock(nn.Module):
    """Additive coupling ``y1 = x1 + f(x2); y2 = x2 + g(y1)`` of two shape-preserving modules.

    Called directly it is an ordinary module (autograd stores its activations); inside a
    `ReversibleSequential` with a memory-saving engine its input is rebuilt in the backward.
    ``block(x1, x2, **context)`` calls ``f(x2, **context)`` and ``g(y1, **context)``.
    """

    # What the engines read instead of testing classes (`revkernels.engine.structure.coupling_kind`):
    # the coupling this class's forward_with_state computes. A subclass with a forward step of its
    # own declares it again, or the engines run only its own steps.
    coupling = "full"

    def __init__(self, f, g):
        super().__init__()
        for module, name in ((f, "f"), (g, "g")):
            if not isinstance(module, nn.Module):
                raise TypeError(f"revkernels: {name} must be a torch.nn.Module, got {type(module).__name__}")
        self.f = f
        self.g = g

    def forward(self, x1, x2, **context):
        check_streams(x1, x2)
        if context:
            check_context(self, (self,), context, label=lambda _: type(self).__name__)
        y1, y2, _ = self.forward_with_state(x1, x2, preserve_rng_state=False, context=context)
        return y1, y2

    def draws_random(self):
        """Whether a forward of this block can draw random numbers now (see
        `revkernels.engine.structure.draws_random`); only then is its generator state kept."""
        return draws_random(self)

    def forward_with_state(self, x1, x2, preserve_rng_state=True, context=NO_CONTEXT):
        """Forward that also returns the `BlockState` a later `recompute` replays (None when
        nothing is to replay: `preserve_rng_state` off, or a block that draws no random numbers)."""
        keep = preserve_rng_state and self.draws_random()
        devices = cuda_devices_of(x1, x2) if keep else ()
        rng_f = RngState(devices) if keep else None
        fx2 = self.f(x2, **context)
        check_residual(fx2, x1, "f", "x1")
        y1 = x1 + fx2
        rng_g = RngState(devices) if keep else None
        gy1 = self.g(y1, **context)
        check_residual(gy1, x2, "g", "x2")
        return y1, x2 + gy1, BlockState(rng_f, rng_g) if keep else None

    def inverse(self, y1, y2, state=None, context=NO_CONTEXT):
        """Rebuilds (x1, x2) from (y1, y2) without autograd. BatchNorm running statistics are left
        alone; stochastic layers replay `state` when given, else draw fresh randomness, and buffers
        the forward changed (recorded in `state` by the engines) hold their values before it for the
        rebuild. `context`: the forward's keywords (a dict)."""
        check_streams(y1, y2, ("y1", "y2"))
        with torch.no_grad(), recompute_context(self), _buffers_for_rebuild(self, state):
            with maybe_replay(None if state is None else state.rng_g):
                x2 = coupling_sub(y2, self.g(y1, **context))
            with maybe_replay(None if state is None else state.rng_f):
                x1 = coupling_sub(y1, self.f(x2, **context))
        return x1, x2

    def recompute(self, y1, y2, state=None, context=NO_CONTEXT):
        """Rebuilds the input from the output, keeping the local graphs of G(y1) and F(x2).

        Differentiating the local graphs fires no hook of the parameters and accumulates nothing
        into ``.grad`` (see `_call_with_aliases`); the grads reach ``.grad`` once, through the
        engine's Function."""
        y1_leaf = y1.detach().requires_grad_()  # the local graphs must not reach back into the caller's
        with torch.enable_grad(), recompute_context(self):
            with maybe_replay(None if state is None else state.rng_g):
                g_out, g_aliases = _call_with_aliases(self.g, module_input(y1_leaf), context)
            x2 = coupling_sub(y2.detach(), g_out.detach()).requires_grad_()
            with maybe_replay(None if state is None else state.rng_f):
                f_out, f_aliases = _call_with_aliases(self.f, module_input(x2), context)
            x1 = coupling_sub(y1_leaf.detach(), f_out.detach())
        return BlockRecompute(x1=x1, x2=x2, y1=y1_leaf, f_out=f_out, g_out=g_out,
                              f_aliases=f_aliases, g_aliases=g_aliases)

    @takes_missing_dy2
    def grads(self, rec, dy1, dy2):
        """Input and parameter grads of the block from its output grads, via the local graphs.
        `dy2` None: the loss did not use y2, and G is not differentiated (plain autograd never
        reaches it: a zero grad through a Jacobian holding NaN or inf would give NaN)."""
        if dy2 is None:
            dy1_from_g, g_grads = None, [None] * len(rec.g_aliases)
        else:
            dy1_from_g, g_grads = _vjp(rec.g_out, rec.y1, rec.g_aliases, dy2)
        dy1_total = dy1 if dy1_from_g is None else coupling_add(dy1, dy1_from_g)
        dx2_from_f, f_grads = _vjp(rec.f_out, rec.x2, rec.f_aliases, dy1_total)
        dx2 = dy2 if dx2_from_f is None else dx2_from_f if dy2 is None else coupling_add(dy2, dx2_from_f)
        return BlockGrads(dx1=dy1_total, dx2=dx2, params=list(rec.f_aliases) + list(rec.g_aliases),
                          param_grads=f_grads + g_grads)


def _call_with_aliases(module, x, context=NO_CONTEXT):
    """``module(x, **context)`` for a local graph whose parameter grads the engine returns itself.
    Returns the output and {parameter: the tensor to differentiate for it}: the parameter itself
    when no parameter has a tensor hook (``torch.autograd.grad`` then captures its grad without
    running its accumulation), else detached aliases swapped in for the call, so the local graph
    fires no hook of the parameters (their grads reach ``.grad`` once, through the engine's
    Function). The context tensors that require grad are added as their own entries."""
    slots = param_slots(module)
    if not any(p._backward_hooks for p in slots.params):
        out, wrt = module(x, **context), {p: p for p in slots.params if p.requires_grad}
    else:
        aliases = detached_aliases(slots)
        if slots.parametrized:
            names = {slots.names[i]: alias for i, alias in aliases.items()}
            out = functional_call(module, names, (x,), dict(context))
        else:
            with slots.substituted(aliases):
                out = module(x, **context)
        wrt = {slots.params[i]: alias for i, alias in aliases.items()}
    if context:
        wrt.update((t, t) for t in grad_tensors(context))
    return out, wrt


def _buffers_for_rebuild(block, state):
    """An inverse's buffers: those the forward recorded in `state` changed hold their old values;
    without a state, whatever the rebuild changes is put back."""
    return buffers_kept(block) if state is None else buffers_as_before(getattr(state, "buffers", ()))


def _vjp(out, leaf, aliases, grad_out):
    """(d out/d leaf)^T grad_out and the grads of `aliases`' values; None for what `out` does
    not depend on."""
    if not out.requires_grad:
        return None, [None] * len(aliases)
    # torch.autograd.grad's engine call without its Python argument handling (one output whose grad
    # has its shape and dtype): a generic block makes two such calls a step
    grads = _engine_run_backward((out,), (grad_out.to(out.dtype),), False, False, (leaf, *aliases.values()), True,
                                 accumulate_grad=False)
    return grads[0], list(grads[1:])


class HalfCouplingBlock(ReversibleBlock):
    """One additive coupling followed by a swap (PETRA's reversible stage, RevNet's half block)::

        forward   (y1, y2) = (x2, x1 + f(x2))        inverse   (x1, x2) = (y2 - f(y1), y1)

    Consecutive half blocks alternate which stream is updated; two of them compose to one
    `ReversibleBlock(f, g)` up to the order of the output streams.
    """

    coupling = "half"

    def __init__(self, f):
        nn.Module.__init__(self)
        if not isinstance(f, nn.Module):
            raise TypeError(f"revkernels: f must be a torch.nn.Module, got {type(f).__name__}")
        self.f = f

    def forward_with_state(self, x1, x2, preserve_rng_state=True, context=NO_CONTEXT):
        keep = preserve_rng_state and self.draws_random()
        rng_f = RngState(cuda_devices_of(x1, x2)) if keep else None
        fx2 = self.f(x2, **context)
        check_residual(fx2, x1, "f", "x1")
        return x2, x1 + fx2, BlockState(rng_f, None) if keep else None

    def inverse(self, y1, y2, state=None, context=NO_CONTEXT):
        check_streams(y1, y2, ("y1", "y2"))
        with torch.no_grad(), recompute_context(self), _buffers_for_rebuild(self, state), \
                maybe_replay(None if state is None else state.rng_f):
            return coupling_sub(y2, self.f(y1, **context)), y1

    def recompute(self, y1, y2, state=None, context=NO_CONTEXT):
        x2 = y1.detach().requires_grad_()
        with torch.enable_grad(), recompute_context(self), maybe_replay(None if state is None else state.rng_f):
            f_out, f_aliases = _call_with_aliases(self.f, x2, context)
        x1 = coupling_sub(y2.detach(), f_out.detach())
        return BlockRecompute(x1=x1, x2=x2, y1=None, f_out=f_out, g_out=None, f_aliases=f_aliases, g_aliases={})

    @takes_missing_dy2
    def grads(self, rec, dy1, dy2):
        # dx1 = dy2;  dx2 = dy1 + (df/dx2)^T dy2  (dy2 None: F is not differentiated, dx1 is None)
        if dy2 is None:
            dx2_from_f, f_grads = None, [None] * len(rec.f_aliases)
        else:
            dx2_from_f, f_grads = _vjp(rec.f_out, rec.x2, rec.f_aliases, dy2)
        dx2 = dy1 if dx2_from_f is None else coupling_add(dy1, dx2_from_f)
        return BlockGrads(dx1=dy2, dx2=dx2, params=list(rec.f_aliases), param_grads=f_grads)


class ReversibleSequential(nn.Module):
    """A run of `ReversibleBlock`s trained by a memory-saving engine.

    Args:
        *blocks: `ReversibleBlock` instances (or subclasses such as fused blocks), at least one.
        engine: "auto" (the default: picked per call, ``seq.engine_in_use`` names the pick),
            "sequential", "pareprop", "graphs", "compiled" (options in ``seq.compile_options``)
            or "autograd" (the reference: stores activations); see the docs' "Choosing an
            engine" (docs/engines.md).
        preserve_rng_state: replay each block's randomness (dropout, drop-path) in the recompute.
            Costs a few KB of host memory per block; turn off only for deterministic blocks.
        memory_budget: activations the run may keep beyond its outputs (0, the default: none): a
            fraction in [0, 1] of what plain autograd would save, a number of bytes, or "auto"
            (CUDA's free memory). Each block is rebuilt, kept selectively (matmul outputs kept,
            the rest recomputed) or kept whole, and under torch.compile also checkpointed (its
            inputs kept), the fastest mix that fits; the rebuilt ones are a prefix of the run.
            ``seq.memory_plan(x1, x2)`` shows the plan (see `revkernels.engine.budget`).
        exact: keep the streams between blocks in fixed point (int64 with ``seq.exact_bits``
            fraction bits, 32 by default: values below 2^30 in magnitude), so that the backward
            rebuilds every block's input bit for bit, in any precision and at any depth. The run
            still takes and returns float tensors; see `revkernels.nn.exact` for what it
            guarantees and costs.

    ``seq(x1, x2, **context)``: keywords passed to every F and G (``f(x2, **context)``,
    ``g(y1, **context)``): tensors (an attention mask, a conditioning vector, rotary tables)
    or plain values. A context tensor that requires grad gets the sum of its grads over all
    blocks through autograd; the memory-saving engines save each context tensor once per run,
    under torch.compile too (the opaque op carries the context; its plain values other than
    numbers must be hashable constants of the traced code).

    Lazy modules (``nn.LazyLinear``, ...): the call that creates their parameters runs ordinary
    autograd through the blocks (it stores its activations); the engine runs the calls after it.
    """

    # engine="compiled": torch.compile keywords for its steps (a dict; None: inductor's defaults),
    # see `revkernels.engine.compiled.compiled_steps`
    compile_options = None
    # exact=True: fraction bits of the fixed-point streams (grid 2^-exact_bits, |x| < 2^(62-exact_bits))
    exact_bits = 32

    def __init__(self, *blocks, engine="auto", preserve_rng_state=True, memory_budget=0, exact=False):
        super().__init__()
        if len(blocks) == 1 and isinstance(blocks[0], (list, tuple, nn.ModuleList)):
            blocks = tuple(blocks[0])
        if not blocks:
            raise ValueError("revkernels: ReversibleSequential needs at least one block")
        for i, block in enumerate(blocks):
            if not isinstance(block, ReversibleBlock):
                raise TypeError(f"revkernels: blocks[{i}] must be a revkernels.nn.ReversibleBlock, got {type(block).__name__}")
        self.blocks = nn.ModuleList(blocks)
        self.engine = engine
        self.preserve_rng_state = bool(preserve_rng_state)
        self.memory_budget = memory_budget
        self.exact = exact
        self._opaque_handle = _new_handle(self)

    def __getstate__(self):
        # (plans, head runs and the plan's run number are the original's: remade for a copy)
        return {k: v for k, v in self.__dict__.items() if k not in ("_budget", "_planned_run")}

    def __setstate__(self, state):
        # A copy (copy.deepcopy, pickle) is a run of its own: it must not name its original to the
        # torch.compile ops' kernels (revkernels.engine.opaque.new_handle).
        super().__setstate__(state)
        self._opaque_handle = _new_handle(self)
        if "engine_in_use" not in self.__dict__:  # (pickled before engine="auto" existed)
            self.engine_in_use = None if self._engine_name == "auto" else self._engine_name

    @property
    def engine(self):
        return self._engine_name

    @engine.setter
    def engine(self, name):
        from revkernels.engine import get_engine

        self._engine_fn = get_engine(name)
        self._engine_name = name
        self.engine_in_use = None if name == "auto" else name

    @property
    def memory_budget(self):
        """Activations the run may keep, beyond its outputs: 0 (the default: rebuild every block),
        a fraction in [0, 1] of what plain autograd would save for the same input, a number of
        bytes, or "auto" (CUDA: the free memory); see `revkernels.engine.budget`."""
        return self._memory_budget

    @memory_budget.setter
    def memory_budget(self, budget):
        from revkernels.engine.budget import check_budget

        self._memory_budget = check_budget(budget)

    def memory_plan(self, x1, x2, **context):
        """The `revkernels.engine.budget.MemoryPlan` a call with these inputs runs under: each
        block's option (rebuild, selective or keep) and bytes, the budget in bytes, the rebuilds
        saved and the estimated recompute time (``print`` it); ``.under_compile``: the plan a
        torch.compile trace follows (checkpoint offered too). Measured once per input signature,
        then cached."""
        from revkernels.engine.budget import plan_of

        check_streams(x1, x2)
        return plan_of(self, x1, x2, context)

    @property
    def exact(self):
        """Whether the streams between blocks are fixed point (see `revkernels.nn.exact`); settable."""
        return self.__dict__.get("_exact", False)

    @exact.setter
    def exact(self, exact):
        if not isinstance(exact, bool):
            raise TypeError(f"revkernels: exact must be a bool, got {type(exact).__name__}")
        if exact:
            from revkernels.nn.exact import check_exact_block

            for i, block in enumerate(self.blocks):
                check_exact_block(block, i)
        self.__dict__["_exact"] = exact

    def fixed_point_streams(self, dtype):
        """A new `revkernels.nn.exact.FixedPointStreams` for a call with `dtype` inputs in exact
        mode; None otherwise."""
        if not self.exact:
            return None
        handed = self.__dict__.pop("_handed_streams", None)
        if handed is not None:
            return handed
        from revkernels.nn.exact import FixedPointStreams
        from revkernels.ops.fixed_point import check_bits

        check_bits(self.exact_bits)
        return FixedPointStreams(self.exact_bits, dtype)

    def hand_streams(self, streams):
        """The `FixedPointStreams` the next call steps (exact mode), instead of new ones: a caller
        going on from the call's int64 outputs (``streams.outputs``) hands them over first."""
        self.__dict__["_handed_streams"] = streams

    def _run_of(self, blocks):
        """A plain run of `blocks` (modules of this run): the memory-saving head of a run with a
        budget (`revkernels.engine.budget.run_within_budget` gives it this run's settings)."""
        return ReversibleSequential(*blocks)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        return self.blocks[index]

    def __iter__(self):
        return iter(self.blocks)

    def forward(self, x1, x2, **context):
        check_streams(x1, x2)
        if torch.compiler.is_compiling() and self._engine_name != "autograd":
            if self.exact:  # the opaque op runs exact mode's steps, with grad or without
                from revkernels.engine.opaque import run_opaque

                if _exporting():
                    raise NotImplementedError("revkernels: a run in exact mode cannot be exported yet (its steps "
                                              "run inside an op of this process); export it with exact=False")
                return run_opaque(self, x1, x2, context)
            from revkernels.engine.opaque import grad_params, run_opaque

            if _exporting() or not records_graph(x1, x2, grad_params(self.blocks), grad_tensors(context)):
                # Nothing to differentiate (inference): the blocks' forward is traced, for the
                # compiler to optimize; and an exported program must not call an op whose kernel
                # looks the run up in this process
                for block in self.blocks:
                    x1, x2 = block.forward(x1, x2, **context)  # (no block hooks: see run_reversible)
                return x1, x2
            if self._memory_budget:
                from revkernels.engine.budget import traced_within_budget

                out = traced_within_budget(self, x1, x2, context)
                if out is not None:
                    return out
            # Under torch.compile a memory-saving run is one opaque op (its backward rebuilds the
            # inputs), so the compiled graph saves only the run's outputs and context
            # (revkernels.engine.opaque, which also checks the context keywords, at trace time).
            return run_opaque(self, x1, x2, context)
        if (self._memory_budget and self._engine_name != "autograd"
                and records_graph(x1, x2, unique_grad_params(self.blocks), grad_tensors(context))):
            check_members(self.blocks)
            if context:
                check_context(self, self.blocks, context)
            from revkernels.engine.budget import run_within_budget

            out = run_within_budget(self, x1, x2, context)
            if out is not None:
                return out
        run = self._engine_fn
        if run is None:  # engine="auto"
            from revkernels.engine import ENGINES, choose_engine

            chosen = choose_engine(self, x1, context)
            if chosen != self.engine_in_use:
                _log.debug("revkernels: engine='auto' runs %s with the %s engine", type(self).__name__, chosen)
                self.engine_in_use = chosen
            run = ENGINES[chosen]
        if self._engine_name != "autograd":
            check_members(self.blocks)  # (a submodule inserted since the last run: see check_members)
            if _uninitialized_params(self.blocks):
                # A lazy module (nn.LazyLinear, ...) creates its parameters' shapes in its first
                # forward, after the memory-saving engines take the parameters as inputs of their
                # autograd Function: this call runs ordinary autograd through the blocks (storing
                # activations).
                from revkernels.engine.autograd import run_autograd as run
        if context:
            check_context(self, self.blocks, context)
            if self._engine_name != "autograd" and torch.is_grad_enabled():
                check_context_grads(context)
            return run(self, x1, x2, context)
        return run(self, x1, x2)

    def inverse(self, y1, y2, **context):
        """Rebuilds the run's input from its output without autograd (no RNG replay); `context`:
        the forward's keywords."""
        check_streams(y1, y2, ("y1", "y2"))
        check_members(self.blocks)
        if context:
            check_context(self, self.blocks, context)
        streams = self.fixed_point_streams(y1.dtype)
        if streams is not None:  # exact mode: the float outputs onto the grid, then the exact steps
            (_, y1), (_, y2) = streams.enter(y1, "y1"), streams.enter(y2, "y2")
            streams.raise_on_overflow()
            for step in reversed(streams.steps(self.blocks)):
                y1, y2 = step.inverse(y1, y2, context=context)
            return streams.view(y1), streams.view(y2)
        for block in reversed(self.blocks):
            y1, y2 = call_with_context(block.inverse, y1, y2, context=context)
        return y1, y2

    def reverse(self, y1, y2, dy1, dy2, **context):
        """Rebuilds the input and its grads from the output and output grads alone.

        What a pipeline stage calls: no graph or activation of the forward is needed. Parameter
        grads are added into ``.grad``. Runs under the caller's autocast mode; stochastic layers
        draw fresh randomness. `context`: the forward's keywords. Returns a `ReverseResult`, the
        tuple ``(x1, x2, dx1, dx2)`` (none of them requiring grad) whose ``context_grads`` maps
        each context tensor that requires grad to its grad summed over the blocks (None if no
        block used it); those grads are returned, not added anywhere.

        Exact mode (``exact=True``): y1 and y2 are the int64 fixed-point streams the forward's
        exact steps made (`revkernels.nn.exact`), dy1 and dy2 float grads of their views, in the
        dtype F and G see the views in (the run's float dtype); x1 and x2 come back as int64
        streams, rebuilt bit for bit when the parameters are those of the forward, and dx1, dx2
        as float grads (straight-through).
        """
        return self.reverse_with_states(y1, y2, dy1, dy2, None, context)

    def reverse_with_states(self, y1, y2, dy1, dy2, states, context=None):
        """`reverse` with what the forward of each block left for its recompute: `states` holds one
        state per block (`revkernels.engine.sequential.forward_step`'s third output: the generator
        states its dropout and drop-path replay, the buffers its forward changed; None where there
        is nothing to replay), or is None for `reverse`'s fresh randomness. `context`: a dict of
        the forward's keywords (or None). What a PETRA stage whose block draws random numbers calls."""
        from revkernels.engine.sequential import reverse_blocks

        if context is not None and not isinstance(context, dict):
            raise TypeError(f"revkernels: context must be a dict of the forward's keywords or None, got "
                            f"{type(context).__name__}")
        context = context or {}
        if states is not None and (not isinstance(states, (list, tuple)) or len(states) != len(self.blocks)):
            got = f"{len(states)} states" if isinstance(states, (list, tuple)) else type(states).__name__
            raise ValueError(f"revkernels: states must be a list of one state per block ({len(self.blocks)}; "
                             f"forward_step's, or None), got {got}")
        check_streams(y1, y2, ("y1", "y2"), fixed_point=self.exact)
        check_members(self.blocks)
        if context:
            check_context(self, self.blocks, context)
            check_context_grads(context)
        for grad, out, name in ((dy1, y1, "dy1"), (dy2, y2, "dy2")):
            if not isinstance(grad, torch.Tensor):
                raise TypeError(f"revkernels: {name} must be a torch.Tensor, got {type(grad).__name__}")
            if grad.shape != out.shape:
                raise ValueError(f"revkernels: {name} must have the shape of the output {tuple(out.shape)}, got {tuple(grad.shape)}")
            if grad.device != out.device:
                raise ValueError(f"revkernels: {name} must be on {out.device}, got {grad.device}")
            if not grad.is_floating_point():
                raise TypeError(f"revkernels: {name} must be a floating-point tensor, got {grad.dtype}")
        if not self.exact:  # (as autograd casts an output's grad to the output's dtype; exact: `_walked_blocks`)
            dy1, dy2 = dy1.to(y1.dtype), dy2.to(y2.dtype)
        params = unique_grad_params(self.blocks)
        names = grad_names(context)
        context, leaves = with_grad_leaves(context, names)
        with torch.no_grad(), _walked_blocks(self, dy1, dy2, states) as (blocks, states):
            x1, x2, dx1, dx2, grads = reverse_blocks(blocks, states, y1, y2, dy1, dy2, params + leaves,
                                                     context=context)
            context_grads = dict(zip(names, grads[len(params):]))
            # A parameter's grad may be dy1/dy2 themselves, a returned grad or another
            # parameter's grad (e.g. an additive table's): such a grad is stored as a copy, so
            # that nothing written to .grad later reaches the caller's tensors or another .grad.
            taken = {t.untyped_storage().data_ptr() for t in (dy1, dy2, dx1, dx2, *context_grads.values())
                     if t is not None}
            for p, grad in zip(params, grads):
                if grad is None:
                    continue
                if p.grad is None:
                    storage = grad.untyped_storage().data_ptr()
                    p.grad = grad.clone() if storage in taken else grad
                    taken.add(storage)
                else:
                    p.grad.add_(grad)
        return ReverseResult(x1.detach(), x2.detach(), dx1.detach(), dx2.detach(), context_grads)


@contextlib.contextmanager
def _walked_blocks(seq, dy1, dy2, states):
    """``(blocks, states)`` for `reverse_blocks`: `seq`'s blocks and `states` as given, or in exact
    mode each block's exact steps (`revkernels.nn.exact.ExactSteps`) on streams whose float views
    have dy1's dtype, with the buffers of every block left as the walk found them when there are
    no forward states (what `reverse_blocks` does per block for the blocks themselves)."""
    if not seq.exact:
        yield seq.blocks, states
        return
    if dy2.dtype != dy1.dtype:
        raise TypeError(f"revkernels: dy2 must have dy1's dtype {dy1.dtype} in exact mode (the grads of the streams' "
                        f"float views), got {dy2.dtype}")
    streams = seq.fixed_point_streams(dy1.dtype)
    with contextlib.ExitStack() as stack:
        if states is None:
            for block in seq.blocks:
                stack.enter_context(buffers_kept(block))
            states = [None] * len(seq.blocks)
        yield streams.steps(seq.blocks), states


class ReverseResult(tuple):
    """``(x1, x2, dx1, dx2)`` from `ReversibleSequential.reverse`, with ``context_grads``:
    {context name: its grad, or None where no block used it} for the context tensors that
    require grad."""

    def __new__(cls, x1, x2, dx1, dx2, context_grads):
        result = super().__new__(cls, (x1, x2, dx1, dx2))
        result.context_grads = context_grads
        return result


def _new_handle(seq):
    from revkernels.engine.opaque import new_handle  # (engine imports this module)

    return new_handle(seq)


def _exporting():
    # torch.export's own flag, read directly: torch.compiler.is_exporting() reads True under every
    # Dynamo trace in torch 2.11 (Dynamo folds it to a constant), which would trace the blocks
    # into the user's graph, saving their activations, instead of calling the opaque op
    return torch.compiler._is_exporting_flag


def _uninitialized_params(blocks):
    """Whether a lazy module under `blocks` has not initialized its parameters yet (the lazy ones
    are cached; each is checked on every call, as initializing keeps the Parameter object)."""
    lazy = cached(blocks, "lazy_params", lambda m: [p for p in m.parameters() if is_lazy(p)])
    return bool(lazy) and any(map(is_lazy, lazy))


