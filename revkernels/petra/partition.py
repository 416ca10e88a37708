r"""PETRA's stages: a model's stage list turned into units that run forward and backward apart.

`partition(model)` gives one `Stage` per entry of ``model.stages`` (or of a list of modules). A
stage's forward and its backward for the same batch happen at different ticks, with the stage's
parameters possibly updated in between; the backward always uses the *current* parameters:

- reversible stage (a `ReversibleBlock`, e.g. RevNet's ``y = (x2, x1 + F(x2))``): stores nothing
  (unless a memory budget has it keep its inputs, below).
  Its backward receives (its output y, the output grad dy), rebuilds its input
  ``x = inverse(y; theta_now)``, recomputes F at x under autograd and returns (x, dx); the
  parameter grads are *added* into ``.grad`` (a one-block `ReversibleSequential.reverse`).
- non-reversible stage (stem, downsampling, any other module): keeps a FIFO of its inputs, pushed
  by the forward, popped by the backward, which recomputes ``F(x; theta_now)`` under autograd and
  returns (x, dx) with x the *exact* stored input (reconstruction error upstream is reset there).
  BatchNorm running statistics are updated by the forward only, never by a recompute.
- last stage (head + loss): forward, cross-entropy with the batch's labels and backward in the
  same call (`Stage.forward_backward`); keeps nothing.
- randomness (dropout, drop-path: `revkernels.engine.structure.draws_random`): a stage that draws
  random numbers keeps, per pending batch, the generator states its forward started from (a
  reversible stage: the states before F and before G, `revkernels.engine.state.BlockState`; any
  other: the state before the module), a few KB on the host, and its backward's rebuild or
  recompute replays them, so it draws that batch's masks whatever ran in between; the global
  generator is left as it was. Each such stage draws from a generator stream of its own
  (`StageStream`: seeded from ``torch.initial_seed()`` when the stage is made and its index,
  swapped in for its forward), so its masks do not depend on which stages share its process:
  the distributed runtime's ranks draw what the simulator draws, and two stages do not draw the
  same masks. Checkpoints keep the streams and the pending states (`replay_state`).

Exact stages (``partition(model, exact=True)``; by default the setting of the model's reversible
runs). A reversible stage steps its two streams as int64 fixed point X = round(x * 2^b) (b =
``exact_bits``), through `revkernels.nn.exact`'s steps: its forward returns the int64 output
streams (a float input, from a non-reversible stage, is converted to the stage's ``float_dtype``
and rounded onto the grid; a value that does not fit raises OverflowError naming the stage), and
its backward rebuilds the int64 input bit for bit while the parameters are those of the forward
(`ReversibleSequential.reverse` in exact mode) and returns it as the stage got it: int64 after an
exact stage, else its float values on the grid. A stage after an exact stage (``fixed_point_input``)
is given int64 streams: a non-reversible one reads their float views (``fixed_point_view``, the
grads of the views passing straight through) and keeps the int64 streams in its FIFO, so its
backward returns exactly what the exact stage before it output. F and G see float views in the
stage's ``float_dtype``. A stage that keeps its inputs (delayed, or a memory budget) recomputes
through the exact steps under autograd from the stored input (`run_exact_autograd`).

Memory budget (``partition(model, memory_budget=B, example=x)``; `plan_memory`). Reversible stages
that the budget holds keep their inputs in their FIFO like non-reversible stages
(``keeps_input``): no rebuild, their backward recomputes at the stored input with the current
parameters and returns it. A stage's cost is its input's bytes per batch times the batches its
worker holds at once (2(R - w) + 1 for worker w of R, 1-based); the plan keeps the cheapest stages
first (ties: the lower index), as many as the budget holds, which skips the most rebuilds.

Delayed gradients (``delayed=True``, the PipeDream-like baseline, "weight stashing"): every stage but
the last, reversible or not, pushes (its input, a copy of the parameters its forward used) onto its
FIFO; its backward pops both, recomputes ``F(x; theta_then)`` under autograd with the *stored*
parameters (swapped in for the call, then swapped back) and adds that stale gradient into ``.grad``,
which the optimizer then applies to the *current* parameters. It returns the stored input as x.

The first stage receives the image (its input grad is not computed); every other stage receives
the previous stage's outputs (a tuple of tensors). Outputs are always tuples of tensors except the
last stage's logits.

Context (an attention mask, a conditioning vector: keywords of one batch): ``forward(x, batch,
**context)``, ``backward(y, dy, batch, **context)`` and ``forward_backward(x, labels, **context)``
call the stage's module with the keywords (a reversible stage: every F and G); a batch's backward
must get its forward's context. Context tensors are constants of the pipeline (`check_constant_context`):
a stage returns no grads for them.

Groups. ``partition(model, groups=R)`` returns the stages split into R contiguous groups (one per
pipeline worker): ``balance="count"`` by stage count (sizes differing by at most one, the larger
first), ``balance="time"`` minimising the largest group's per-tick cost, the sum of its stages'
costs (`balanced_sizes`: exact, deterministic). The costs are `stage_costs` (forward + rebuild + VJP
of each stage and its share of an optimizer step, timed on the example's device) or a list given by
the user (``costs=``).
"""
import contextlib
import copy
import dataclasses
import itertools
import math
import numbers
import time
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from revkernels.engine.budget import check_budget
from revkernels.engine.sequential import forward_step
from revkernels.engine.state import BlockState, RngState, cuda_devices_of, maybe_replay
from revkernels.engine.structure import draws_random, recompute_context
from revkernels.nn.exact import FixedPointStreams, run_exact_autograd
from revkernels.nn.reversible import ReversibleBlock, ReversibleSequential, check_streams
from revkernels.ops.fixed_point import check_bits, fixed_point_view

KINDS = ("stem", "reversible", "down", "head")


def check_constant_context(context):
    """Raises ValueError naming a context tensor that requires grad (PETRA's stages return no
    context grads, so its grad would be lost)."""
    for name, value in context.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise ValueError(f"revkernels: context {name} requires grad, but PETRA's stages do not return context "
                             "grads; pass it detached")


def _as_tuple(x, name="x"):
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise TypeError(f"revkernels: {name} must be a tensor or a non-empty tuple of tensors, got {type(x).__name__}")


class Stage:
    """One pipeline stage: a module plus what its backward needs (see the module docstring).

    Attributes:
        module: the stage's module (shared with the model: same parameters).
        index: position in the stage list (0-based; the stage number j of the timing in
            `revkernels.petra.simulate` is ``index + 1``).
        kind: "stem" | "reversible" | "down" | "head" (the module's ``kind`` if it has one).
        reversible: True for a `ReversibleBlock` stage (rebuilds its input, stores nothing).
        is_first, is_last: position flags; the last stage computes the loss.
        delayed: True for the delayed-gradient baseline (see the module docstring): the FIFO also
            holds a parameter copy per pending batch, and reversible stages buffer their inputs too.
        peak_buffer_bytes: the most bytes the FIFO (inputs and parameter copies) has held at once.
        exact: True for a reversible stage of an exact partition: its streams are int64 fixed point
            (module docstring, "Exact stages"); `exact_bits` their fraction bits.
        fixed_point_input: True when the stage before is exact: its input is int64 streams.
        keeps_input: a reversible stage that keeps its inputs in its FIFO and recomputes instead of
            rebuilding (set by a ``memory_budget``'s plan, `memory_plan`).
    """

    def __init__(self, module, index, num_stages, delayed=False, exact=False, fixed_point_input=False,
                 exact_bits=None):
        if not isinstance(module, nn.Module):
            raise TypeError(f"revkernels: stage {index} must be a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.index = index
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        reversible = bool(getattr(module, "reversible", isinstance(module, ReversibleBlock)))
        if reversible and not isinstance(module, ReversibleBlock):
            raise TypeError(f"revkernels: stage {index} says reversible=True but is not a revkernels.nn.ReversibleBlock "
                            f"(got {type(module).__name__}): its input could not be rebuilt")
        if reversible and self.is_last:
            raise ValueError(f"revkernels: the last stage (stage {index}) computes the loss and must not be reversible")
        self.reversible = reversible
        default = "reversible" if reversible else "head" if self.is_last else "stem" if self.is_first else "down"
        self.kind = getattr(module, "kind", default)
        self.exact = bool(exact) and reversible
        self.fixed_point_input = bool(fixed_point_input)
        if self.fixed_point_input and self.is_first:
            raise ValueError("revkernels: the first stage takes the images, not fixed-point streams "
                             "(fixed_point_input=True)")
        self.exact_bits = ReversibleSequential.exact_bits if exact_bits is None else exact_bits
        if self.exact or self.fixed_point_input:
            check_bits(self.exact_bits)
        # A one-block run whose `reverse` rebuilds the input and adds the parameter grads into .grad.
        self._run = None
        if reversible:
            try:
                self._run = ReversibleSequential(module, engine="sequential", exact=self.exact)
            except TypeError as error:  # (a block exact mode cannot step: name the stage)
                raise TypeError(f"revkernels: stage {index}: {error}") from None
            self._run.exact_bits = self.exact_bits
        self.delayed = bool(delayed)
        self._keeps_input = False
        self.memory_plan = None  # the `PipelineMemoryPlan` that set keeps_input (None: no memory_budget)
        # (batch id, input tuple, parameter copies or None) of the forwards whose backward is pending
        self._fifo = deque()
        self.peak_buffer_bytes = 0
        # (forward number, generator state) of the pending forwards that drew random numbers, for
        # their backward's rebuild or recompute to draw the same: a `BlockState` (reversible stage:
        # the states before F and before G) or an `RngState` (the state before the module)
        self._replays = deque()
        self._forwards = self._backwards = 0
        self._stream = StageStream(torch.initial_seed(), index)

    def __repr__(self):
        return f"Stage({self.index}, kind={self.kind!r}, reversible={self.reversible}, buffered={len(self._fifo)})"

    @property
    def rebuilds(self):
        """Whether the backward rebuilds the input from the output (a reversible stage that neither
        keeps its inputs for a memory budget nor runs the delayed baseline)."""
        return self.reversible and not self.delayed and not self._keeps_input

    @property
    def keeps_input(self):
        return self._keeps_input

    @keeps_input.setter
    def keeps_input(self, keep):
        keep = bool(keep)
        if keep == self._keeps_input:
            return
        if keep and not self.reversible:
            raise ValueError(f"revkernels: stage {self.index} is not reversible: it always keeps its inputs")
        if self._forwards != self._backwards:
            raise RuntimeError(f"revkernels: stage {self.index} has pending batches: keeps_input may change only "
                               "between runs")
        self._keeps_input = keep

    @property
    def float_dtype(self):
        """The dtype of the float views an exact stage's F and G see, and of the views a stage fed
        fixed-point streams reads: its first floating-point parameter's (or buffer's), else torch's
        default dtype."""
        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            if t.is_floating_point():
                return t.dtype
        return torch.get_default_dtype()

    @property
    def label(self):
        return f"stage {self.index} ({type(self.module).__name__})"

    # --- buffer accounting -----------------------------------------------------------------------

    @property
    def buffered_inputs(self):
        """Number of inputs (batches) held in the FIFO; always 0 for the head and for reversible
        stages that rebuild (not delayed, not kept by a memory budget)."""
        return len(self._fifo)

    @property
    def buffer_tensors(self):
        """Number of tensors held in the FIFO (inputs and parameter copies)."""
        return sum(len(x) + len(p or ()) for _, x, p in self._fifo)

    @property
    def input_bytes(self):
        """Bytes of the inputs held in the FIFO."""
        return sum(t.numel() * t.element_size() for _, x, _ in self._fifo for t in x)

    @property
    def param_bytes(self):
        """Bytes of the parameter copies held in the FIFO (delayed gradients only; else 0)."""
        return sum(t.numel() * t.element_size() for _, _, p in self._fifo for t in (p or ()))

    @property
    def buffer_bytes(self):
        """Bytes of the tensors held in the FIFO (inputs + parameter copies)."""
        return self.input_bytes + self.param_bytes

    @property
    def buffered_batches(self):
        """Batch ids whose inputs the FIFO holds, oldest first."""
        return [b for b, _, _ in self._fifo]

    def fifo_state(self):
        """The FIFO's entries ``[(batch, inputs, parameter copies or None)]`` (for checkpoints)."""
        return list(self._fifo)

    def load_fifo_state(self, entries, peak_buffer_bytes=0, replays=None):
        """Restores `fifo_state()` and, when given, `replay_state()` (checkpoints from before it
        have none: no pending forward drew random numbers)."""
        self._fifo = deque((b, tuple(x), None if p is None else tuple(p)) for b, x, p in entries)
        self.peak_buffer_bytes = int(peak_buffer_bytes)
        in_flight, entries, *stream = replays if replays is not None else (0, [])
        self._backwards, self._forwards = 0, int(in_flight)
        if stream:  # (checkpoints from before the stage streams: the stream starts afresh)
            self._stream.state = stream[0]
        self._replays = deque((int(k), self._with_buffers(state, self.module.get_submodule))
                              for k, state in entries)

    def replay_state(self):
        """``(pending forwards, [(k, generator state)], stream state)``: the generator states of the
        pending forwards that drew random numbers, k counting the pending forwards from the oldest,
        and where the stage's own stream (`StageStream`) has got to (None: it drew nothing yet; for
        checkpoints, beside `fifo_state`; a buffer a forward changed is named by its module's path
        in the stage, not held with its module)."""
        paths = {id(m): name for name, m in self.module.named_modules()}
        return (self._forwards - self._backwards,
                [(number - self._backwards, self._with_buffers(state, lambda m: paths[id(m)]))
                 for number, state in self._replays], self._stream.state)

    @staticmethod
    def _with_buffers(state, holder):
        """`state` with each changed buffer's holder mapped by `holder` (module <-> path)."""
        if not isinstance(state, BlockState) or not state.buffers:
            return state
        return dataclasses.replace(state, buffers=tuple((holder(h), name, value) for h, name, value in state.buffers))

    def parameters(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    # --- forward / backward ----------------------------------------------------------------------

    def forward(self, x, batch=None, **context):
        """Forward of one batch with the current parameters, without autograd.

        `x`: the image (first stage) or the previous stage's output tuple (int64 streams after an
        exact stage). A stage that does not rebuild pushes (batch, x) onto its FIFO. Returns the
        output as a tuple of tensors (detached; an exact stage's: its int64 streams). `context`:
        keywords passed to the stage's module (a reversible stage's F and G); the backward of the
        same batch must get the same ones.
        """
        if self.is_last:
            raise RuntimeError("revkernels: the last stage runs forward and backward together: call forward_backward")
        x = tuple(t.detach() for t in _as_tuple(x))
        self._check_input(x)
        stochastic = draws_random(self.module, itself=True)
        rebuilds = self.rebuilds
        if self.delayed:
            self._fifo.append((batch, x, tuple(p.detach().clone() for p in self.parameters())))
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        elif not rebuilds:
            self._fifo.append((batch, x, None))
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        number = self._forwards
        self._forwards += 1
        with torch.no_grad(), self._stream.drawing(cuda_devices_of(*x)) if stochastic else contextlib.nullcontext():
            # (a stage that rebuilds keeps the block's states for the rebuild; any other, the
            # generator state before its module for the recompute)
            rng = RngState(cuda_devices_of(*x)) if stochastic and not rebuilds else None
            if self.exact or (rebuilds and stochastic):
                y1, y2, state = self._block_forward(x, rebuilds and stochastic, context)
                if rebuilds and stochastic:
                    self._replays.append((number, state))
                out = (y1, y2)
            else:
                out = self.module(*self._views(x), **context)
        if rng is not None:
            self._replays.append((number, rng))
        return _as_tuple(out, f"the output of stage {self.index}")

    def _check_input(self, x):
        if self.fixed_point_input and any(t.dtype != torch.int64 for t in x):
            got = next(t.dtype for t in x if t.dtype != torch.int64)
            raise TypeError(f"revkernels: stage {self.index}'s input x must be the int64 fixed-point streams of the "
                            f"exact stage before it, got {got}")

    def _views(self, x):
        """`x` as the module reads it: the float views of fixed-point streams, else itself."""
        if not self.fixed_point_input:
            return x
        return tuple(fixed_point_view(t, self.exact_bits, self.float_dtype) for t in x)

    def _streams(self):
        return _StageStreams(self.exact_bits, self.float_dtype, self.label)

    def _block_forward(self, x, preserve_rng_state, context):
        """A reversible stage's block forward (`forward_step`), returning the state a rebuild
        replays; an exact stage's on fixed-point streams (float input rounded onto the grid in
        its float dtype), its overflow flags read at the end (OverflowError naming the stage)."""
        if len(x) != 2:
            raise ValueError(f"revkernels: a reversible stage's input has two streams, got {len(x)} tensors")
        if not self.exact:
            check_streams(*x)
            return forward_step(self.module, *x, preserve_rng_state, context)
        streams = self._streams()
        if self.fixed_point_input:
            check_streams(*x, fixed_point=True)
            x1, x2 = x
        else:
            check_streams(*x)
            (_, x1), (_, x2) = (streams.enter(t.to(streams.dtype), f"the input of {self.label}") for t in x)
            streams.forget_views()
        (step,) = streams.steps([self.module], self.index)
        out = forward_step(self.module, x1, x2, preserve_rng_state, context, steps=step)
        streams.raise_on_overflow()
        return out

    def _next_replay(self):
        """The generator state of the forward the next backward differentiates (a stage's
        backwards run in its forwards' order), or None where it drew no random numbers."""
        number = self._backwards
        self._backwards += 1
        if self._replays and self._replays[0][0] == number:
            return self._replays.popleft()[1]
        return None

    def backward(self, y, dy, batch=None, **context):
        """Backward of the oldest pending batch: from (output y, output grad dy) to (input x, input grad dx).

        Parameter grads are added into ``.grad`` (computed with the current parameters). The first
        stage returns ``dx = None`` (the image needs no grad). `batch`, when given, is checked
        against the FIFO's oldest entry. `context`: the forward's keywords, constants here (a
        context tensor that requires grad is refused: its grad would not leave the stage).
        """
        if self.is_last:
            raise RuntimeError("revkernels: the last stage runs forward and backward together: call forward_backward")
        y, dy = _as_tuple(y, "y"), _as_tuple(dy, "dy")
        if len(y) != len(dy):
            raise ValueError(f"revkernels: y and dy must have as many tensors, got {len(y)} and {len(dy)}")
        check_constant_context(context)
        if self.rebuilds:
            if len(y) != 2:
                raise ValueError(f"revkernels: a reversible stage's output has two streams, got {len(y)} tensors")
            state = self._next_replay()
            if self.exact:  # (the grads of the views F and G saw)
                dy = tuple(g.to(self.float_dtype) for g in dy)
            x1, x2, dx1, dx2 = self._run.reverse(y[0].detach(), y[1].detach(), dy[0], dy[1], **context) \
                if state is None else self._run.reverse_with_states(y[0].detach(), y[1].detach(), dy[0], dy[1],
                                                                    [state], context)
            if self.exact and not self.fixed_point_input:  # fed floats: their values on the grid
                x1, x2 = (fixed_point_view(t, self.exact_bits, self.float_dtype) for t in (x1, x2))
            return (x1, x2), (None if self.is_first else (dx1, dx2))
        if not self._fifo:
            raise RuntimeError(f"revkernels: stage {self.index} has no pending input for a backward")
        stored_batch, x, stored_params = self._fifo.popleft()
        if batch is not None and stored_batch is not None and batch != stored_batch:
            raise RuntimeError(f"revkernels: stage {self.index} backward of batch {batch} but its oldest input "
                               f"is batch {stored_batch}")
        rng = self._next_replay()
        if stored_params is None:
            return x, self._vjp(x, y, dy, context, rng)
        params = self.parameters()
        current = [p.data for p in params]
        for p, old in zip(params, stored_params):  # the forward's (stale) parameters for the recompute
            p.data = old
        try:
            dx = self._vjp(x, y, dy, context, rng)
        finally:
            for p, now in zip(params, current):
                p.data = now
        return x, dx

    def _leaves(self, x):
        if self.is_first:
            return x
        return tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in self._views(x))

    def _vjp(self, x, y, dy, context, rng=None):
        leaves = self._leaves(x)
        with torch.enable_grad(), recompute_context(self.module), maybe_replay(rng):
            if self.exact:  # the exact steps under autograd from the stored input (straight-through)
                out = run_exact_autograd([self.module], *leaves, context, self._streams(),
                                         x if self.fixed_point_input else None, self.index)
            else:
                out = _as_tuple(self.module(*leaves, **context), f"the output of stage {self.index}")
        if len(out) != len(dy):
            raise ValueError(f"revkernels: stage {self.index} has {len(out)} outputs but got {len(dy)} output grads")
        pairs = [(o, g) for o, g in zip(out, dy) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
        if self.is_first:
            return None
        return tuple(None if not t.requires_grad else (t.grad if t.grad is not None else torch.zeros_like(t))
                     for t in leaves)

    def forward_backward(self, x, labels, **context):
        """The last stage: logits, mean cross-entropy with `labels`, backward, in one call.

        Adds the parameter grads into ``.grad``. Returns ``(loss, logits, x, dx)`` with x the
        received input (sent upstream unchanged) and dx its grad (None for a single-stage model).
        `context`: keywords of the stage's module (constants).
        """
        check_constant_context(context)
        if not self.is_last:
            raise RuntimeError(f"revkernels: stage {self.index} is not the last stage")
        x = tuple(t.detach() for t in _as_tuple(x))
        self._check_input(x)
        leaves = self._leaves(x)
        stream = self._stream.drawing(cuda_devices_of(*x)) if draws_random(self.module, itself=True) else contextlib.nullcontext()
        with torch.enable_grad(), stream:
            logits = self.module(*leaves, **context)
            if not isinstance(logits, torch.Tensor):
                raise TypeError(f"revkernels: the last stage must return logits (a tensor), got {type(logits).__name__}")
            loss = F.cross_entropy(logits, labels)
            loss.backward()
        dx = None if self.is_first else tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)
        return loss.detach(), logits.detach(), x, dx


class _StageStreams(FixedPointStreams):
    """An exact stage's fixed-point streams: its steps (and so its overflows) are named by the stage."""

    def __init__(self, bits, dtype, label):
        super().__init__(bits, dtype)
        self.label = label

    def steps(self, blocks, first=0):
        steps = super().steps(blocks, first)
        for step in steps:
            step.label = self.label
        return steps


class StageStream:
    """A stage's own random stream. `drawing` swaps it in as the generators' state for a forward
    of the stage (the CPU generator and those of the CUDA devices the stage runs on) and puts the
    caller's state back after, so the stage's masks depend only on its seed and the forwards it
    ran, not on what else runs in its process. The seed mixes `base_seed` (``torch.initial_seed()``
    when the stage is made: the same in every process of a run seeded alike) with the stage index."""

    def __init__(self, base_seed, index):
        self.seed = (int(base_seed) * 1_000_003 + 7_919 * (int(index) + 1)) % 2**63
        self.state = None  # RngState where the stream has got to; None until the first forward

    @contextlib.contextmanager
    def drawing(self, cuda_devices=()):
        if self.state is None or any(d not in self.state.cuda for d in cuda_devices):
            self.state = self._seeded(cuda_devices)
        with self.state.replay():  # (the caller's generator states are put back after)
            yield
            self.state = RngState(cuda_devices)

    def _seeded(self, cuda_devices):
        """The stream's state with the generators it has not drawn from yet at their seeded start."""
        state = RngState.__new__(RngState)
        state.cpu = torch.Generator().manual_seed(self.seed).get_state() if self.state is None else self.state.cpu
        state.cuda = {} if self.state is None else dict(self.state.cuda)
        for device in cuda_devices:
            state.cuda.setdefault(device, torch.Generator(f"cuda:{device}").manual_seed(self.seed).get_state())
        return state


BALANCES = ("count", "time")


def _stage_modules(model):
    if isinstance(model, (list, tuple, nn.ModuleList)):
        modules = list(model)
    elif isinstance(model, nn.Module):
        modules = list(model.stages) if hasattr(model, "stages") else [model]
    else:
        raise TypeError(f"revkernels: model must be a torch.nn.Module or a list of stage modules, got {type(model).__name__}")
    if not modules:
        raise ValueError("revkernels: model must have at least one stage")
    seen = set()
    for i, m in enumerate(modules):
        if id(m) in seen:
            raise ValueError(f"revkernels: stage {i} repeats a module already used by another stage")
        seen.add(id(m))
    return modules


def partition(model, delayed=False, groups=None, balance="count", costs=None, example=None, context=None,
              exact=None, memory_budget=0, exact_bits=None):
    """The PETRA stages of `model`: one `Stage` per entry of ``model.stages``, in order
    (``delayed=True``: the delayed-gradient baseline's stages, see the module docstring).

    `model` may also be a list/tuple/ModuleList of stage modules, or a module without ``stages``
    (one stage: J = 1, i.e. plain backprop; pass ``[model]`` to run a model that has ``stages`` as
    one stage). The stages share the model's parameters. Raises ValueError for an empty list, a
    module used twice or a reversible last stage; TypeError for a non-module or a stage claiming
    ``reversible = True`` that is not a `ReversibleBlock`.

    ``groups=R`` (an int in [1, J]) returns R lists of consecutive stages instead (module docstring,
    "Groups"): `balance` "count" or "time"; for "time", `costs` (J non-negative per-stage costs) or
    `example` (the first stage's input, e.g. a batch of images, on the model's device: `stage_costs`
    times the stages on it, an optimizer step every tick; for accumulation over k batches pass
    ``costs=stage_costs(model, example, accum_k=k)``; `context`: a dict of the keywords the stages
    take, as `train_step` gets them, for timing a model whose stages need them).

    `exact`: reversible stages on int64 fixed-point streams (module docstring, "Exact stages");
    None (the default) takes the setting of the model's reversible runs (``model.runs``, e.g. a
    RevNet built with ``exact=True``), False for a model without runs. `exact_bits`: the streams'
    fraction bits (None: the runs' ``exact_bits``, else `ReversibleSequential.exact_bits`, 32).

    `memory_budget` (0: every reversible stage rebuilds): reversible stages that keep their inputs
    instead (module docstring, "Memory budget"): a float in [0, 1] (that fraction of the bytes
    every reversible stage's kept inputs would hold) or an int (bytes); the plan needs `example`
    (and `context`, if the stages take keywords) to size the stages' inputs, and assumes one worker
    per stage, or the R groups of ``groups=R``.
    """
    modules = _stage_modules(model)
    exact, bits = exact_setting(model, exact, exact_bits)
    stages = make_stages(modules, delayed, exact, bits)
    budget = check_stage_budget(memory_budget, delayed)
    if budget and example is None:
        raise ValueError("revkernels: memory_budget needs example= (the first stage's input, e.g. a batch of images) "
                         "to size the stages' inputs")
    if groups is None:
        if balance != "count" or costs is not None or (not budget and (example is not None or context is not None)):
            raise ValueError("revkernels: balance and costs apply to partition(model, groups=R) only; example and "
                             "context to groups=R or a memory_budget")
        sizes = [1] * len(stages)
    else:  # (example and context size the memory plan; they time the stages for balance="time" only)
        timing = balance == "time" or not budget
        sizes = group_sizes(modules, groups, balance, costs, example if timing else None,
                            context if timing else None)
    if budget:
        plan_memory(stages, budget, example, context, sizes)
    if groups is None:
        return stages
    out, start = [], 0
    for n in sizes:
        out.append(stages[start:start + n])
        start += n
    return out


def exact_setting(model, exact, bits=None):
    """``(exact, exact_bits)`` of `partition(model, exact=..., exact_bits=...)`: `exact` given (a
    bool), or None for the setting of ``model.runs`` (all alike: ValueError if they differ); `bits`
    given, or the exact runs' (all alike), or `ReversibleSequential.exact_bits`."""
    if exact is not None and not isinstance(exact, bool):
        raise TypeError(f"revkernels: exact must be a bool or None (the model's runs' setting), got "
                        f"{type(exact).__name__}")
    runs = getattr(model, "runs", None) if isinstance(model, nn.Module) else None
    runs = [r for r in runs or () if isinstance(r, ReversibleSequential)]
    if exact is None:
        settings = {r.exact for r in runs}
        if len(settings) > 1:
            raise ValueError("revkernels: the model's reversible runs differ in exact; pass exact=True or False")
        exact = settings.pop() if settings else False
    if bits is not None:
        check_bits(bits)
        return exact, bits
    found = {r.exact_bits for r in runs if r.exact}
    if len(found) > 1:
        raise ValueError(f"revkernels: the model's exact runs differ in exact_bits ({sorted(found)}); pass exact_bits")
    return exact, found.pop() if found else ReversibleSequential.exact_bits


def make_stages(modules, delayed=False, exact=False, exact_bits=None):
    """One `Stage` per module; with `exact`, each stage after an exact stage takes its int64 streams."""
    stages = []
    for i, m in enumerate(modules):
        stages.append(Stage(m, i, len(modules), delayed=delayed, exact=exact, exact_bits=exact_bits,
                            fixed_point_input=bool(stages) and stages[-1].exact))
    return stages


# --- memory budget -------------------------------------------------------------------------------

def check_stage_budget(budget, delayed=False):
    """`budget` if it is a valid `partition` ``memory_budget`` (`revkernels.engine.budget.check_budget`
    without "auto"); ValueError/TypeError naming memory_budget otherwise."""
    budget = check_budget(budget)
    if isinstance(budget, str):
        raise ValueError(f"revkernels: memory_budget for PETRA stages must be a fraction in [0, 1] or a number of "
                         f"bytes, got {budget!r}")
    if budget and delayed:
        raise ValueError("revkernels: memory_budget applies to PETRA's stages, not the delayed baseline's (whose "
                         "stages keep every input)")
    return budget


@dataclasses.dataclass(frozen=True)
class StageKeepCost:
    """What keeping one reversible stage's inputs costs: ``pending`` batches held at once (the
    most a worker has in flight: 2(R - w) + 1 for worker w of R, 1-based), ``input_bytes`` per
    batch, ``bytes`` = their product, and whether the plan ``keep``s them."""

    index: int
    kind: str
    pending: int
    input_bytes: int
    bytes: int
    keep: bool


@dataclasses.dataclass(frozen=True)
class PipelineMemoryPlan:
    """Which reversible stages keep their inputs under a ``memory_budget`` (`plan_memory`):
    ``stages`` one `StageKeepCost` per reversible stage, ``budget_bytes`` the budget in bytes."""

    budget_bytes: int
    stages: tuple

    @property
    def kept(self):
        """Indices of the stages that keep their inputs."""
        return [c.index for c in self.stages if c.keep]

    @property
    def kept_bytes(self):
        """The most bytes the kept stages' FIFOs hold at once."""
        return sum(c.bytes for c in self.stages if c.keep)

    @property
    def all_bytes(self):
        """What keeping every reversible stage's inputs would hold (a fraction's 1.0)."""
        return sum(c.bytes for c in self.stages)

    def __str__(self):
        rows = [f"PETRA memory plan: {len(self.kept)} of {len(self.stages)} reversible stages keep their inputs, "
                f"{self.kept_bytes} of {self.budget_bytes} budget bytes (all: {self.all_bytes})",
                f"{'stage':>5}  {'kind':<10} {'pending':>7} {'bytes/batch':>11} {'bytes':>10}  option"]
        rows += [f"{c.index:>5}  {c.kind:<10} {c.pending:>7} {c.input_bytes:>11} {c.bytes:>10}  "
                 f"{'keep' if c.keep else 'rebuild'}" for c in self.stages]
        return "\n".join(rows)


def plan_memory(stages, budget, example, context=None, sizes=None):
    """Sets ``keeps_input`` of the reversible `stages` a `memory_budget` holds and returns the
    `PipelineMemoryPlan` (also each stage's ``memory_plan``). A stage's cost is its input's bytes
    per batch (sized on the meta device from `example`: `input_specs`) times the batches its worker
    holds at once, 2(R - w) + 1 for worker w of R (1-based; `sizes`: the workers' stage counts,
    default one stage per worker). Cheapest first, ties by index: the plan keeps as many stages as
    the budget holds, which skips the most rebuilds; a fraction is of the bytes keeping every
    reversible stage would hold."""
    budget = check_stage_budget(budget)
    sizes = [1] * len(stages) if sizes is None else list(sizes)
    workers = [w for w, n in enumerate(sizes) for _ in range(n)]
    specs = input_specs(stages, example, context)
    costs = []
    for s in stages:
        if s.reversible:
            per_batch = sum(math.prod(shape) * dtype.itemsize
                            for shape, dtype, _ in specs[s.index])
            pending = 2 * (len(sizes) - 1 - workers[s.index]) + 1
            costs.append((per_batch * pending, s.index, s, per_batch, pending))
    all_bytes = sum(c[0] for c in costs)
    budget_bytes = int(budget) if isinstance(budget, int) else math.floor(budget * all_bytes)
    kept, used = set(), 0
    for cost, index, *_ in sorted(costs, key=lambda c: c[:2]):
        if used + cost > budget_bytes:
            break
        kept.add(index)
        used += cost
    plan = PipelineMemoryPlan(budget_bytes, tuple(StageKeepCost(i, s.kind, pending, per_batch, cost, i in kept)
                                                  for cost, i, s, per_batch, pending in costs))
    for s in stages:
        s.keeps_input = s.index in kept
        s.memory_plan = plan
    return plan


def input_specs(stages, example, context=None):
    """Per stage, ``[(shape, dtype, grad dtype)]`` of its input as the pipeline hands it (int64 for
    the fixed-point streams after an exact stage, whose grads are in the receiving stage's float
    dtype), from forwards of copies of the stages on the meta device (`meta_copy`: no real compute
    nor memory; the last listed stage's forward does not run). `example`: the first stage's input
    (a tensor or a tuple; only its shapes and dtypes are read); `context`: a batch's keywords."""
    x = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in _as_tuple(example, "example"))
    context = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in (context or {}).items()}
    specs = []
    with torch.no_grad():
        for s in stages:
            if s.fixed_point_input:
                dtype = s.float_dtype
                specs.append([(tuple(t.shape), torch.int64, dtype) for t in x])
                x = tuple(t.to(dtype) for t in x)
            else:
                specs.append([(tuple(t.shape), t.dtype, t.dtype) for t in x])
            if s is not stages[-1]:
                x = _as_tuple(meta_copy(s.module)(*x, **context), f"the output of stage {s.index}")
    return specs


def meta_copy(module):
    """A deep copy of `module` whose parameters and buffers are on the meta device, made without
    copying their data (a model on a GPU is not copied there first)."""
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in module.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in module.buffers()})
    return copy.deepcopy(module, memo)


def group_sizes(model, groups, balance="count", costs=None, example=None, context=None):
    """The sizes of the R = `groups` contiguous stage groups `partition(model, groups=R, ...)` makes."""
    n = len(_stage_modules(model))
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= n:
        raise ValueError(f"revkernels: groups must be an int in [1, {n}] (the number of stages), got {groups!r}")
    if balance not in BALANCES:
        raise ValueError(f"revkernels: balance must be one of {list(BALANCES)}, got {balance!r}")
    if balance == "count":
        if costs is not None or example is not None or context is not None:
            raise ValueError('revkernels: costs, example and context apply to balance="time" only')
        return count_sizes(n, groups)
    if (costs is None) == (example is None):
        raise ValueError('revkernels: balance="time" needs exactly one of costs (per-stage costs) and example '
                         '(an input batch to time the stages on)')
    if costs is None:
        costs = stage_costs(model, example, context=context)
    else:
        if context is not None:
            raise ValueError("revkernels: context applies to timing an example, not to given costs")
        costs = _as_costs(costs)
        if len(costs) != n:
            raise ValueError(f"revkernels: costs must have one entry per stage ({n}), got {len(costs)}")
    return balanced_sizes(costs, groups)


def _as_costs(costs):
    """`costs` as a list of floats: any iterable (a generator, a NumPy array, a 1-D tensor) of real
    numbers; ValueError for anything else, a bool, or a negative or non-finite cost."""
    if isinstance(costs, torch.Tensor):
        costs = costs.tolist() if costs.dim() == 1 and not costs.dtype.is_complex and costs.dtype != torch.bool else [costs]
    try:
        costs = list(costs)
    except TypeError:
        raise ValueError(f"revkernels: costs must be a sequence of numbers, got {type(costs).__name__}") from None
    if any(isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c < 0 for c in costs):
        raise ValueError(f"revkernels: costs must be finite non-negative numbers, got {costs!r}")
    return [float(c) for c in costs]


def count_sizes(num_stages, groups):
    """Sizes of `groups` contiguous groups of `num_stages` stages by count: differing by at most one, the larger first."""
    q, r = divmod(num_stages, groups)
    return [q + (1 if g < r else 0) for g in range(groups)]


def balanced_sizes(costs, groups):
    """Sizes of the split of `costs` into `groups` contiguous non-empty groups whose largest group sum is
    the smallest possible (exact dynamic programming); among the optimal splits, the lexicographically
    smallest sizes (deterministic)."""
    costs = _as_costs(costs)
    n = len(costs)
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= n:
        raise ValueError(f"revkernels: groups must be an int in [1, {n}] (the number of costs), got {groups!r}")

    def cost(a, b):
        return math.fsum(costs[a:b])

    # best[g][i]: the smallest largest-group sum of costs[i:] in g groups (i <= n - g).
    best = [[math.inf] * (n + 1) for _ in range(groups + 1)]
    for i in range(n):
        best[1][i] = cost(i, n)
    for g in range(2, groups + 1):
        for i in range(n - g + 1):
            best[g][i] = min(max(cost(i, j), best[g - 1][j]) for j in range(i + 1, n - g + 2))
    bound = best[groups][0]
    sizes, i = [], 0
    for g in range(groups, 1, -1):  # the shortest first group that leaves an optimal split of the rest
        j = next(j for j in range(i + 1, n - g + 2) if cost(i, j) <= bound and best[g - 1][j] <= bound)
        sizes.append(j - i)
        i = j
    return sizes + [n - i]


def stage_costs(model, example, warmup=1, reps=5, accum_k=1, context=None):
    """Seconds per tick of each stage of `model` on `example` (the first stage's input, a tensor or a tuple
    of tensors, on the model's device): the shortest of `reps` runs (other load only lengthens a run),
    after `warmup`, of its forward plus
    its backward (rebuild + VJP for a reversible stage, recompute + VJP from the FIFO for the others,
    forward + loss + backward for the last stage) plus 1 / `accum_k` of an optimizer step over its
    parameters (the PETRA trainer's SGD with Nesterov momentum: a parameter-heavy stage pays for it every
    k ticks), the device synchronised around each. `context`: a dict of the keywords every stage
    module takes (an attention mask; constants, as in `train_step`).

    Runs on a deep copy: the model's parameters, grads, BatchNorm statistics and the global RNG state are
    left as they were.
    """
    from revkernels.petra.simulate import make_optimizer  # simulate imports this module

    if warmup < 0 or reps < 1:
        raise ValueError(f"revkernels: warmup must be >= 0 and reps >= 1, got {warmup} and {reps}")
    if isinstance(accum_k, bool) or not isinstance(accum_k, int) or accum_k < 1:
        raise ValueError(f"revkernels: accum_k must be an int >= 1, got {accum_k!r}")
    context = dict(context or {})
    check_constant_context(context)
    modules = copy.deepcopy(_stage_modules(model))
    stages = [Stage(m, i, len(modules)) for i, m in enumerate(modules)]
    x = _as_tuple(example, "example")
    device = x[0].device

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0, out

    out = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        labels = torch.zeros(x[0].shape[0], dtype=torch.long, device=device)
        for s in stages:
            s.module.train()
            optimizer = make_optimizer([s.module], 0.1, 5e-4) if s.parameters() else None
            times = []
            for r in range(warmup + reps):
                if s.is_last:
                    t, _ = timed(lambda: s.forward_backward(x, labels, **context))
                else:
                    t_f, y = timed(lambda: s.forward(x, **context))
                    dy = tuple(torch.full_like(t, 1e-3) for t in y)
                    t_b, _ = timed(lambda: s.backward(y, dy, **context))
                    t = t_f + t_b
                if optimizer is not None:
                    t += timed(lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))[0] / accum_k
                if r >= warmup:
                    times.append(t)
            out.append(min(times))
            if not s.is_last:
                x = y  # the next stage's input
    return out
