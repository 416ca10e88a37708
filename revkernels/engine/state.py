"""What a recompute must reproduce from the forward: randomness, autocast, BatchNorm behaviour.

- `RngState` snapshots the CPU generator and the CUDA generators in use, and replays them around
  a recompute so dropout draws the same masks; the caller's RNG stream is restored afterwards.
- `AutocastState` records the autocast mode of the forward so the recompute runs in the same
  dtypes.
- `in_mode` puts a module and its submodules back in the train/eval modes, and its random layers
  back to the rates, its forward ran with.
- `param_versions` / `check_param_versions`: a parameter changed in place between a forward and
  its backward raises autograd's error (the rebuild would use the new values).
- `differentiated_once`: the engines' backwards are not differentiable.
- `randomness_before` / `check_randomness_after`: a block that says it draws no random numbers is checked, once per
  mode, to draw none (its rebuild would draw new ones: silently wrong gradients).
(BatchNorm, InstanceNorm and spectral norm in a recompute:
`revkernels.engine.structure.recompute_context`.)
"""
import contextlib
import functools
import inspect
import numbers
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from revkernels.engine.structure import cached, stochastic_modules


# The context of a run called without keywords. A plain dict (``f(x, **NO_CONTEXT)`` costs least
# with one); nothing may write to it (a callee's ``**context`` is always a copy).
NO_CONTEXT = {}


def module_modes(module):
    """``(flags, rates)``: the train/eval flags of `module` and of each of its submodules, and the
    rate of each layer that may draw random numbers (`_rate_slots`): what `in_mode` puts back."""
    return _read_modes(_modules(module), _rate_slots(module))


def _read_modes(modules, slots):
    """``(flags, rates)`` of `modules` and of the (layer, attribute) `slots`, as they are now."""
    return tuple(m.training for m in modules), tuple(getattr(m, name) for m, name in slots)


def _modules(module):
    # (`module` is not part of its own cache entry, which must not keep its key alive)
    return [module, *cached(module, "submodules", lambda m: list(m.modules())[1:])]


def _rate_slots(module):
    """``[(layer, attribute)]`` for the rate of each submodule of `module` that may draw random
    numbers (`stochastic_modules`): ``dropout`` of an ``nn.MultiheadAttention``, ``p`` of the
    others that have a numeric one that can be set (dropout layers, revkernels' `DropPath`); cached.
    A recompute with another rate would draw other masks from the replayed generator state."""
    return cached(module, "rate_slots", _find_rate_slots)


def _find_rate_slots(module):
    slots = []
    for m in stochastic_modules(module):
        name = "dropout" if isinstance(m, nn.MultiheadAttention) else "p"
        declared = getattr(type(m), name, None)
        read_only = isinstance(declared, property) and declared.fset is None  # (cannot be put back)
        if isinstance(getattr(m, name, None), numbers.Real) and not read_only:
            slots.append((m, name))
    return slots


def run_modes(blocks):
    """``((flags, rates), counts)``: the `module_modes` of every block of `blocks` (a ModuleList of
    blocks), one block's after the other, read in one pass (one tuple compare tells a backward
    whether any changed), and how many flags and rates each block has."""
    modules, slots, counts = cached(blocks, "run_modules", _run_modules)
    return _read_modes(modules, slots), counts


def _run_modules(blocks):
    per_block = [(_modules(block), _rate_slots(block)) for block in blocks]
    return ([m for modules, _ in per_block for m in modules], [s for _, slots in per_block for s in slots],
            [(len(modules), len(slots)) for modules, slots in per_block])


def in_run_modes(stack, blocks, modes):
    """Enters `in_mode` of each block of `blocks` with its part of `modes` (`run_modes`) on `stack`
    (a ``contextlib.ExitStack``)."""
    for block, mode in zip(blocks, block_modes(modes)):
        stack.enter_context(in_mode(block, mode))


def block_modes(modes):
    """`run_modes`' ``((flags, rates), counts)`` split into each block's `module_modes`."""
    (flags, rates), counts = modes
    split, start, rate_start = [], 0, 0
    for count, rate_count in counts:
        split.append((flags[start:start + count], rates[rate_start:rate_start + rate_count]))
        start += count
        rate_start += rate_count
    return split


@contextlib.contextmanager
def in_mode(module, modes):
    """The body runs with `module` and its submodules in the train/eval modes, and its random
    layers with the rates, of `modes` (their `module_modes` when the forward ran: ``model.eval()``,
    a submodule's own ``eval()``, or a dropout probability changed between a forward and its
    backward must not change what the recompute computes); their modes and rates now are restored
    after."""
    modules, slots = _modules(module), _rate_slots(module)
    now = _read_modes(modules, slots)
    if now == modes:
        yield
        return
    flags, rates = modes
    if len(flags) != len(modules) or len(rates) != len(slots):
        raise RuntimeError("revkernels: modules were added to or removed from a run's blocks between its forward and "
                           "its backward; the backward rebuilds activations from the modules")
    _set_modes(modules, slots, flags, rates)
    try:
        yield
    finally:
        _set_modes(modules, slots, *now)


def _set_modes(modules, slots, flags, rates):
    for m, mode in zip(modules, flags):
        m.training = mode
    for (m, name), rate in zip(slots, rates):
        if getattr(m, name) != rate:  # (DropPath's setter builds its rate tensors anew)
            setattr(m, name, rate)


class RngState:
    """Generator states of the CPU and of the given CUDA devices, taken at construction."""

    __slots__ = ("cpu", "cuda")

    def __init__(self, cuda_devices=()):
        self.cpu = torch.get_rng_state()
        self.cuda = {d: torch.cuda.get_rng_state(d) for d in cuda_devices}

    def restore(self):
        """Sets the generators to this state (they draw on from it)."""
        torch.set_rng_state(self.cpu)
        for device, state in self.cuda.items():
            torch.cuda.set_rng_state(state, device)

    @contextlib.contextmanager
    def replay(self):
        """Runs the body from this state; restores the generators as they were before."""
        saved = RngState(tuple(self.cuda))
        self.restore()
        try:
            yield
        finally:
            saved.restore()


@dataclass
class BlockState:
    """What a block's forward leaves for its recompute: the generator states right before F and
    right before G ran (None: no replay), and the buffers the forward changed with their values
    before it (`revkernels.engine.structure.BufferRecord.changed`; the engines fill it in)."""

    rng_f: RngState | None
    rng_g: RngState | None
    buffers: tuple = ()


# Context values whose tensors the engines look into (never differentiated: `check_context_grads`;
# saved for the backward: `save_with_context`)
CONTEXT_CONTAINERS = (tuple, list, dict)


def grad_names(context):
    """The names of the context tensors that require grad."""
    return [k for k, v in context.items() if isinstance(v, torch.Tensor) and v.requires_grad] if context else []


def grad_tensors(context):
    """The context tensors that require grad (inputs of the engines' autograd nodes)."""
    return [context[k] for k in grad_names(context)]


def with_grad_leaves(context, names):
    """``(context, leaves)``: `context` with each tensor named in `names` replaced by a fresh
    detached leaf that requires grad (what a backward differentiates like a parameter), and those
    leaves in the order of `names`."""
    leaves = [context[k].detach().requires_grad_() for k in names]
    return {**context, **dict(zip(names, leaves))}, leaves


def call_with_context(method, *args, context):
    """``method(*args, context=context)``, or ``method(*args)`` without context: the blocks' steps'
    signature before context, so a block that overrides them without it still works."""
    return method(*args, context=context) if context else method(*args)


def records_graph(x1, x2, params, grad_context):
    """Whether a run's call differentiates anything: grad mode on, and a stream, a parameter (of
    `params`, those requiring grad) or a context tensor (`grad_context`) requiring grad."""
    # (len, not bool, of the lists: torch 2.11's Dynamo cannot trace bool of a list)
    return torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad or len(params) > 0 or len(grad_context) > 0)


@contextlib.contextmanager
def autograd_recording():
    """A context in which operations record autograd graphs again inside a custom op's kernel
    (the dispatcher excludes the Autograd and ADInplaceOrView keys below an op's own autograd; grad
    mode alone does not bring them back), with the dispatch keys of an eager call (which has them
    already)."""
    keys = torch._C.DispatchKey
    with torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False), \
            torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False):
        yield


def cuda_devices_of(*tensors):
    """The CUDA device indices of `tensors` (whose generators a forward may draw from)."""
    return tuple(sorted({t.device.index for t in tensors if t.is_cuda}))


_RANDOMNESS_CHECKED = weakref.WeakKeyDictionary()  # block -> the training flags its forward was checked in


def _branch_names(block):
    names = [f"{k}={type(m).__name__}" for k, m in block.named_children()]
    return f"{type(block).__name__}({', '.join(names)})"


def randomness_before(block, x1, x2):
    """The generator states before the first forward of `block` in each mode (training or eval),
    for `check_randomness_after`; None once that mode was checked, while torch.compile traces and
    under a FakeTensorMode (whose generator states have no values to compare)."""
    checked = _RANDOMNESS_CHECKED.get(block)
    if (checked is not None and block.training in checked) or torch.compiler.is_compiling() or \
            torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return None
    return RngState(cuda_devices_of(x1, x2))


def check_randomness_after(block, before):
    """Warns, naming `block`, when its forward drew random numbers (the CPU generator or one of the
    inputs' CUDA generators moved since `before`) while its ``draws_random()`` is False. Such
    randomness (``torch.randn_like`` noise, ``F.dropout`` with a float attribute, an attention
    module with a dropout argument of its own) is not replayed: the rebuild draws new numbers and
    the gradients are wrong. The cure is to declare it (``draws_random``, a bool or a method, on the
    module that draws)."""
    _RANDOMNESS_CHECKED.setdefault(block, set()).add(block.training)
    if block.draws_random():
        return
    after = RngState(tuple(before.cuda))
    if torch.equal(before.cpu, after.cpu) and all(torch.equal(before.cuda[d], after.cuda[d]) for d in before.cuda):
        return
    warnings.warn(
        f"revkernels: the forward of {_branch_names(block)} drew random numbers, but its draws_random() is "
        "False, so the rebuild draws different ones and its gradients are wrong. Declare the randomness on "
        "the module that draws it (an attribute or method `draws_random` returning True while it draws), "
        "or use eval mode / p=0.", UserWarning, stacklevel=4)


def maybe_replay(rng_state):
    """`rng_state.replay()`, or nothing when no state was recorded."""
    return rng_state.replay() if rng_state is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class AutocastState:
    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @staticmethod
    def capture(device_type):
        try:
            enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
        except RuntimeError:  # a device type autocast does not know (e.g. "meta"): never autocast
            enabled, dtype = False, torch.float32
        return AutocastState(device_type, enabled, dtype, torch.is_autocast_cache_enabled())

    def off_then_and_now(self):
        """Whether autocast is off now and was off in the recorded forward (no context needed)."""
        if self.enabled:
            return False
        try:
            return not torch.is_autocast_enabled(self.device_type)
        except RuntimeError:
            return True

    def enter(self):
        """A context that runs its body under the recorded autocast mode."""
        if not self.enabled:
            # Explicitly off, so an autocast region around the backward does not leak into it.
            return torch.autocast(self.device_type, enabled=False) if self.device_type in ("cpu", "cuda") \
                else contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=True, cache_enabled=self.cache_enabled)


def param_versions(params):
    """The version counters of `params` (an in-place change bumps them), for `check_param_versions`."""
    return [p._version for p in params]


def check_param_versions(params, versions, names_from=None, prefix=""):
    """Raises autograd's in-place error where a parameter of `params` changed in place since the
    forward took `versions` (an optimizer step, clipping or a copy between a forward and its
    backward): a memory-saving backward rebuilds the activations from the parameters, so it would
    differentiate at the new values, silently. `names_from`: a module whose parameter names the
    message uses (after `prefix`)."""
    if param_versions(params) == versions:
        return
    p, version = next((p, v) for p, v in zip(params, versions) if p._version != v)
    names = {id(q): prefix + name for name, q in names_from.named_parameters()} if names_from is not None else {}
    name = names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"{name} is at version {p._version}; expected version {version} instead (revkernels: a memory-saving "
        "run rebuilds its activations from its parameters in the backward; change them, e.g. step the "
        "optimizer, after the backward)")


def differentiated_once(backward):
    """``torch.autograd.function.once_differentiable`` for the engines' backwards. Their grads depend
    on the parameters through the rebuild even where the output grads do not require grad, so under
    ``create_graph=True`` every grad they return gets a node that raises when differentiated (torch's
    decorator adds it only where an output grad requires grad: a gradient penalty through a run
    whose loss was linear in its outputs lost its second-order term, silently)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        # The node also takes the saved tensors and ``ctx.params`` that require grad (the run's outputs
        # lead on to all its inputs): on the path to every input, a second backward restricted to some
        # of them (``inputs=``, ``torch.autograd.grad``) raises too, where it found no path before.
        anchors = [t for t in (*ctx.saved_tensors, *getattr(ctx, "params", ())) if t.requires_grad]
        error = torch._C._functions.DelayedError(
            b"trying to differentiate twice the backward of a revkernels memory-saving run (engine='autograd' "
            b"differentiates twice)", len(outputs) + len(anchors))
        return error(*[None if t is None else t.detach().requires_grad_() for t in outputs], *anchors)[:len(outputs)]

    return wrapper


def check_context(owner, blocks, context, label=None):
    """Raises TypeError naming the block whose F or G cannot take the keywords of `context`
    (a forward without a parameter of that name or ``**kwargs``), or naming the keywords no F or
    G uses (every one names others, or takes them through ``**kwargs`` only to ignore them, as
    revkernels' attention and MLP branches do: ``absorbs_context``), such as a misspelled
    ``attention_mask`` for ``attn_mask``. Checked once per module structure and set of keywords
    (cached on `owner`); `label(i)` names block i."""
    keys = tuple(sorted(context))
    problem = cached(owner, ("context", keys), lambda _: _context_problem(blocks, keys, label))
    if problem is not None:
        raise TypeError(problem)


def check_context_grads(context):
    """Raises TypeError for a context value that holds tensors requiring grad inside a container
    (a tuple, list or dict): the memory-saving engines differentiate the context's top-level
    tensors only, so such a tensor would get no grad."""
    for name, value in context.items():
        if isinstance(value, CONTEXT_CONTAINERS) and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(value)):
            raise TypeError(f"revkernels: context {name!r} holds tensors that require grad inside a "
                            f"{type(value).__name__}; a memory-saving engine differentiates only tensors "
                            "passed as keywords of their own: pass each one as its own keyword")


def _context_problem(blocks, keys, label):
    unused = set(keys)
    for i, block in enumerate(blocks):
        for branch in ("f", "g"):
            module = block._modules.get(branch)
            if module is None:
                continue
            missing, used = _unaccepted(module, keys)
            if missing:
                name = f"blocks[{i}]" if label is None else label(i)
                return (f"revkernels: {name}.{branch} ({type(module).__name__}) does not accept the context "
                        f"keyword(s) {missing}: every F and G of a run is called with the run's context, so "
                        "one that does not use it must take **kwargs in its forward")
            unused -= used
    if unused:
        return (f"revkernels: no F or G of the run uses the context keyword(s) {sorted(unused)}: revkernels' "
                "attention and MLP branches take attn_mask and ignore other keywords (a misspelling?)")
    return None


def _unaccepted(module, keys):
    """``(the keywords of `keys` that module.forward has no parameter for, those it may use)``: a
    forward with ``**kwargs`` accepts every keyword and may use those it does not name, unless its
    module declares ``absorbs_context`` (its ``**kwargs`` only absorb other branches' keywords)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the call itself decides
        return [], set(keys)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return [], {k for k in keys if k in named or not getattr(module, "absorbs_context", False)}
    return [k for k in keys if k not in named], {k for k in keys if k in named}
