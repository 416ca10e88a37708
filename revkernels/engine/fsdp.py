"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with blocks sharded one by one.

FSDP2 hangs its all-gathers, reshards and reduce-scatters on a unit's forward call, and the
memory-saving engines call a block's steps, not the block: each block runs as one autograd node
(`BlockStep`) entered through the forward of each of its units (FSDP's
``register_fsdp_forward_method``). The node's inputs are the block's unsharded parameters, so its
grads accumulate where FSDP reduce-scatters them from. What this gives and costs (schedule,
memory, engines): docs/distributed.md.
"""
import functools
import sys

import torch

from revkernels.engine.state import (NO_CONTEXT, AutocastState, differentiated_once, grad_tensors, in_mode, module_modes,
                                     records_graph)
from revkernels.engine.structure import cached, invalidate, param_slots, unique_grad_params

_MANAGED = "_is_fsdp_managed_module"  # fully_shard's mark on every module whose parameters it manages
_ENTRY = "_revkernels_fsdp_forward"  # the method FSDP runs its forward logic around (`enter`)


def _call(fn, *args):
    return fn(*args)


def _units(module):
    """The FSDP units among `module`'s modules, outermost first, each given the `_ENTRY` method."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:  # FSDP never imported: nothing can be sharded (and importing it costs)
        return ()
    units = tuple(m for m in module.modules() if isinstance(m, fsdp.FSDPModule))
    for unit in units:
        if _ENTRY not in unit.__dict__:
            unit.__dict__[_ENTRY] = _call
            fsdp.register_fsdp_forward_method(unit, _ENTRY)
    return units


def _checked(module, key, build):
    """``cached(module, key, build)`` for ``build(module) -> (probe, FSDP's mark on it, value)``
    (probe None: `module` itself; a cached value must not hold its own key, or neither is ever
    freed). fully_shard registers nothing the structure cache sees: a module sharded after its
    structure was cached shows as the mark appearing on the probe, and the cache is dropped."""
    probe, managed, value = cached(module, key, build)
    if (module if probe is None else probe).__dict__.get(_MANAGED, False) != managed:
        invalidate()
        probe, managed, value = cached(module, key, build)
    return value


def _block_units_entry(seq):
    probe = seq.blocks[0]
    units = [_units(block) for block in seq.blocks]
    return probe, probe.__dict__.get(_MANAGED, False), units if any(units) else None


def _module_units_entry(module):
    units = _units(module)
    own = bool(units) and units[0] is module  # kept as a flag (see `_checked`)
    return None, module.__dict__.get(_MANAGED, False), (own, units[1:] if own else units)


def block_units(seq):
    """Per block of `seq`, its FSDP units (outermost first); None when no block holds one. The
    engines' one check per step (cached per structure)."""
    return _checked(seq, "fsdp_block_units", _block_units_entry)


def module_units(module):
    """The FSDP units among `module`'s modules, outermost first (cached per structure)."""
    own, units = _checked(module, "fsdp_units", _module_units_entry)
    return (module, *units) if own else units


def enter(units, fn, *args):
    """``fn(*args)`` run as the forward of every unit in `units`, the first outermost: FSDP's
    pre-forward (all-gather; the reduce-scatter hook on the grad-requiring tensors of `args`, which
    it may cast or wrap: `fn` gets them) before, its post-forward (reshard; the backward's
    all-gather hook on the outputs) after."""
    if not units:
        return fn(*args)
    return getattr(units[0], _ENTRY)(lambda *inner: enter(units[1:], fn, *inner), *args)


def lockstep_groups(module):
    """The process groups that reach, from the first of them, the ranks running `module`'s FSDP
    units in step: one per dimension of the units' device mesh (read from a sharded parameter; the
    default group where none is sharded now); () without units."""
    if not module_units(module):
        return ()
    dtensor = torch.distributed.tensor.DTensor
    mesh = next((p.device_mesh for p in module.parameters() if isinstance(p, dtensor)), None)
    if mesh is None:
        return (None,)
    return tuple(mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1)


def rank_zeros(value, groups):
    """`value` as the first rank of `lockstep_groups` has it (broadcast from group rank 0 along
    each in turn): what each rank measures for itself (a memory plan's timings) must not split the
    choices of ranks that run in step, nor their collectives with them; `value` where `groups` is
    empty."""
    box = [value]
    for group in groups:
        torch.distributed.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def storage_ptrs(tensors):
    """The data pointers of the storages of `tensors`, sharded FSDP parameters (DTensors: no storage
    here; their block's unsharded ones appear while it runs) aside."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    return {t.untyped_storage().data_ptr() for t in tensors if not isinstance(t, dtensor)}


class ShardedRun:
    """What the `BlockStep` nodes of one run share."""

    __slots__ = ("blocks", "forward_step", "walker", "preserve_rng_state", "autocast_state", "monitor", "samples",
                 "errors", "handed", "streams", "steps", "fixed")

    def __init__(self, seq, forward_step, walker, device_type, streams=None):
        self.blocks = list(seq.blocks)
        # Exact mode: the blocks' exact steps, and the int64 streams the forward hands from node to
        # node (the nodes' differentiable outputs are their float views)
        self.streams, self.steps = streams, None if streams is None else streams.steps(self.blocks)
        self.fixed = None
        self.forward_step, self.walker = forward_step, walker
        self.preserve_rng_state = seq.preserve_rng_state
        self.autocast_state = AutocastState.capture(device_type)
        monitor = getattr(seq, "reconstruction_monitor", None)
        self.monitor = monitor if monitor is not None and monitor.begin_forward() else None
        self.samples = [None] * len(self.blocks)
        self.errors = [None] * len(self.blocks)
        self.handed = None

    def hand_over(self, index, x1, x2):
        """Block `index`'s output (rebuilt by the backward of block index + 1)."""
        self.handed = (index, x1, x2)

    def take(self, index):
        if self.handed is None or self.handed[0] != index:
            raise RuntimeError(f"revkernels: the backward of blocks[{index}] ran before its output was rebuilt "
                               "(each block's node must be differentiated after the next block's, once)")
        _, x1, x2 = self.handed
        self.handed = None
        return x1, x2


class BlockStep(torch.autograd.Function):
    """One block of a `ShardedRun` as an autograd node (see the module docstring)."""

    @staticmethod
    def forward(ctx, run, index, context, n_params, x1, x2, *tensors):
        # tensors: the block's parameters that require grad, then the context tensors that do
        from revkernels.engine.sequential import save_with_context  # (sequential imports this module)

        block = run.blocks[index]
        if run.streams is not None:  # exact mode: the int64 streams the previous node made
            x1, x2 = run.fixed
        if run.monitor is not None:
            run.samples[index] = run.monitor.sample(x1, x2)
        y1, y2, ctx.state = run.forward_step(block, x1, x2, run.preserve_rng_state, context,
                                             None if run.steps is None else run.steps[index])
        ctx.run, ctx.index, ctx.params = run, index, list(tensors[:n_params])
        ctx.modes = module_modes(block)  # (the backward rebuilds the block in them: `in_mode`)
        ctx.last = index == len(run.blocks) - 1
        save_with_context(ctx, context, *((y1, y2) if ctx.last else ()))
        ctx.set_materialize_grads(False)  # see revkernels.engine.sequential.output_grads
        if run.streams is None:
            return y1, y2
        run.fixed = (y1, y2)
        if ctx.last:
            run.streams.raise_on_overflow()
            run.streams.outputs = y1, y2
        return run.streams.view(y1), run.streams.view(y2)

    @staticmethod
    @differentiated_once
    def backward(ctx, dy1, dy2):
        from revkernels.engine.sequential import output_grads, saved_with_context, without_unused

        run, index = ctx.run, ctx.index
        outputs, context, leaves = saved_with_context(ctx, 2 if ctx.last else 0)
        y1, y2 = outputs if ctx.last else run.take(index)
        block = run.blocks[index]
        dy1, dy2, unused = output_grads([block], y1, y2, dy1, dy2)
        param_slots(block)  # the current (unsharded) parameters, for steps that read them from their cache
        with in_mode(block, ctx.modes):
            x1, x2, dx1, dx2, grads = run.walker([block if run.steps is None else run.steps[index]], [ctx.state],
                                                 y1, y2, dy1, dy2, ctx.params + leaves, run.autocast_state,
                                                 context=context)
        grads = without_unused(ctx.params, grads, unused)
        if run.monitor is not None:
            run.errors[index] = run.monitor.error(run.samples[index], x1, x2)
            if index == 0:
                run.monitor.report(run.errors)
        if index > 0:
            run.hand_over(index - 1, x1, x2)
        return (None, None, None, None, dx1, dx2, *grads)


def _plain_step(forward_step, block, steps, x1, x2, context):
    return forward_step(block, x1, x2, False, context, steps)[:2]


def _step_node(run, index, x1, x2, context):
    # Inside the block's units' forward: the block's parameters are the unsharded ones now.
    params = [p for p in param_slots(run.blocks[index]).params if p.requires_grad]
    return BlockStep.apply(run, index, context, len(params), x1, x2, *params, *grad_tensors(context))


def run_sharded(seq, x1, x2, units, walker, forward_step, context=NO_CONTEXT, streams=None):
    """Runs `seq`, whose blocks hold the FSDP `units` (from `block_units`), one `BlockStep` node
    per block. `forward_step(block, x1, x2, preserve_rng_state, context, steps) -> (y1, y2, state)`
    (`steps`: the block's exact steps in exact mode, else None) and `walker` (`reverse_blocks`'
    signature, called with one block) are the engine's steps. In exact mode (`streams`) the nodes
    step the int64 streams by the blocks' exact steps (`ShardedRun`)."""
    fixed = None
    if streams is not None:
        with torch.no_grad():
            fixed = (streams.enter(x1)[1], streams.enter(x2)[1])
    if not records_graph(x1, x2, unique_grad_params(seq.blocks), grad_tensors(context)):
        # a plain forward that keeps nothing
        steps = [None] * len(seq.blocks) if streams is None else streams.steps(seq.blocks)
        if fixed is not None:
            x1, x2 = fixed
        for block, step, unit_list in zip(seq.blocks, steps, units):
            x1, x2 = enter(unit_list, functools.partial(_plain_step, forward_step, block, step), x1, x2, context)
        if streams is None:
            return x1, x2
        streams.raise_on_overflow()
        streams.outputs = x1, x2  # (a caller may go on from them exactly, as from a node's)
        return streams.view(x1), streams.view(x2)
    run = ShardedRun(seq, forward_step, walker, x1.device.type, streams)
    run.fixed = fixed
    for index, unit_list in enumerate(units):
        x1, x2 = enter(unit_list, functools.partial(_step_node, run, index), x1, x2, context)
    return x1, x2


__all__ = ["block_units", "module_units", "enter", "run_sharded", "BlockStep", "ShardedRun"]
