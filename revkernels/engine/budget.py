"""Memory budget: each block of a run rebuilds, keeps selectively or keeps everything, the fastest
mix that fits.

A memory-saving run saves only its outputs and pays one extra forward per block in the backward
(the rebuild). Given room for part of the activations, ``ReversibleSequential(...,
memory_budget=b)`` gives each block one of these options:

- ``rebuild``: no activations; the backward runs the block's forward again (one forward);
- ``selective``: torch's selective activation checkpointing inside the block
  (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)`` with
  `save_matmuls`): the block keeps its inputs and the outputs of its matrix products and attention,
  and the backward recomputes only the cheap ops between them (norms, activations, adds, views);
- ``keep``: everything plain autograd saves; nothing is recomputed;
- ``checkpoint``, under torch.compile only: the block's inputs; the compiled graph's partitioner
  recomputes only the ops whose outputs the backward reads (eagerly a checkpoint reruns the whole
  forward: a rebuild's time, more memory).

The rebuilt blocks are a prefix of the run, run as one memory-saving node of the engine (it saves
its outputs); the others run after it under autograd, each plain (keep) or inside the checkpoint
(selective)::

    blocks[:k]   one memory-saving node (the engine's): saves its outputs (y1, y2)_k
    blocks[k:]   autograd, block by block plain or selectively checkpointed: their bytes <= budget

The backward reaches the suffix first and frees its activations as it goes, then hands
``(dy1, dy2)_k`` to the node, which rebuilds blocks[:k] from its outputs. The gradients are those
of every engine: the same function, differentiated by autograd in both parts (the checkpoint
replays the forward's random numbers; the recompute leaves BatchNorm's running statistics and the
block's other buffers as the forward left them: `selective_contexts`).

**Measured, once per input signature** (shapes, dtypes, device, autocast, training flags, context
shapes; `activation_bytes`): one forward of the run under autograd, one block's graph alive at a
time, counting per block the bytes autograd saves (``keep``), the bytes of its inputs and of the
outputs of its matrix products and attention (``selective``), and the least time of its ops over
`TIMING_PASSES` forwards: all of them (a rebuild), those selective keeping recomputes, those a
recompute from its inputs needs (``checkpoint``, `needed_ms`). The generators are forked and
the buffers put back: the caller's random stream and BatchNorm statistics see nothing of it.

**Planned** (`plan`): every block starts at ``rebuild``; a greedy pass then takes, while one fits,
the change that saves the most time per byte: the last rebuilt block or a block after it to an
option that recomputes less. Ties go to the later block (the backward reaches it first). A plan for
torch.compile (``MemoryPlan.under_compile``, what a trace follows) also offers ``checkpoint`` and
counts no selective dispatch. A
selective block's cost also counts the selective checkpoint's own per-op dispatch, forward and
recompute (`sac_op_overhead_ms`, timed once per process): where it exceeds the time selective
keeping saves, a block is not kept selectively. The bytes counted are each option's measured ones,
plus the node's outputs where the first block after it keeps everything (a selective block keeps
its inputs, the node's outputs, already). A budget below every upgrade keeps nothing: the run
still runs, at O(1) memory in depth.

The budget is a fraction in [0, 1] of what plain autograd would save through the whole run, a
number of bytes (int), or ``"auto"`` on CUDA: the device's free memory now, less the grads not yet
allocated, twice the parameters (optimizer state an optimizer may still create) and a 10% margin.
"""
import contextlib
import dataclasses
import functools
import itertools
import numbers
import time
import warnings
import weakref

import torch
from torch.nn.utils import parametrize
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from revkernels.engine.compiled import kept_forward
from revkernels.engine.fsdp import enter, lockstep_groups, module_units, rank_zeros, storage_ptrs
from revkernels.engine.structure import (LRU, assume_constant_result, buffers_as_before, buffers_kept, cached, record_buffers,
                                         recompute_context, running_stats_layers, spectral_norms, unique_params)

MAX_PLANS = 8  # input signatures whose plan a run keeps
TIMING_PASSES = 3  # forwards of each block measured: each op's least time counts
OPTIONS = ("rebuild", "checkpoint", "selective", "keep")


def _ops(*names):
    # (the overloads this torch has: attention kernels differ between versions and builds)
    ops = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            ops.add(op)
    return frozenset(ops)


# Selective keeping saves the outputs of these ops (matrix products, convolutions, attention) and
# recomputes every other op of the block.
SAVED_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")


def save_matmuls(ctx, op, *args, **kwargs):
    """The selective-checkpoint policy of the ``selective`` option: keep the outputs of `SAVED_OPS`,
    recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def check_budget(budget):
    """`budget` if it is a valid ``memory_budget``; ValueError/TypeError naming it otherwise."""
    if isinstance(budget, str):
        if budget != "auto":
            raise ValueError(f"revkernels: memory_budget must be a fraction in [0, 1], a number of bytes or 'auto', "
                             f"got {budget!r}")
        return budget
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(f"revkernels: memory_budget must be a float in [0, 1], an int (bytes) or 'auto', "
                        f"got {type(budget).__name__}")
    if isinstance(budget, numbers.Integral):
        if budget < 0:
            raise ValueError(f"revkernels: memory_budget in bytes must be >= 0, got {budget}")
        return int(budget)
    if not 0.0 <= budget <= 1.0:  # NaN fails too
        raise ValueError(f"revkernels: memory_budget as a fraction must be in [0, 1], got {budget!r}")
    return float(budget)


@dataclasses.dataclass(frozen=True)
class BlockCost:
    """What one block costs under each option, measured for one input (`activation_bytes`).

    ``keep_bytes``: what plain autograd saves for it; ``selective_bytes``: what selective keeping
    keeps (its inputs and the outputs of `SAVED_OPS`), None where the block does not take it (a
    parametrized block: spectral norm's power iteration must not run again); ``input_bytes``: its
    inputs (what ``checkpoint`` keeps); ``forward_ms``: its ops' time (a rebuild); ``recompute_ms``:
    the time of the ops selective keeping recomputes; ``ops``: the ops it dispatches;
    ``checkpoint_ms``: the time of the ops a recompute from its inputs needs to give the backward
    what autograd saves (`needed_ms`; None where selective is not offered either)."""

    keep_bytes: int
    selective_bytes: object
    input_bytes: int
    forward_ms: float
    recompute_ms: float
    ops: int
    checkpoint_ms: object = None

    def bytes_of(self, option):
        return {"rebuild": 0, "checkpoint": self.input_bytes, "selective": self.selective_bytes,
                "keep": self.keep_bytes}[option]

    def cost_ms(self, option, overhead_ms):
        """The backward's extra time of the block under `option`."""
        return {"rebuild": self.forward_ms, "checkpoint": self.checkpoint_ms, "selective": self.selective_ms(overhead_ms),
                "keep": 0.0}[option]

    def offers(self, option, traced):
        """Whether the block can take `option` (checkpoint only in a plan for torch.compile)."""
        return {"checkpoint": traced and self.checkpoint_ms is not None,
                "selective": self.selective_bytes is not None}.get(option, True)

    def selective_ms(self, overhead_ms):
        """The backward's extra time of the block kept selectively: its recomputed ops and the
        checkpoint's dispatch of each op, in the forward and in the recompute."""
        return self.recompute_ms + 2 * self.ops * overhead_ms


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """How each block of a run spends a memory budget (`revkernels.engine.budget`); ``print`` it.

    ``options[i]``: ``"rebuild"``, ``"selective"`` or ``"keep"`` for block i (and ``"checkpoint"``
    in a plan for torch.compile); ``costs[i]``: its measured `BlockCost`; ``budget_bytes``: the
    budget in bytes; ``kept_bytes``: the activation bytes the run is expected to keep under the plan
    (at most the budget: the options' measured bytes, and the node's outputs where they count);
    ``overhead_ms``: the selective checkpoint's dispatch per op (`sac_op_overhead_ms`);
    ``under_compile``: the plan a torch.compile trace of the run follows (same budget and costs,
    ``checkpoint`` offered, no dispatch overhead), None where a trace has none (exact mode,
    ``"auto"``)."""

    options: tuple
    costs: tuple
    budget_bytes: int
    kept_bytes: int
    overhead_ms: float = 0.0
    under_compile: object = None

    @property
    def kept(self):
        """Per block: whether it keeps activations (its inputs, selectively or all) and skips its rebuild."""
        return tuple(o != "rebuild" for o in self.options)

    @property
    def first_kept(self):
        """The index of the first block not rebuilt (``len(options)`` when every block is)."""
        return self.kept.index(True) if True in self.kept else len(self.options)

    @property
    def autograd_bytes(self):
        """What plain autograd saves through the whole run for this input."""
        return sum(c.keep_bytes for c in self.costs)

    @property
    def rebuilds_saved(self):
        """Block rebuilds (extra forwards) a backward skips."""
        return sum(self.kept)

    @property
    def recompute_ms(self):
        """The backward's estimated extra time: the rebuilt blocks' forwards, the checkpointed and
        selective blocks' recompute."""
        return sum(c.cost_ms(o, self.overhead_ms) for o, c in zip(self.options, self.costs))

    def _summary(self):
        count = ", ".join(f"{self.options.count(o)} {o}" for o in reversed(OPTIONS) if o != "checkpoint" or o in self.options)
        return (f"{count}: skips {self.rebuilds_saved} of {len(self.options)} rebuilds; the backward recomputes "
                f"~{self.recompute_ms:.2f} ms (~{sum(c.forward_ms for c in self.costs):.2f} ms rebuilding every block)")

    def __str__(self):
        mib = 2.0 ** 20
        lines = [f"memory plan: budget {self.budget_bytes / mib:.2f} MiB of the {self.autograd_bytes / mib:.2f} MiB "
                 f"plain autograd saves; keeps {self.kept_bytes / mib:.2f} MiB", f"  {self._summary()}"]
        for i, (o, c) in enumerate(zip(self.options, self.costs)):
            selective = "n/a" if c.selective_bytes is None else f"{c.selective_bytes / mib:.2f}"
            checkpoint = "" if c.checkpoint_ms is None else f", checkpoint ~{c.checkpoint_ms:.2f} ms"
            lines.append(f"  blocks[{i}]: {o:9s} {c.bytes_of(o) / mib:8.2f} MiB   (keep {c.keep_bytes / mib:.2f}, "
                         f"selective {selective} MiB; rebuild ~{c.forward_ms:.2f} ms, selective ~"
                         f"{c.selective_ms(self.overhead_ms):.2f} ms{checkpoint})")
        if self.under_compile is not None:
            traced = self.under_compile
            lines.append(f"  under torch.compile: {' '.join(o[0].upper() for o in traced.options)} (Rebuild, "
                         f"Checkpoint: keeps its inputs, Selective, Keep); keeps {traced.kept_bytes / mib:.2f} MiB; "
                         f"{traced._summary()}")
        return "\n".join(lines)


def _head_outputs(options, costs, k):
    # the node's outputs (block k's inputs), where block k keeps everything: counted beside it
    return costs[k].input_bytes if 0 < k < len(options) and options[k] == "keep" else 0


def _added(options, costs, k, i, option):
    # the bytes block i's move to `option` adds, blocks[k:] not rebuilt: its option's, and the
    # node's outputs (`_head_outputs`) as they change
    first = min(k, i)
    head = costs[first].input_bytes if first and (option if i == first else options[first]) == "keep" else 0
    return costs[i].bytes_of(option) - costs[i].bytes_of(options[i]) + head - _head_outputs(options, costs, k)


def plan(budget_bytes, costs, overhead_ms=0.0, traced=False):
    """The `MemoryPlan` for `costs` (one `BlockCost` per block) within `budget_bytes`: from every
    block rebuilt, a greedy pass takes the change that fits and saves the most time per byte
    (ties: the later block; see the module docstring). `traced`: a plan for a torch.compile trace,
    where the ``checkpoint`` option is offered."""
    n = len(costs)
    options, used, k = ["rebuild"] * n, 0, n  # blocks[k:] are not rebuilt
    while True:
        upgrades = []  # (time saved, block, option): the last rebuilt block (the rebuilt blocks stay
        # a prefix) or a block after it, to any option it offers that recomputes less
        for i in range(max(k - 1, 0), n):
            now = costs[i].cost_ms(options[i], overhead_ms)
            upgrades += [(now - costs[i].cost_ms(o, overhead_ms), i, o) for o in OPTIONS[1:]
                         if o != options[i] and costs[i].offers(o, traced)]
        best = None  # (time saved per byte, block, option, bytes added)
        for saved, i, option in upgrades:
            added = _added(options, costs, k, i, option)
            if saved > 0 and used + added <= budget_bytes:
                rate = saved / added if added > 0 else float("inf")
                if best is None or (rate, i) > best[:2]:
                    best = (rate, i, option, added)
        if best is None:
            return MemoryPlan(tuple(options), tuple(costs), int(budget_bytes), int(used), overhead_ms)
        _, i, option, added = best
        options[i], used, k = option, used + added, min(k, i)


class _Probe(TorchDispatchMode):
    """Times each op a block dispatches (the least time of the passes since `reset`) and, in the
    first pass, notes what each op reads and writes (for `needed_ms`) and counts the storages of the
    outputs of `SAVED_OPS`."""

    def __init__(self, device, skip):
        super().__init__()
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.skip = skip
        self.reset()

    def reset(self):
        self.saved, self.calls, self.at = {}, [], None  # calls: [op, ms, read, written]

    def again(self):
        """The next forward repeats the first pass's ops: their times update the least ones."""
        self.at = 0

    @property
    def forward_ms(self):
        return sum(ms for _, ms, _, _ in self.calls)

    @property
    def recompute_ms(self):
        return sum(ms for op, ms, _, _ in self.calls if op not in SAVED_OPS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sync()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.sync()
        ms = (time.perf_counter() - start) * 1e3
        if self.at is None:
            self.calls.append([func, ms, _storages((args, kwargs), self.skip), _storages(out, self.skip)])
            if func in SAVED_OPS:
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        _add_storage(self.saved, t, self.skip)
        elif self.at < len(self.calls) and self.calls[self.at][0] is func:  # (a pass that strays is not timed on)
            self.calls[self.at][1] = min(self.calls[self.at][1], ms)
            self.at += 1
        return out


def _add_storage(into, t, skip):
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    if ptr not in skip and storage.device.type != "meta":
        into[ptr] = storage.nbytes()


def _storages(tree, skip):
    found = {}
    for t in tree_leaves(tree):
        if isinstance(t, torch.Tensor):
            _add_storage(found, t, skip)
    return frozenset(found)


def needed_ms(calls, saved, inputs):
    """The time of the ops a recompute from a block's `inputs` needs to give its backward the
    storages autograd `saved` (what torch.compile's partitioner recomputes for a checkpointed block):
    walking `calls` (op, time, storages read, storages written) back from the last, an op is needed if
    it writes a storage still needed; then what it read is needed instead (a storage written is
    needed no further back: an earlier op writing the same address wrote a freed one)."""
    inputs = frozenset(inputs)
    need, ms = set(saved) - inputs, 0.0
    for _, op_ms, read, written in reversed(calls):
        if not need.isdisjoint(written):
            ms += op_ms
            need = (need - written) | (read - inputs)
    return ms


def _selective_offered(block):
    # a parametrized weight (spectral norm's power iteration, the parametrize cache) must not be
    # computed again by a recompute of the forward
    return not spectral_norms(block) and not any(parametrize.is_parametrized(m) for m in block.modules())


def activation_bytes(blocks, x1, x2, context):
    """One `BlockCost` per block of `blocks` run on (x1, x2) with `context`: one forward under
    autograd with a saved-tensor hook counting each storage a block saves once (the parameters and
    buffers aside; its input counts where it saves it) and a dispatch mode timing its ops and
    counting the outputs of `SAVED_OPS`; one block's graph is alive at a time (block 0 runs once
    before, untimed: lazy initialisation). The generators are forked, BatchNorm uses batch
    statistics without updating its running ones and each block's other buffers are put back, so
    the caller sees no effect but the time."""
    held = storage_ptrs((*blocks.parameters(), *blocks.buffers()))
    skip = set(held)  # (`held` and, while a block runs, its FSDP-unsharded parameters' storages)
    devices = sorted({t.device.index for t in (x1, x2) if t.is_cuda})
    probe = _Probe(x1.device, skip)
    costs, kept, alive = [], {}, []

    def pack(t):
        if probe.at is None:  # (the first pass)
            _add_storage(kept, t, skip)
        # The graph keeps nothing (no backward runs on it) and `alive` the tensor, until the
        # block's next pass: returning `t` made an op saving its own output (tanh, relu) hold its
        # Python object, whose grad_fn is that op's node, a cycle through C++ that gc cannot
        # collect (each measurement's graph leaked); a detach would be an op the probe times
        alive.append(t)

    a1, a2 = (t.detach().requires_grad_(t.is_floating_point()) for t in (x1, x2))
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        for i, block in enumerate([blocks[0], *blocks]):  # (block 0 twice: the first is a warm-up)
            kept.clear()
            probe.reset()
            inputs = {}
            for t in (a1, a2):
                _add_storage(inputs, t, skip)

            def probed(a1, a2, block=block):
                # (this block's storages only: those of a block resharded since may hold activations now)
                skip.clear()
                skip.update(held, storage_ptrs((*block.parameters(), *block.buffers())))
                with recompute_context(block), buffers_kept(block), probe, \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    return block.forward(a1, a2, **context)

            for timing in range(TIMING_PASSES):
                if timing:
                    probe.again()
                    del b1, b2
                    alive.clear()
                b1, b2 = enter(module_units(block), probed, a1, a2)  # (an FSDP block: all-gathered for it)
            if i:
                offered = _selective_offered(block)
                costs.append(BlockCost(
                    sum(kept.values()), sum({**inputs, **probe.saved}.values()) if offered else None,
                    sum(inputs.values()), probe.forward_ms, probe.recompute_ms, len(probe.calls),
                    needed_ms(probe.calls, kept, inputs.keys()) if offered else None))
                a1, a2 = b1.detach().requires_grad_(), b2.detach().requires_grad_()
            del b1, b2
            alive.clear()
    return costs


@functools.cache
def sac_op_overhead_ms(calls=200):
    """The time torch's selective-checkpoint dispatch adds to one op (ms; timed once per process on
    a 0-d tensor): a selective block pays it for each op, in the forward and in the recompute."""
    x = torch.zeros(())

    def per_call():
        start = time.perf_counter()
        for _ in range(calls):
            torch.neg(x)
        return (time.perf_counter() - start) / calls

    plain = min(per_call() for _ in range(3))
    with create_selective_checkpoint_contexts(save_matmuls)[0]:
        sac = min(per_call() for _ in range(3))
    return max(0.0, sac - plain) * 1e3


def auto_budget_bytes(params, device):
    """``memory_budget="auto"``: the CUDA `device`'s free memory less the grads `params` do not hold
    yet, twice the parameters' bytes (optimizer state an optimizer may still create) and 10% of the
    device's memory."""
    if device.type != "cuda":
        raise ValueError(f"revkernels: memory_budget='auto' reads the free memory of a CUDA device; the run's inputs "
                         f"are on {device} (give a fraction or a number of bytes)")
    free, total = torch.cuda.mem_get_info(device)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad and p.grad is None)
    state = 2 * sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return max(0, free - grads - state - total // 10)


def signature(x1, x2, context, modules):
    """What a plan depends on besides the budget: the inputs' shapes, dtypes and device, autocast,
    the training flags of `modules` and the context tensors' shapes."""
    autocast = (torch.is_autocast_enabled(x1.device.type), torch.get_autocast_dtype(x1.device.type)) \
        if x1.device.type in ("cpu", "cuda") else None
    ctx = tuple((k, tuple(context[k].shape), context[k].dtype) if isinstance(context[k], torch.Tensor)
                else (k, repr(context[k])) for k in sorted(context)) if context else ()  # (names: a trace sorts those)
    return (x1.shape, x2.shape, x1.dtype, x2.dtype, x1.device, autocast,
            tuple(m.training for m in modules), ctx)


class Plans:
    """A run's measurements and plans, for its most recent `MAX_PLANS` signatures."""

    def __init__(self):
        self.by_key = LRU(MAX_PLANS)  # signature -> (block costs, {budget: plan}, FSDP's lockstep groups)

    def get(self, budget, blocks, x1, x2, context, exact=False):
        key = signature(x1, x2, context, cached(blocks, "modules", lambda m: list(m.modules())))
        entry = self.by_key.get(key)
        if entry is None:
            # (FSDP's ranks plan from the first rank's measurement: timings differ from rank to rank;
            # the groups read before it, while the parameters are sharded)
            groups = lockstep_groups(blocks)
            entry = self.by_key[key] = (rank_zeros(activation_bytes(blocks, x1, x2, context), groups), {}, groups)
        costs, plans, groups = entry
        made = plans.get((budget, exact)) if budget != "auto" else None
        if made is not None:  # (a step's usual path: the cached plan)
            return made
        if exact:  # (exact mode keeps blocks whole: a checkpoint would also keep its int64 inputs)
            costs = [dataclasses.replace(c, selective_bytes=None) for c in costs]
        # (FSDP's ranks run the first rank's plan: its other inputs, the free memory and the
        # checkpoint's dispatch time, are each rank's own too)
        if budget == "auto":  # (the free memory changes: planned at every call)
            return rank_zeros(plan(auto_budget_bytes(unique_params(blocks), x1.device), costs, sac_op_overhead_ms()),
                              groups)
        budget_bytes = int(budget * sum(c.keep_bytes for c in costs)) if isinstance(budget, float) else budget
        made = plan(budget_bytes, costs, sac_op_overhead_ms())
        if not exact:  # (a trace's plan: compiled code has no selective-checkpoint dispatch per op)
            made = dataclasses.replace(made, under_compile=plan(budget_bytes, costs, traced=True))
        made = plans[budget, exact] = rank_zeros(made, groups)
        return made


def plan_of(seq, x1, x2, context):
    """The `MemoryPlan` of a call of `seq` (a ReversibleSequential) with these inputs, measured once
    per input signature (`Plans`); the run of the blocks it rebuilds made with it (what a trace under
    torch.compile calls: `traced_within_budget`)."""
    made = _budget_state(seq)[0].get(seq.memory_budget, seq.blocks, x1, x2, context, seq.exact)
    for k in {made.first_kept, getattr(made.under_compile, "first_kept", 0)} - {0, len(seq.blocks)}:
        _head_run(seq, k)
    return made


def _budget_state(seq):
    # [Plans, {k: head run}], kept in the instance dict: out of the module tree and its state; and
    # the run's number for traces (`_planned_options`)
    state = seq.__dict__.get("_budget")
    if state is None:
        state = seq.__dict__["_budget"] = [Plans(), {}]
        seq.__dict__["_planned_run"] = number = next(_RUN_NUMBERS)
        _PLANNED[number] = seq
    return state


def _head_run(seq, k):
    """A run of blocks[:k] (the same modules) with `seq`'s settings: the memory-saving node of a run
    with a budget."""
    heads = _budget_state(seq)[1]
    head = heads.get(k)
    if head is None or any(a is not b for a, b in zip(head.blocks, seq.blocks)):  # (a block replaced since)
        head = heads[k] = seq._run_of(seq.blocks[:k])
    head.engine, head.preserve_rng_state = seq.engine, seq.preserve_rng_state
    head.compile_options, head.exact_bits = seq.compile_options, seq.exact_bits
    if head.exact != seq.exact:
        head.exact = seq.exact
    if "reconstruction_monitor" in seq.__dict__:
        head.reconstruction_monitor = seq.reconstruction_monitor
    return head


@contextlib.contextmanager
def _selective_forward(sac, block, changed):
    record = record_buffers(block)
    with sac:
        yield
    if record is not None:
        changed.extend(record.changed(lambda: type(block).__name__))


def _statistics(block):
    # (layer buffer, a copy of its value) for the running statistics a forward of `block` updates
    return [(t, t.clone()) for layer in running_stats_layers(block) if layer.training and layer.track_running_stats
            for t in (layer.running_mean, layer.running_var, layer.num_batches_tracked) if t is not None]


@contextlib.contextmanager
def _selective_recompute(sac, block, changed):
    # The recompute runs BatchNorm as the forward did (recompute_context's untracked statistics
    # would save other tensors than the forward saved, which the checkpoint refuses) and puts the
    # running statistics back after
    statistics = _statistics(block)
    try:
        with buffers_as_before(tuple(changed)), sac:
            yield
    finally:  # (the recompute updated the running statistics again: their values after the forward)
        with torch.no_grad():
            for t, value in statistics:
                t.copy_(value)


def selective_contexts(block):
    """The ``context_fn`` of a selective block's checkpoint: torch's selective-checkpoint contexts
    with `save_matmuls`; the recompute sees the buffers the forward changed (other than running
    statistics) as the forward saw them, and leaves every buffer as the forward left it."""
    forward, recompute = create_selective_checkpoint_contexts(save_matmuls)
    changed = []
    return _selective_forward(forward, block, changed), _selective_recompute(recompute, block, changed)


def _call(block, x1, x2, context):
    return block(x1, x2, **context)


def run_selective(block, x1, x2, context, preserve_rng_state=True):
    """(y1, y2) of `block` kept selectively: under a non-reentrant checkpoint with
    `selective_contexts` (the random numbers replayed in the recompute where `preserve_rng_state`)."""
    return checkpoint(_call, block, x1, x2, context, use_reentrant=False, preserve_rng_state=preserve_rng_state,
                      context_fn=functools.partial(selective_contexts, block))


def traced_plan(seq, x1, x2, context):
    """The options of the plan a trace of `seq` under torch.compile runs: the one an eager call or
    ``seq.memory_plan`` made for these inputs before (a trace cannot measure); None without one, in
    exact mode and for ``"auto"`` (planned at every call): the run is then one opaque op that
    rebuilds every block, and its kernel warns (`warn_unplanned`)."""
    run = getattr(seq, "_planned_run", None)  # (an int: the trace guards on it, one graph per run)
    if seq.exact or seq.memory_budget == "auto" or run is None:
        return None
    key = signature(x1, x2, context, list(seq.blocks.modules()))  # (its sizes symbolic where Dynamo made them dynamic)
    for planned in _planned_keys(run):  # (comparing the sizes specializes the graph on those of a plan)
        if _same(key, planned):
            return _planned_options(run, planned, seq.memory_budget)
    return None


def _same(key, planned):
    if isinstance(planned, tuple):
        if not isinstance(key, tuple) or len(key) != len(planned):
            return False
        for a, b in zip(key, planned):
            if not _same(a, b):
                return False
        return True
    return key == planned


@assume_constant_result
def _planned_keys(run):
    # (the signatures the run has plans for, a constant of the trace: see `_planned_options`)
    seq = _PLANNED.get(run)
    return () if seq is None else tuple(_budget_state(seq)[0].by_key)


@assume_constant_result
def _planned_options(run, key, budget):
    # (run at trace time, its result a constant of the graph: a lookup traced in the graph would
    # guard on the plan cache, and a plan made later for other inputs would retrace every graph)
    seq = _PLANNED.get(run)
    entry = None if seq is None else dict.get(_budget_state(seq)[0].by_key, key)  # (a read: no LRU move)
    made = None if entry is None else entry[1].get((budget, False))
    if made is None:
        return None
    k = made.under_compile.first_kept
    if 0 < k < len(made.options):  # (the head run takes the run's settings now, not the plan's time's)
        _head_run(seq, k)
    return made.under_compile.options


_PLANNED = weakref.WeakValueDictionary()  # run number -> the run (`_budget_state`)
_RUN_NUMBERS = itertools.count()


def warn_unplanned(seq, x1, x2, context):
    """Warns once per run whose budget a torch.compile trace could not follow (see `traced_plan`)."""
    if seq.memory_budget and not seq.__dict__.get("_warned_unplanned") and traced_plan(seq, x1, x2, context) is None:
        seq.__dict__["_warned_unplanned"] = True
        why = ("in exact mode" if seq.exact else "with memory_budget='auto' (planned at every call)"
               if seq.memory_budget == "auto" else "without a plan made for these inputs before the trace "
               "(call seq.memory_plan(x1, x2, **context) or run one eager step, then compile)")
        warnings.warn(f"revkernels: under torch.compile this run rebuilds every block whatever its memory_budget "
                      f"{why}", UserWarning, stacklevel=2)


def traced_within_budget(seq, x1, x2, context):
    """Under torch.compile: (y1, y2) of `seq` with its `traced_plan`: the rebuilt blocks one opaque
    op (their head run's), the kept blocks traced into the compiled graph (its partitioner decides
    what they save; selective ones checkpointed with the same policy); None where there is no such
    plan or it rebuilds every block."""
    options = traced_plan(seq, x1, x2, context)
    if options is None or options[-1] == "rebuild":  # (the rebuilt blocks are a prefix: here every block)
        return None
    k = options.count("rebuild")
    if k:
        x1, x2 = _budget_state(seq)[1][k](x1, x2, **context)
    for block, option in zip(list(seq.blocks)[k:], options[k:]):  # (a list: see run_within_budget)
        if option == "selective":  # (the compiled graph's functionalized recompute changes no buffer)
            x1, x2 = checkpoint(_call, block, x1, x2, context, use_reentrant=False,
                                preserve_rng_state=seq.preserve_rng_state,
                                context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls))
        elif option == "checkpoint":  # (the partitioner recomputes only what the backward reads)
            x1, x2 = checkpoint(_call, block, x1, x2, context, use_reentrant=False,
                                preserve_rng_state=seq.preserve_rng_state)
        else:
            x1, x2 = block(x1, x2, **context)
    return x1, x2


def run_within_budget(seq, x1, x2, context):
    """(y1, y2) of `seq` with the blocks its plan does not rebuild run under autograd (plainly or
    selectively checkpointed) after the memory-saving node of the rebuilt ones; None when the plan
    rebuilds every block."""
    made = plan_of(seq, x1, x2, context)
    k = made.first_kept
    if k == len(seq.blocks):
        return None
    streams = seq.fixed_point_streams(x1.dtype)
    if k:
        head = _head_run(seq, k)
        if streams is not None:  # exact mode: the kept blocks go on from the head's int64 outputs
            head.hand_streams(streams)
        x1, x2 = head.forward(x1, x2, **context)
        seq.engine_in_use = head.engine_in_use
    if streams is not None:  # (the plan keeps whole blocks in exact mode)
        fixed, streams.outputs = streams.outputs, None  # (the head's node keeps `streams`: drop its reference)
        return streams.run_autograd(list(seq.blocks)[k:], x1, x2, context, fixed if k else None, first=k)
    # (a list: a slice of the ModuleList would make a new one, a structure change dropping every
    # structure cache, each call)
    for i, (block, option) in enumerate(zip(list(seq.blocks)[k:], made.options[k:]), start=k):
        if option == "selective":
            x1, x2 = run_selective(block, x1, x2, context, seq.preserve_rng_state)
        elif seq.engine == "compiled":  # (the block's compiled forward step, differentiated by autograd)
            x1, x2 = kept_forward(seq, i, x1, x2, context)
        else:
            x1, x2 = block(x1, x2, **context)
    return x1, x2
