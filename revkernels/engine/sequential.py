"""The sequential engine: one autograd Function over a run of reversible blocks.

Forward: the blocks run without autograd; only the run's outputs (y1, y2) are saved, with each
block's generator states (a few KB of host memory) so the recompute replays its randomness, and
the old values of buffers its forward changed (`forward_step`).
Backward, last block first: ``recompute`` rebuilds the block's input from its output under the
forward's autocast mode, ``grads`` turns the output grads into input and parameter grads. The
parameters are inputs of the Function, so their grads reach ``.grad`` through autograd's normal
accumulation (tensor hooks, DDP's reducer and gradient accumulation see them as usual).

Blocks sharded one by one by FSDP2 run one autograd node per block instead, with the same steps
(`revkernels.engine.fsdp`).

Context (``seq(x1, x2, **context)``): the context's tensors are saved once per run; those that
require grad are inputs of the Function too. The backward hands every block the same detached
leaf per such tensor and differentiates it like a parameter (the walker's `params` end with the
leaves), so its grad is summed over the blocks before it leaves the Function.
"""
import contextlib
import dataclasses
import warnings

import torch
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_flatten, tree_unflatten

from revkernels.engine.fsdp import block_units, run_sharded
from revkernels.engine.state import (CONTEXT_CONTAINERS, NO_CONTEXT, AutocastState, BlockState,
                                     call_with_context, check_param_versions, differentiated_once, grad_tensors,
                                     in_run_modes, param_versions, check_randomness_after, randomness_before, records_graph,
                                     run_modes, with_grad_leaves)
from revkernels.engine.structure import (buffers_as_before, buffers_kept, invalidate, param_slots,
                                         parametrize_cache_off, record_buffers, swapped_params, unique_params,
                                         y2_only_params)


def reverse_blocks(blocks, states, y1, y2, dy1, dy2, params, autocast_state=None, monitor=None, context=NO_CONTEXT,
                   step=None):
    """Walks `blocks` backwards from their output (y1, y2) and its grads (dy1, dy2).

    Returns ``(x1, x2, dx1, dx2, param_grads)`` with `param_grads` aligned to `params` (None for a
    parameter no block used). `states` holds each block's `BlockState` (None: no RNG replay).
    `monitor`: None, or ``(ReconstructionMonitor, samples)`` from a sampled forward: each rebuilt
    input is compared with its sample (see `revkernels.check.monitor_reconstruction`).
    `context`: the keywords of every F and G (a dict); its tensors that require grad must be in
    `params` to get grads. `step`: one block's backward, ``step(position, block, state, y1, y2, dy1,
    dy2, autocast, context) -> (x1, x2, dx1, dx2, [(parameter, grad), ...])``: `eager_backward` (the
    blocks' own ``recompute`` and ``grads``) unless given (the compiled engine's pure steps).
    """
    step = eager_backward if step is None else step
    index = {id(p): i for i, p in enumerate(params)}
    param_grads = [None] * len(params)
    autocast = contextlib.nullcontext if autocast_state is None or autocast_state.off_then_and_now() else autocast_state.enter
    # (a parameter that did not require grad when the forward ran gets none, as with autograd)
    errors = [None] * len(blocks)
    for i in reversed(range(len(blocks))):
        block = blocks[i]
        if states is None:  # (no forward record, `seq.reverse`: the recompute leaves the buffers as it found them)
            with buffers_kept(block):
                y1, y2, dy1, dy2, grads = step(i, block, None, y1, y2, dy1, dy2, autocast, context)
        else:
            y1, y2, dy1, dy2, grads = step(i, block, states[i], y1, y2, dy1, dy2, autocast, context)
        if monitor is not None:
            errors[i] = monitor[0].error(monitor[1][i], y1, y2)
        add_param_grads(param_grads, index, grads)
        del grads  # (the step's local graphs are gone with its frame, before the next block's are built)
    if monitor is not None:
        monitor[0].report(errors)
    return y1, y2, dy1, dy2, param_grads


def eager_backward(position, block, state, y1, y2, dy1, dy2, autocast, context=NO_CONTEXT):
    """`reverse_blocks`' step through the block's own steps: `recompute_step` under the forward's
    autocast mode, then `block_grads`."""
    with autocast():
        rec = recompute_step(block, y1, y2, state, context)
    grads = block_grads(block, rec, y1, y2, dy1, dy2)
    return rec.x1, rec.x2.detach(), grads.dx1, grads.dx2, zip(grads.params, grads.param_grads)


def add_param_grads(param_grads, index, pairs):
    """Adds each (parameter, grad) of `pairs` into ``param_grads[index[id(parameter)]]``; a None
    grad, and a parameter not in `index` (it did not require grad when the forward ran: no grad, as
    with autograd), are skipped."""
    for p, grad in pairs:
        k = index.get(id(p))
        if grad is None or k is None:
            continue
        param_grads[k] = grad if param_grads[k] is None else param_grads[k] + grad


def forward_step(block, x1, x2, preserve_rng_state, context=NO_CONTEXT, steps=None, position=None):
    """``block.forward_with_state`` (`call_with_context`), under ``parametrize.cached()`` without
    filling its cache (`parametrize_cache_off`: the forward runs without grad). The buffers the forward changed go
    into the returned state with their old values (`record_buffers`), for `recompute_step`; the
    first forward in each mode warns if the block drew random numbers it does not declare
    (`check_randomness_after`). `steps`: an object whose ``forward_with_state`` runs instead of the
    block's (exact mode's steps on fixed-point streams, ``revkernels.nn.exact.ExactSteps``; the
    compiled engine's, `revkernels.engine.compiled.PureSteps`). `position`: the block's index in
    its run, for warnings."""
    record = record_buffers(block)
    before = randomness_before(block, x1, x2) if preserve_rng_state else None
    run = (block if steps is None else steps).forward_with_state
    if parametrize._cache_enabled:
        with parametrize_cache_off(block):
            out = call_with_context(run, x1, x2, preserve_rng_state, context=context)
    else:  # (call_with_context's call, written out: the step's hot path)
        out = run(x1, x2, preserve_rng_state, context=context) if context else run(x1, x2, preserve_rng_state)
    if before is not None:
        check_randomness_after(block, before)
    if record is None:
        return out
    x1, x2, state = out
    name = type(block).__name__
    return x1, x2, with_buffers(state, record.changed(lambda: name if position is None else f"blocks[{position}] ({name})"))


def with_buffers(state, changed):
    """A block's forward `state` holding `changed` (`BufferRecord.changed`) as its ``buffers``."""
    if not changed:
        return state
    if state is None:
        return BlockState(None, None, changed)
    if isinstance(state, BlockState):
        return dataclasses.replace(state, buffers=changed)
    try:
        state.buffers = changed  # a state of a block's own kind
    except AttributeError:
        warnings.warn(f"revkernels: a {type(state).__name__} (a block's forward state) cannot hold the buffers "
                      "its forward changed; the recompute sees their new values (return a BlockState)",
                      UserWarning, stacklevel=3)
    return state


def recompute_step(block, y1, y2, state, context=NO_CONTEXT):
    """``block.recompute`` (`call_with_context`), with the buffers the forward changed as they were
    before it (`buffers_as_before`)."""
    changed = getattr(state, "buffers", ())
    if changed:
        with buffers_as_before(changed):
            return call_with_context(block.recompute, y1, y2, state, context=context)
    return call_with_context(block.recompute, y1, y2, state, context=context)


@contextlib.contextmanager
def as_in_the_forward(ctx):
    """The body (a backward walk) runs with the blocks as the run's forward left them: in the
    train/eval mode each block and each of its submodules had and with the rates its random layers
    had (``model.eval()``, a submodule's ``eval()`` or a dropout probability changed between a
    forward and its backward would recompute dropout and BatchNorm otherwise: `in_mode`), and
    holding the parameters the forward used
    (`revkernels.engine.structure.swapped_params`). Reads ``ctx.run_blocks`` (the run's ModuleList),
    ``ctx.blocks``, ``ctx.all_params`` and ``ctx.modes``, set by `save_forward_state`. A parameter
    changed in place since the forward raises autograd's error (`check_param_versions`)."""
    check_param_versions(ctx.all_params, ctx.param_versions, ctx.run_blocks, "blocks.")
    swapped = swapped_params(ctx.run_blocks, ctx.all_params)
    changed = run_modes(ctx.run_blocks)[0] != ctx.modes[0]
    if not swapped and not changed:
        yield
        return
    with contextlib.ExitStack() as stack:
        in_run_modes(stack, ctx.blocks, ctx.modes)
        if swapped:
            stack.callback(invalidate)  # runs last: after the parameters are back
            for block in ctx.blocks:
                slots = param_slots(block)
                aliases = {i: swapped[id(p)] for i, p in enumerate(slots.params) if id(p) in swapped}
                if aliases:
                    stack.enter_context(slots.substituted(aliases))
            invalidate()
        yield


def save_forward_state(ctx, seq, all_params):
    """What `as_in_the_forward` needs, kept on `ctx` by a run's forward."""
    ctx.run_blocks, ctx.all_params, ctx.modes = seq.blocks, all_params, run_modes(seq.blocks)
    ctx.param_versions = param_versions(all_params)


def output_grads(blocks, y1, y2, dy1, dy2):
    """``(dy1, dy2, unused)``: the run's output grads (the engines' Functions leave one the loss did
    not use None): zeros for dy1 (`grad_zeros`), None kept for dy2 (see `block_grads`), and the ids
    of the parameters that then get no grad at all (`revkernels.engine.structure.y2_only_params`)."""
    unused = y2_only_params(blocks) if dy2 is None else frozenset()
    return (grad_zeros(y1, dy2) if dy1 is None else dy1), dy2, unused


def grad_zeros(y, other):
    """Zeros for the missing grad of stream `y`, in the dtype of the other stream's grad `other`
    (None: y's): the two grads share one float dtype, which exact mode's int64 streams do not have."""
    return torch.zeros_like(y, dtype=None if other is None else other.dtype)


def block_grads(block, rec, y1, y2, dy1, dy2):
    """``block.grads(rec, dy1, dy2)`` for the walkers; (y1, y2) is the block's output. A missing
    grad of it (None: the loss did not use it) is zeros for dy1, which only adds to the grads, and
    stays None for dy2 where the block's ``grads`` takes it (revkernels' own blocks:
    `takes_missing_dy2`), which then do not differentiate the branch only y2 depends on, as plain
    autograd never does: a zero grad through a Jacobian with NaN or inf there
    (``torch.where(y > 0, y.sqrt(), 0)``) gives NaN. A block's own ``grads`` gets zeros."""
    if dy1 is None:
        dy1 = grad_zeros(y1, dy2)
    if dy2 is None and not getattr(type(block).grads, "takes_missing_dy2", False):
        dy2 = grad_zeros(y2, dy1)
    return block.grads(rec, dy1, dy2)


def without_unused(params, grads, unused):
    """`grads` (aligned to `params`, then to the context leaves) with None for the parameters whose
    ids are in `unused`."""
    if not unused:
        return grads
    return [None if k < len(params) and id(params[k]) in unused else g for k, g in enumerate(grads)]


def save_with_context(ctx, context, *tensors):
    """``ctx.save_for_backward(*tensors)`` plus the context's tensors: each top-level one, then
    those inside a tuple, list or dict value (which never require grad: `check_context_grads`), so
    the backward sees the tensors the forward saw (an element the caller replaces later is not
    seen; one changed in place raises autograd's error, as for a saved tensor). Other values stay
    on `ctx`. Undone by `saved_with_context`."""
    names = [k for k, v in context.items() if isinstance(v, torch.Tensor)]
    ctx.context_names = names
    ctx.context_grad = [context[k].requires_grad for k in names]
    ctx.context_values, ctx.context_containers, nested = {}, {}, []
    for k, v in context.items():
        if isinstance(v, CONTEXT_CONTAINERS):  # kept as its leaves (tensors saved) and structure
            leaves, spec = tree_flatten(v)
            nested += [t for t in leaves if isinstance(t, torch.Tensor)]
            ctx.context_containers[k] = ([None if isinstance(t, torch.Tensor) else t for t in leaves], spec)
        elif k not in names:
            ctx.context_values[k] = v
    ctx.save_for_backward(*tensors, *(context[k] for k in names), *nested)


def saved_with_context(ctx, count):
    """``(the first `count` saved tensors, context, leaves)`` in a backward: the context rebuilt
    with a fresh detached leaf (requiring grad) for each context tensor that required grad, and
    those leaves in context order (what the walker differentiates like parameters)."""
    saved = ctx.saved_tensors
    if not ctx.context_names and not ctx.context_containers:
        return saved[:count], ctx.context_values or NO_CONTEXT, []
    context = {**ctx.context_values, **{name: t.detach() for name, t in zip(ctx.context_names, saved[count:])}}
    context, leaves = with_grad_leaves(context, [n for n, grad in zip(ctx.context_names, ctx.context_grad) if grad])
    nested = iter(saved[count + len(ctx.context_names):])
    for name, (values, spec) in ctx.context_containers.items():
        context[name] = tree_unflatten([next(nested) if v is None else v for v in values], spec)
    return saved[:count], context, leaves


def walk_forward(blocks, x1, x2, preserve_rng_state, context=NO_CONTEXT, steps=None, monitor=None):
    """Runs `blocks` forward without autograd, each through `forward_step` (`steps`: one per block,
    or None): ``(y1, y2, states, samples)``, `samples` each block's input sampled by `monitor` (a
    `revkernels.check.ReconstructionMonitor` on a sampled step, or None: no samples)."""
    states, samples = [], []
    with torch.no_grad():
        for i, block in enumerate(blocks):
            if monitor is not None:
                samples.append(monitor.sample(x1, x2))
            x1, x2, state = forward_step(block, x1, x2, preserve_rng_state, context, None if steps is None else steps[i], i)
            states.append(state)
    return x1, x2, states, samples


def eager_forward(seq, x1, x2, context, steps=None, monitored=True):
    """`walk_forward` over `seq`'s blocks: ``(y1, y2, states, monitor)``, `monitor` the
    reconstruction monitor and its samples on a sampled step (None otherwise, and without
    `monitored`; see `revkernels.check.monitor_reconstruction`)."""
    monitor = getattr(seq, "reconstruction_monitor", None) if monitored else None
    if monitor is not None and (seq.engine_in_use == "graphs" or not monitor.begin_forward()):
        monitor = None  # not a sampled step (graphs: replayed graphs cannot host-sync)
    y1, y2, states, samples = walk_forward(seq.blocks, x1, x2, seq.preserve_rng_state, context, steps, monitor)
    return y1, y2, states, None if monitor is None else (monitor, samples)


class ReversibleRun(torch.autograd.Function):
    """One autograd node for a run of reversible blocks, whatever steps them: `forward` runs the
    blocks without autograd (`eager_forward`'s signature: the blocks' own steps, or the compiled
    engine's), `walker` walks them backwards (`reverse_blocks`' signature: sequential, two streams
    in pareprop, the compiled engine's steps). In exact mode (`streams`, a
    ``revkernels.nn.exact.FixedPointStreams``) the blocks step on int64 streams through the exact
    steps: the node rounds its float input onto the grid, saves the last int64 streams and returns
    their float views; its input grads are the walker's (straight-through)."""

    @staticmethod
    def forward(ctx, seq, params, all_params, schedule, context, x1, x2, *tensors):
        # tensors: the parameters, then the context tensors that require grad; all_params: the
        # run's `unique_params`, of which `params` are those that require grad
        context = NO_CONTEXT if context is None else context
        forward, ctx.walker, ctx.streams = schedule
        ctx.blocks = list(seq.blocks)
        if ctx.streams is None:
            y1, y2, ctx.states, ctx.monitor = forward(seq, x1, x2, context)
            outputs = y1, y2
        else:
            y1, y2, ctx.states, ctx.monitor = exact_forward(seq, x1, x2, context, ctx.streams)
            outputs = ctx.streams.view(y1), ctx.streams.view(y2)
            ctx.streams.forget_views()  # (the backward converts again rather than keep floats)
            ctx.streams.outputs = y1, y2  # (saved below anyway: a caller may go on from them exactly)
        save_forward_state(ctx, seq, all_params)
        ctx.params = params
        ctx.autocast_state = AutocastState.capture(x1.device.type)
        save_with_context(ctx, context, y1, y2)
        ctx.set_materialize_grads(False)  # see output_grads
        return outputs

    @staticmethod
    @differentiated_once
    def backward(ctx, dy1, dy2):
        (y1, y2), context, leaves = saved_with_context(ctx, 2)
        streams = ctx.streams
        with as_in_the_forward(ctx):
            dy1, dy2, unused = output_grads(ctx.blocks, y1, y2, dy1, dy2)
            _, _, dx1, dx2, grads = ctx.walker(
                ctx.blocks if streams is None else streams.steps(ctx.blocks), ctx.states, y1, y2, dy1, dy2,
                ctx.params + leaves, ctx.autocast_state, monitor=ctx.monitor, context=context
            )
        grads = without_unused(ctx.params, grads, unused)
        # The states stay: a second backward (retain_graph=True) replays the same randomness.
        ctx.monitor = None  # its samples are compared once
        return (None, None, None, None, None, dx1, dx2, *grads)


def exact_forward(seq, x1, x2, context, streams, monitored=True):
    """`eager_forward` in exact mode: the float input rounded onto `streams`' grid, the blocks'
    exact steps, and the overflow flags read once at the end (raising, naming the block)."""
    with torch.no_grad():
        _, x1 = streams.enter(x1)
        _, x2 = streams.enter(x2)
    y1, y2, states, monitor = eager_forward(seq, x1, x2, context, streams.steps(seq.blocks), monitored)
    streams.raise_on_overflow()
    return y1, y2, states, monitor


def run_reversible(seq, x1, x2, walker, context=NO_CONTEXT, param_inputs=None, forward=eager_forward):
    """Runs `seq`'s blocks as one `ReversibleRun` stepped forward by `forward` and backwards by
    `walker` (in exact mode, ``seq.exact``, on fixed-point streams: see `ReversibleRun`; the int64
    outputs end up in ``streams.outputs``).
    `param_inputs`: tensors that stand for the parameters that require grad as the node's
    inputs (detached aliases: their grads then reach them instead of the parameters, whose hooks do
    not fire). Without anything to differentiate, the blocks' plain forward (the compiled engine
    runs its compiled forward instead: `run_compiled`)."""
    streams = seq.fixed_point_streams(x1.dtype)
    units = block_units(seq)
    if units is not None:  # blocks sharded by FSDP2 one by one: one autograd node per block
        return run_sharded(seq, x1, x2, units, reverse_blocks, forward_step, context, streams)
    all_params = unique_params(seq.blocks)
    params = [p for p in all_params if p.requires_grad]
    grad_context = grad_tensors(context)
    if not records_graph(x1, x2, params, grad_context):
        # Nothing to differentiate: a plain forward that keeps nothing. (`forward`, not the module
        # call: a hook on a block itself never fires in a memory-saving run, with grad or without)
        if streams is not None:
            y1, y2, _, _ = exact_forward(seq, x1, x2, context, streams, monitored=False)
            streams.outputs = y1, y2
            return streams.view(y1), streams.view(y2)
        for block in seq.blocks:
            x1, x2 = block.forward(x1, x2, **context)
        return x1, x2
    inputs = params if param_inputs is None else param_inputs
    return ReversibleRun.apply(seq, params, all_params, (forward, walker, streams), context or None, x1, x2, *inputs,
                               *grad_context)


def run_sequential(seq, x1, x2, context=NO_CONTEXT):
    return run_reversible(seq, x1, x2, reverse_blocks, context)
