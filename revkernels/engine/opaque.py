r"""A reversible run as one opaque op inside a ``torch.compile`` graph.

Under ``torch.compile`` a `ReversibleSequential` with a memory-saving engine calls
``revkernels::reversible_run`` (forward: the blocks without autograd) whose registered autograd
calls ``revkernels::reversible_run_backward`` (rebuild and differentiate, last block first). The
compiler sees two ops with fake implementations, so the user's graph compiles with
``fullgraph=True`` and autograd saves only the run's outputs, the parameters, the run's handle and
the generator states of blocks that draw random numbers (a few KB each): activation memory stays
flat in depth.

Inside an op's kernel the dispatcher leaves out the Autograd keys, so the backward differentiates
with the pure steps of `revkernels.engine.compiled` (``torch.func.vjp``), compiled when the run's
engine is "compiled" and eager otherwise (pareprop and graphs run the sequential schedule there);
the blocks those steps cannot take (module hooks, a forward of their own) run their eager autograd
steps under `revkernels.engine.state.autograd_recording`. The run's module reaches the kernels
through its handle, a 0-d integer tensor the run holds (`new_handle`): Dynamo lifts it as an input
of the traced graph, so runs of the same structure (another instance of the model, a deep copy)
share one graph and each call names its own run. The autocast mode of the forward is an argument,
so the kernels enter it explicitly. BatchNorm running statistics are updated by the forward kernel
(once; the backward uses batch statistics).

Context (``seq(x1, x2, **context)``): its tensors are inputs of both ops (saved once per run, as
with the eager engines), and the backward op returns the grads of those that require grad,
summed over the blocks. Its numbers (int, float, bool) are op arguments too (Dynamo specializes a
float there: a new value traces again). Its structure (names, which tensors require grad) and its
other values reach the kernels through an integer handle, `context_handle`, a constant of the
traced graph; those other values (strings, None, tuples) must be hashable constants of the traced
code. The forward kernel checks the keywords against every F and G (`check_context`: once per
module structure and set of keywords).
"""
import contextlib
import itertools
import weakref
from collections.abc import Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from revkernels.engine import compiled
from revkernels.engine.budget import warn_unplanned
from revkernels.engine.sequential import eager_forward, exact_forward, reverse_blocks, with_buffers
from revkernels.engine.state import (NO_CONTEXT, AutocastState, BlockState, RngState, autograd_recording,
                                     check_context, cuda_devices_of, in_run_modes, run_modes, with_grad_leaves)
from revkernels.engine.structure import LRU, assume_constant_result, branch_count


_RUNS = weakref.WeakValueDictionary()
_NEXT = itertools.count()


def new_handle(seq):
    """A new handle naming `seq` to the kernels: a 0-d int64 CPU tensor, which a
    `ReversibleSequential` keeps as ``_opaque_handle`` (a new one for each copy, see its
    ``__setstate__``). Not an int: Dynamo would bake an int into the graph as a constant and guard
    on the run's identity, so each instance would trace the graph again (up to its recompile limit)."""
    handle = next(_NEXT)
    _RUNS[handle] = seq
    return torch.tensor(handle)


def _run(handle):
    seq = _RUNS.get(int(handle))
    if seq is None:
        raise RuntimeError(f"revkernels: the ReversibleSequential of compiled run {int(handle)} no longer exists")
    return seq


# (tensor names, whether each requires grad, number names, other (name, value) pairs) -> handle, and
# back: the most recently used MAX_CONTEXT_SPECS (each distinct non-number value of a context keyword
# is a spec of its own, and a graph compiled with it holds its handle as a constant)
MAX_CONTEXT_SPECS = 4096
_CONTEXT_HANDLES = LRU(MAX_CONTEXT_SPECS)
_CONTEXT_SPECS = LRU(MAX_CONTEXT_SPECS)
_NEXT_CONTEXT = itertools.count()


@assume_constant_result
def context_handle(names, requires_grad, number_names, values):
    """The integer naming a context's structure to the kernels (a constant of the traced graph):
    the `names` of its tensors (in the order the ops get them), whether each `requires_grad`, the
    names of its numbers (likewise) and its other ``(name, value)`` pairs."""
    spec = (names, requires_grad, number_names, values)
    try:
        handle = _CONTEXT_HANDLES.get(spec)
    except TypeError:
        raise TypeError("revkernels: under torch.compile the context values that are not tensors or numbers must "
                        f"be hashable, got {dict(values)}") from None
    if handle is None:
        handle = _CONTEXT_HANDLES[spec] = next(_NEXT_CONTEXT)
    _CONTEXT_SPECS[handle] = spec
    return handle


def context_spec(handle):
    """The context structure `context_handle` named `handle`."""
    spec = _CONTEXT_SPECS.get(handle)
    if spec is None:
        raise RuntimeError(f"revkernels: context structure {handle} of a compiled run is no longer known: more than "
                           f"{MAX_CONTEXT_SPECS} distinct context values were compiled since (pass values that vary "
                           "per step as tensors or numbers; torch._dynamo.reset() drops the old graphs)")
    return spec


@assume_constant_result
def _raise_nested_tensors(names):
    # (raised from a function run at trace time, so the message reaches the caller as it is)
    raise TypeError(f"revkernels: under torch.compile the context's tensors must be keywords of their own, got "
                    f"tensors inside a container for {', '.join(map(repr, names))}")


def _context(handle, tensors, numbers, leaves=False):
    """The context dict of `handle` around `tensors` and `numbers`; with `leaves`, each tensor that
    requires grad replaced by a detached leaf requiring grad. Returns ``(context, leaves)``."""
    names, requires_grad, number_names, values = context_spec(handle)
    context = {**dict(values), **dict(zip(number_names, numbers)), **dict(zip(names, tensors))}
    if not leaves:
        return context, []
    return with_grad_leaves(context, [name for name, grad in zip(names, requires_grad) if grad])


def grad_params(module):
    """The parameters of `module` that require grad, read at every call (traced by Dynamo)."""
    return [p for p in module.parameters() if p.requires_grad]


def _autocast(device_type, dtype):
    return AutocastState(device_type, dtype is not None, dtype or torch.float32, True).enter()


def _steps(seq, device_type):
    return compiled.compiled_steps(seq, device_type) if seq.engine_in_use == "compiled" else None


# Generator states travel from the forward to the backward kernel as one uint8 tensor: per block
# that draws random numbers, the CPU state and each CUDA device's, before F and (full blocks) G.

def _state_bytes(devices):
    return torch.get_rng_state().numel() + sum(torch.cuda.get_rng_state(d).numel() for d in devices)


def _pack(states, devices):
    rows = [torch.cat([s.cpu] + [s.cuda[d] for d in devices])
            for state in states if state is not None for s in (state.rng_f, state.rng_g) if s is not None]
    return torch.stack(rows) if rows else torch.empty(0, _state_bytes(devices), dtype=torch.uint8)


def _unpack(packed, blocks, random_flags, devices):
    sizes = [torch.get_rng_state().numel()] + [torch.cuda.get_rng_state(d).numel() for d in devices]
    rows = iter(packed)

    def state():
        parts = next(rows).split(sizes)
        rng = RngState.__new__(RngState)
        rng.cpu, rng.cuda = parts[0].clone(), {d: p.clone() for d, p in zip(devices, parts[1:])}
        return rng

    states = []
    for block, random in zip(blocks, random_flags):
        if not random:
            states.append(None)
        elif branch_count(block) == 1:
            states.append(BlockState(state(), None))
        else:
            states.append(BlockState(state(), state()))
    return states


def _random_flags(seq):
    return [seq.preserve_rng_state and block.draws_random() for block in seq.blocks]


def _random_rows(seq):
    return sum(branch_count(b) for b, r in zip(seq.blocks, _random_flags(seq)) if r)


# What the backward kernel must see as the forward kernel saw it stays on the host, keyed by a weak
# reference to the memory of the run's output y1, which the backward kernel gets (saved): each
# block's train/eval mode (``model.eval()`` between a forward and its backward must not change the
# recompute, as the eager engines' `as_in_the_forward`), the parameters that required grad (the
# backward's grads are aligned to them: a parameter frozen or unfrozen in between gets what it
# would under the eager engines) and the buffers each block's forward changed, with their old
# values (for the recompute, see revkernels.engine.structure.BufferRecord). The tensor objects are
# not the same (nor alive throughout: a loss of the outputs drops them), the memory is; an entry
# whose memory was freed (its backward ran, or never will) goes at the next forward.
_FORWARDS = {}  # StorageWeakRef -> (run handle, _Forward)


class _Forward:
    __slots__ = ("modes", "params", "buffers")

    def __init__(self, modes, params, buffers):
        self.modes, self.params, self.buffers = modes, params, buffers


def _keep_forward(handle, y1, forward):
    for ref in [ref for ref in _FORWARDS if ref.expired()]:
        del _FORWARDS[ref]
    _FORWARDS[StorageWeakRef(y1.untyped_storage())] = (int(handle), forward)


def _kept_forward(handle, y1):
    entry = _FORWARDS.get(StorageWeakRef(y1.untyped_storage()))
    if entry is None or entry[0] != int(handle):
        raise RuntimeError("revkernels: no forward record for this reversible run's backward (its output was not "
                           "made by revkernels::reversible_run)")
    return entry[1]


def _outputs(outputs, layouts, inputs):
    """`outputs` as the fake kernels describe them: each laid out as ``torch.empty_like`` of its
    entry of `layouts` (the streams as the run's inputs, the grads as what they are the grads of),
    and a copy where it shares memory with an input or an earlier output (an op's outputs may alias
    neither: a HalfCouplingBlock passes x2 through and dy2 back as dx1, and a parameter's grad can be
    an output grad itself, e.g. an additive table's)."""
    taken = {x.untyped_storage().data_ptr() for x in inputs}
    result = []
    for t, like in zip(outputs, layouts, strict=True):
        if t.untyped_storage().data_ptr() in taken or t.stride() != like.stride():
            t = torch.empty_like(like, dtype=t.dtype).copy_(t)
        taken.add(t.untyped_storage().data_ptr())
        result.append(t)
    return result


@torch.library.custom_op("revkernels::reversible_run", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def reversible_run(handle: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, params: list[torch.Tensor],
                   context: int, context_tensors: list[torch.Tensor], context_numbers: Sequence[int | float | bool],
                   autocast_dtype: torch.dtype | None, rng_rows: int, exact: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The run's forward without autograd: ``(y1, y2, generator states, fixed-point streams)``.
    `handle`: the run's `new_handle`. `context`: a `context_handle` (its tensors and numbers:
    `context_tensors`, `context_numbers`). `rng_rows`: the rows of the generator states
    (`_random_rows` of the run when traced, for the fake kernel; Dynamo guards on what it read to
    count them). `exact`: the run is in exact mode: y1, y2 are the views of its last int64 streams,
    returned too (what the backward rebuilds from); else the last output is empty."""
    seq = _run(handle)
    devices = cuda_devices_of(x1, x2)
    inputs = (x1, x2)
    context, _ = _context(context, context_tensors, context_numbers)
    if context:
        check_context(seq, seq.blocks, context)
    if seq.memory_budget:
        warn_unplanned(seq, x1, x2, context)
    fixed = []
    # autograd_recording: the dispatch keys of an eager call, so that compiled steps called here and
    # eagerly share their graphs (the keys are guarded on); nothing records under no_grad
    with autograd_recording(), _autocast(x1.device.type, autocast_dtype):
        steps = _steps(seq, x1.device.type)
        if exact:  # (the exact steps, eagerly, whatever the engine: see revkernels.nn.exact)
            streams = seq.fixed_point_streams(x1.dtype)
            s1, s2, states, _ = exact_forward(seq, x1, x2, context, streams, monitored=False)
            x1, x2, fixed = streams.view(s1), streams.view(s2), [s1, s2]
        elif steps is None:
            x1, x2, states, _ = eager_forward(seq, x1, x2, context, monitored=False)
        else:
            x1, x2, states = compiled.forward_blocks(list(seq.blocks), x1, x2, steps, seq.preserve_rng_state, context)
    y1, y2 = _outputs((x1, x2), inputs, inputs)
    fixed = _outputs(fixed, inputs, (*inputs, y1, y2)) if fixed else fixed
    changed = [getattr(state, "buffers", ()) for state in states]
    # (`params`: the module's parameters themselves, which a scan of the modules would rebuild per call)
    _keep_forward(handle, y1, _Forward(run_modes(seq.blocks), list(params),
                                       changed if any(changed) else ()))
    return y1, y2, _pack(states, devices), fixed


@reversible_run.register_fake
def _(handle, x1, x2, params, context, context_tensors, context_numbers, autocast_dtype, rng_rows, exact):
    fixed = [torch.empty_like(x1, dtype=torch.int64), torch.empty_like(x2, dtype=torch.int64)] if exact else []
    return torch.empty_like(x1), torch.empty_like(x2), \
        torch.empty(rng_rows, _state_bytes(cuda_devices_of(x1, x2)), dtype=torch.uint8), fixed


@torch.library.custom_op("revkernels::reversible_run_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def reversible_run_backward(handle: torch.Tensor, y1: torch.Tensor, y2: torch.Tensor, dy1: torch.Tensor, dy2: torch.Tensor,
                            rng: torch.Tensor, params: list[torch.Tensor], context: int,
                            context_tensors: list[torch.Tensor], context_numbers: Sequence[int | float | bool],
                            autocast_dtype: torch.dtype | None, fixed: list[torch.Tensor]
                            ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """``(dx1, dx2, param grads, context grads)`` of the run from its outputs and their grads
    (zeros for a parameter or context tensor no block used); context grads for the context
    tensors that require grad, in order. `fixed`: an exact run's int64 output streams (the
    rebuild starts from them, through the exact steps), or empty."""
    seq = _run(handle)
    blocks = list(seq.blocks)
    forward = _kept_forward(handle, y1)  # (kept while y1, saved for this backward, lives)
    autocast_state = AutocastState(y1.device.type, autocast_dtype is not None, autocast_dtype or torch.float32, True)
    context, leaves = _context(context, context_tensors, context_numbers, leaves=True)
    with contextlib.ExitStack() as stack:
        in_run_modes(stack, blocks, forward.modes)
        states = _unpack(rng, blocks, _random_flags(seq), cuda_devices_of(y1, y2))
        for i, changed in enumerate(forward.buffers):
            states[i] = with_buffers(states[i], changed)
        with autograd_recording():  # as in the forward kernel
            if fixed:
                steps = seq.fixed_point_streams(y1.dtype).steps(blocks)
                _, _, dx1, dx2, grads = reverse_blocks(steps, states, *fixed, dy1, dy2, forward.params + leaves,
                                                       autocast_state, context=context)
            else:
                _, _, dx1, dx2, grads = compiled.backward_blocks(blocks, states, y1, y2, dy1, dy2,
                                                                 forward.params + leaves, _steps(seq, y1.device.type),
                                                                 autocast_state, context)
    inputs = (y1, y2, dy1, dy2, *params, *context_tensors)
    grad_tensors = [torch.zeros_like(t) if g is None else g for t, g in zip(params + leaves, grads, strict=True)]
    dx1, dx2, *grad_tensors = _outputs((dx1, dx2, *grad_tensors), (y1, y2, *params, *leaves), inputs)
    return dx1, dx2, grad_tensors[:len(params)], grad_tensors[len(params):]


@reversible_run_backward.register_fake
def _(handle, y1, y2, dy1, dy2, rng, params, context, context_tensors, context_numbers, autocast_dtype, fixed):
    requires_grad = context_spec(context)[1]
    return torch.empty_like(y1), torch.empty_like(y2), [torch.empty_like(p) for p in params], \
        [torch.empty_like(t) for t, grad in zip(context_tensors, requires_grad) if grad]


def _setup_context(ctx, inputs, output):
    handle, _, _, params, context, context_tensors, context_numbers, autocast_dtype, _, _ = inputs
    y1, y2, rng, fixed = output
    ctx.context, ctx.autocast_dtype, ctx.num_params = context, autocast_dtype, len(params)
    ctx.context_numbers, ctx.num_fixed = context_numbers, len(fixed)
    ctx.save_for_backward(handle, y1, y2, rng, *fixed, *params, *context_tensors)


def _backward(ctx, dy1, dy2, _drng, _dfixed):
    handle, y1, y2, rng, *saved = ctx.saved_tensors
    fixed, saved = saved[:ctx.num_fixed], saved[ctx.num_fixed:]
    params, context_tensors = saved[:ctx.num_params], saved[ctx.num_params:]
    dy1 = torch.zeros_like(y1) if dy1 is None else dy1
    dy2 = torch.zeros_like(y2) if dy2 is None else dy2
    dx1, dx2, grads, context_grads = reversible_run_backward(handle, y1, y2, dy1, dy2, rng, params, ctx.context,
                                                             context_tensors, ctx.context_numbers, ctx.autocast_dtype,
                                                             list(fixed))
    context_grads = iter(context_grads)
    requires_grad = context_spec(ctx.context)[1]
    return (None, dx1, dx2, grads, None, [next(context_grads) if grad else None for grad in requires_grad],
            [] if not ctx.context_numbers else None, None, None, None)  # (an empty list counts as a tensor list)


reversible_run.register_autograd(_backward, setup_context=_setup_context)


def run_opaque(seq, x1, x2, context=NO_CONTEXT):
    """`seq`'s run as one opaque op (what `ReversibleSequential` calls under torch.compile)."""
    device_type = x1.device.type
    autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    names = tuple(k for k, v in context.items() if isinstance(v, torch.Tensor))
    number_names = tuple(k for k, v in context.items() if isinstance(v, (int, float, bool)))
    values = tuple((k, v) for k, v in context.items() if k not in names and k not in number_names)
    nested = tuple(name for name, value in values if isinstance(value, (tuple, list, dict))
                   and any(isinstance(t, torch.Tensor) for t in tree_leaves(value)))
    if nested:
        _raise_nested_tensors(nested)
    tensors, numbers = [context[k] for k in names], [context[k] for k in number_names]
    handle = context_handle(names, tuple(t.requires_grad for t in tensors), number_names, values)
    y1, y2, _, _ = reversible_run(seq._opaque_handle, x1, x2, grad_params(seq), handle, tensors, numbers,
                                  autocast_dtype, _random_rows(seq), seq.exact)
    return y1, y2
