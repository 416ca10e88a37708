"""Memory budget: the blocks a run can afford to keep skip their rebuild.

A memory-saving run saves only its outputs and pays one extra forward per block in the backward.
Given room for part of the activations, ``ReversibleSequential(..., memory_budget=b)`` keeps the
activations of its last blocks (they run under plain autograd, after the memory-saving node of the
others: no rebuild, no second forward for them) and rebuilds the rest::

    blocks[:k]   one memory-saving node (the engine's): saves its outputs (y1, y2)_k
    blocks[k:]   ordinary autograd: saves its activations, sum of bytes_i for i >= k <= budget

The backward reaches the kept blocks first and frees their activations as it goes, then hands
``(dy1, dy2)_k`` to the node, which rebuilds blocks[:k] from its outputs. The gradients are those of
every engine: the same function, differentiated by autograd in both parts.

The plan is made per input signature (shapes, dtypes, device, autocast, training flags, context
shapes) from each block's activation bytes, *measured* once: one forward of the run under plain
autograd, counting the bytes autograd saves per block (parameters and storage seen before aside),
with the generators forked and the buffers put back (the measurement draws no number of the
caller's stream and counts no BatchNorm batch: `recompute_context`, `buffers_kept`). Blocks are kept from the last one back while the
sum fits; a budget below the last block's bytes keeps none (the run still runs, at O(1) memory).

The budget is a fraction in [0, 1] of what plain autograd would save through the whole run, a
number of bytes (int), or ``"auto"`` on CUDA: the device's free memory now, less the grads not yet
allocated, twice the parameters (optimizer state an optimizer may still create) and a 10% margin.
"""
import dataclasses
import numbers

import torch

from revkernels.engine.structure import LRU, buffers_kept, cached, recompute_context, unique_params

MAX_PLANS = 8  # input signatures whose plan a run keeps


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
class MemoryPlan:
    """Which blocks of a run keep their activations under a memory budget (`revkernels.engine.budget`).

    ``kept[i]``: block i keeps its activations (no rebuild); ``block_bytes[i]``: what plain
    autograd saves for block i with this input (measured); ``budget_bytes``: the budget in bytes.
    ``first_kept`` is the index of the first kept block (``len(kept)`` when none is kept)."""

    kept: tuple
    block_bytes: tuple
    budget_bytes: int

    @property
    def first_kept(self):
        return self.kept.index(True) if True in self.kept else len(self.kept)

    @property
    def kept_bytes(self):
        """The activation bytes the kept blocks save (at most `budget_bytes`)."""
        return sum(b for b, k in zip(self.block_bytes, self.kept) if k)

    @property
    def autograd_bytes(self):
        """What plain autograd saves through the whole run for this input."""
        return sum(self.block_bytes)

    @property
    def rebuilds_saved(self):
        """Block rebuilds (extra forwards) a backward skips."""
        return sum(self.kept)

    def __str__(self):
        mib = 2.0 ** 20
        lines = [f"memory plan: budget {self.budget_bytes / mib:.2f} MiB of the {self.autograd_bytes / mib:.2f} MiB "
                 f"plain autograd saves; keeps {self.kept_bytes / mib:.2f} MiB, skips {self.rebuilds_saved} of "
                 f"{len(self.kept)} rebuilds"]
        lines += [f"  blocks[{i}]: {'keep   ' if k else 'rebuild'} {b / mib:8.2f} MiB"
                  for i, (k, b) in enumerate(zip(self.kept, self.block_bytes))]
        return "\n".join(lines)


def plan(blocks, budget_bytes, block_bytes):
    """The `MemoryPlan` keeping the last blocks whose bytes fit in `budget_bytes` together."""
    kept, used = [False] * len(blocks), 0
    for i in reversed(range(len(blocks))):
        if used + block_bytes[i] > budget_bytes:
            break
        used += block_bytes[i]
        kept[i] = True
    return MemoryPlan(tuple(kept), tuple(block_bytes), int(budget_bytes))


def activation_bytes(blocks, x1, x2, context):
    """What plain autograd saves for each block of `blocks` run on (x1, x2) with `context`, in
    bytes: one forward under autograd with a saved-tensor hook counting each storage a block saves
    once (the parameters and buffers aside; its input counts, as a kept block keeps it); one
    block's graph is alive at a time. The generators are forked,
    BatchNorm uses batch statistics without updating its running ones and each block's other
    buffers are put back, so the caller sees no effect but the time."""
    skip = {t.untyped_storage().data_ptr() for t in (*blocks.parameters(), *blocks.buffers())}
    devices = sorted({t.device.index for t in (x1, x2) if t.is_cuda})
    sizes, seen = [], set()

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and ptr not in seen and storage.device.type != "meta":
            seen.add(ptr)
            sizes[-1] += storage.nbytes()
        return t

    a1, a2 = (t.detach().requires_grad_(t.is_floating_point()) for t in (x1, x2))
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        for block in blocks:
            # per block: what it saves is alive until its outputs go, then its memory is reused
            sizes.append(0)
            seen = set()  # (its input counts: a kept block's input is kept for it)
            with recompute_context(block), buffers_kept(block), \
                    torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                b1, b2 = block.forward(a1, a2, **context)
            a1, a2 = b1.detach().requires_grad_(), b2.detach().requires_grad_()
            del b1, b2
    return sizes


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
    ctx = tuple((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v))
                for k, v in sorted(context.items())) if context else ()
    return (x1.shape, x2.shape, x1.dtype, x2.dtype, x1.device, autocast,
            tuple(m.training for m in modules), ctx)


class Plans:
    """A run's measurements and plans, for its most recent `MAX_PLANS` signatures."""

    def __init__(self):
        self.by_key = LRU(MAX_PLANS)  # signature -> (block bytes, {budget: plan})

    def get(self, budget, blocks, x1, x2, context, params):
        key = signature(x1, x2, context, cached(blocks, "modules", lambda m: list(m.modules())))
        entry = self.by_key.get(key)
        if entry is None:
            entry = self.by_key[key] = (activation_bytes(blocks, x1, x2, context), {})
        block_bytes, plans = entry
        if budget == "auto":  # (the free memory changes: planned at every call)
            return plan(blocks, auto_budget_bytes(params, x1.device), block_bytes)
        made = plans.get(budget)
        if made is None:
            budget_bytes = int(budget * sum(block_bytes)) if isinstance(budget, float) else budget
            made = plans[budget] = plan(blocks, budget_bytes, block_bytes)
        return made


def plan_of(seq, x1, x2, context):
    """The `MemoryPlan` of a call of `seq` (a ReversibleSequential) with these inputs, measured once
    per input signature (`Plans`)."""
    return _budget_state(seq)[0].get(seq.memory_budget, seq.blocks, x1, x2, context, unique_params(seq.blocks))


def _budget_state(seq):
    # [Plans, {k: head run}], kept in the instance dict: out of the module tree and its state
    state = seq.__dict__.get("_budget")
    if state is None:
        state = seq.__dict__["_budget"] = [Plans(), {}]
    return state


def _head_run(seq, k):
    """A run of blocks[:k] (the same modules) with `seq`'s settings: the memory-saving node of a run
    with a budget."""
    heads = _budget_state(seq)[1]
    head = heads.get(k)
    if head is None:
        head = heads[k] = seq._run_of(seq.blocks[:k])
    head.engine, head.preserve_rng_state = seq.engine, seq.preserve_rng_state
    head.compile_options = seq.compile_options
    if "reconstruction_monitor" in seq.__dict__:
        head.reconstruction_monitor = seq.reconstruction_monitor
    return head


def run_within_budget(seq, x1, x2, context):
    """(y1, y2) of `seq` with the kept blocks run under plain autograd after the memory-saving node
    of the others; None when the plan keeps no block."""
    k = plan_of(seq, x1, x2, context).first_kept
    if k == len(seq.blocks):
        return None
    if k:
        head = _head_run(seq, k)
        x1, x2 = head.forward(x1, x2, **context)
        seq.engine_in_use = head.engine_in_use
    for block in seq.blocks[k:]:
        x1, x2 = block(x1, x2, **context)
    return x1, x2
