r"""PETRA's stages: a model's stage list turned into units that run forward and backward apart.

`partition(model)` gives one `Stage` per entry of ``model.stages`` (or of a list of modules). A
stage's forward and its backward for the same batch happen at different ticks, with the stage's
parameters possibly updated in between; the backward always uses the *current* parameters:

- reversible stage (a `ReversibleBlock`, e.g. RevNet's ``y = (x2, x1 + F(x2))``): stores nothing.
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
import math
import numbers
import time
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from revkernels.engine.sequential import forward_step
from revkernels.engine.state import BlockState, RngState, cuda_devices_of, maybe_replay
from revkernels.engine.structure import draws_random, recompute_context
from revkernels.nn.reversible import ReversibleBlock, ReversibleSequential, check_streams

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
    """

    def __init__(self, module, index, num_stages, delayed=False):
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
        # A one-block run whose `reverse` rebuilds the input and adds the parameter grads into .grad.
        self._run = ReversibleSequential(module, engine="sequential") if reversible else None
        self.delayed = bool(delayed)
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

    # --- buffer accounting -----------------------------------------------------------------------

    @property
    def buffered_inputs(self):
        """Number of inputs (batches) held in the FIFO; always 0 for reversible stages (unless delayed)
        and the head."""
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

        `x`: the image (first stage) or the previous stage's output tuple. A non-reversible stage
        pushes (batch, x) onto its FIFO. Returns the output as a tuple of tensors (detached).
        `context`: keywords passed to the stage's module (a reversible stage's F and G); the
        backward of the same batch must get the same ones.
        """
        if self.is_last:
            raise RuntimeError("revkernels: the last stage runs forward and backward together: call forward_backward")
        x = tuple(t.detach() for t in _as_tuple(x))
        stochastic = draws_random(self.module)
        rebuilds = self.reversible and not self.delayed  # (its backward rebuilds the input from the output)
        if self.delayed:
            self._fifo.append((batch, x, tuple(p.detach().clone() for p in self.parameters())))
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        elif not self.reversible:
            self._fifo.append((batch, x, None))
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        number = self._forwards
        self._forwards += 1
        with torch.no_grad(), self._stream.drawing(cuda_devices_of(*x)) if stochastic else contextlib.nullcontext():
            if rebuilds and stochastic:
                if len(x) != 2:
                    raise ValueError(f"revkernels: a reversible stage's input has two streams, got {len(x)} tensors")
                check_streams(*x)
                y1, y2, state = forward_step(self.module, *x, True, context)
                self._replays.append((number, state))
                return y1, y2
            rng = RngState(cuda_devices_of(*x)) if stochastic else None
            out = self.module(*x, **context)
        if rng is not None:
            self._replays.append((number, rng))
        return _as_tuple(out, f"the output of stage {self.index}")

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
        if self.reversible and not self.delayed:
            if len(y) != 2:
                raise ValueError(f"revkernels: a reversible stage's output has two streams, got {len(y)} tensors")
            state = self._next_replay()
            x1, x2, dx1, dx2 = self._run.reverse(y[0].detach(), y[1].detach(), dy[0], dy[1], **context) \
                if state is None else self._run.reverse_with_states(y[0].detach(), y[1].detach(), dy[0], dy[1],
                                                                    [state], context)
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
        return tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in x)

    def _vjp(self, x, y, dy, context, rng=None):
        leaves = self._leaves(x)
        with torch.enable_grad(), recompute_context(self.module), maybe_replay(rng):
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
        leaves = self._leaves(x)
        stream = self._stream.drawing(cuda_devices_of(*x)) if draws_random(self.module) else contextlib.nullcontext()
        with torch.enable_grad(), stream:
            logits = self.module(*leaves, **context)
            if not isinstance(logits, torch.Tensor):
                raise TypeError(f"revkernels: the last stage must return logits (a tensor), got {type(logits).__name__}")
            loss = F.cross_entropy(logits, labels)
            loss.backward()
        dx = None if self.is_first else tuple(t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves)
        return loss.detach(), logits.detach(), x, dx


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


def partition(model, delayed=False, groups=None, balance="count", costs=None, example=None, context=None):
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
    """
    modules = _stage_modules(model)
    stages = [Stage(m, i, len(modules), delayed=delayed) for i, m in enumerate(modules)]
    if groups is None:
        if balance != "count" or costs is not None or example is not None or context is not None:
            raise ValueError("revkernels: balance, costs, example and context apply to partition(model, groups=R) only")
        return stages
    sizes = group_sizes(modules, groups, balance, costs, example, context)
    out, start = [], 0
    for n in sizes:
        out.append(stages[start:start + n])
        start += n
    return out


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
