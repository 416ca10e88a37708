"""What the engines need to know about a module's structure, computed once per structure.

A reversible step must not walk ``named_parameters``/``named_modules`` on every block of every
step (at small sizes the walks cost more than the kernels). `cached(module, key, build)` keeps
``build(module)`` until the structure of any module changes: a global version counter is bumped
by torch's module registration hooks, which fire whenever a parameter or submodule is registered
or replaced (``module.weight = nn.Parameter(...)``, ``add_module``, ...) and a buffer is
registered under a new name. What can change without a registration (``requires_grad``,
``training``, dropout probabilities) is read at step time from the cached lists. FSDP2
(``fully_shard``) swaps its modules' sharded and unsharded parameters by writing
``module._parameters`` directly, which no hook sees: `param_slots` re-reads the parameters of
FSDP-managed modules on every access, and `invalidate` lets the engines drop the cache when they
see a run that was sharded after its structure was cached. ``Module._apply``
(``.to()``, ``.double()``, ``.to_empty()``) also writes new Parameters into ``_parameters`` without
a registration where it cannot convert in place (between device types such as meta and CPU, or
with ``torch.__future__.set_overwrite_module_params_on_conversion(True)``); it replaces every
parameter of the tree it is called on, so each access of cached parameters checks the first one
(`ParamSlots.stale`). ``torch.func.functional_call`` swaps tensors into any slots for one call:
`unique_params`, which every run calls, checks every slot.
``ModuleList.insert``, ``nn.Sequential.insert``, ``del`` and ``pop`` add or remove submodules by
writing ``_modules`` directly, also without a registration: each run checks the size of every
``_modules`` dict of its tree (`check_members`).

`ParamSlots` swaps detached aliases of a module's parameters in and out of the modules that hold
them (every occurrence of a tied parameter), so a local graph differentiates the aliases and fires
no hook of the parameters themselves: what ``torch.func.functional_call`` does, without its
per-call walks.
"""
import collections
import contextlib
import functools
import operator
import warnings
import weakref

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules import module as module_hooks
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)
from torch.nn.utils import parametrize

_version = 0
_registrations = 0  # the registrations among the version's changes (`invalidate` is not one)


def _bump(*_args):
    global _version, _registrations
    _version += 1
    _registrations += 1


def _bump_for_new_buffer(module, name, _buffer):
    # No cache holds buffers: one assigned again under its name (``Module.__setattr__`` registers it
    # again; spectral norm's power iteration does so in every training forward) changes nothing
    # cached, and a bump there would rebuild every cache each step (and, traced inside a compiled
    # step, make Dynamo guard on the counter and compile the step again on every call).
    if name not in module._buffers:
        _bump()


register_module_parameter_registration_hook(_bump)
register_module_buffer_registration_hook(_bump_for_new_buffer)
register_module_module_registration_hook(_bump)

_CACHE = weakref.WeakKeyDictionary()


class LRU(collections.OrderedDict):
    """A dict that keeps its `size` most recently used entries: a process-wide registry keyed by
    values users make (compile options, context values, graph signatures) must not grow without
    bound."""

    def __init__(self, size):
        super().__init__()
        self.size = size

    def __getitem__(self, key):
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


def assume_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does (Dynamo runs `fn` at trace time and bakes
    its result into the graph), without importing Dynamo with revkernels: that import alone costs
    about 2 s, more than torch's own. tests/engine/test_compile.py checks it against torch's."""
    fn._dynamo_marked_constant = True
    return fn


def structure_version():
    """A counter that changes whenever any module registers or replaces a parameter, buffer or
    submodule."""
    return _version


def invalidate():
    """Drops every cached structure (for changes no registration hook reports)."""
    global _version
    _version += 1


def check_members(module):
    """Drops every cached structure (`invalidate`) when a submodule may have been added to or
    removed from a module under `module` without a registration (see the module docstring): the
    sizes of the tree's ``_modules`` dicts against those of a snapshot taken at the last check.
    Any other structure change since the snapshot (a registration) invalidates too: caches built
    after it but before a later insert would otherwise hold the tree as it was then. A version
    changed only by invalidations (another tree's check: two runs over the same blocks, such as a
    run with a memory budget and the run of its rebuilt blocks) is no registration: the sizes
    decide, or the two checks would drop every cache in turn on every call."""
    snapshot = _MEMBERS.get(module)
    if snapshot is not None and tuple(map(len, snapshot[1])) == snapshot[2]:
        if snapshot[0] == _version:
            return
        if snapshot[3] == _registrations:
            _MEMBERS[module] = (_version, *snapshot[1:])
            return
    if snapshot is not None:
        invalidate()
    dicts = [sub._modules for sub in module.modules()]
    _MEMBERS[module] = (_version, dicts, tuple(map(len, dicts)), _registrations)


# module -> (structure version, its tree's _modules dicts, their sizes, the registrations then)
_MEMBERS = weakref.WeakKeyDictionary()


def cached(module, key, build):
    """``build(module)``, computed once per module structure (see the module docstring). While
    torch.compile traces, computed afresh (tracing runs once; a cache write would be a side effect
    the trace must replay)."""
    if torch.compiler.is_compiling():
        return build(module)
    entry = _CACHE.get(module)
    if entry is None or entry[0] != _version:
        entry = (_version, {})
        _CACHE[module] = entry
    values = entry[1]
    if key not in values:
        values[key] = build(module)
    return values[key]


class ParamSlots:
    """The parameters of a module tree, each once, with every (module, name) slot holding it (the
    module by weak reference: a cache entry must not keep its own key, the tree's root, alive).

    `managed`: some owner is managed by FSDP2, which swaps sharded and unsharded parameters into
    the slots without a registration; `refresh` then re-reads them (in place: holders of `params`
    see the current tensors)."""

    __slots__ = ("params", "names", "slots", "parametrized", "managed", "_qualified", "_by_name", "_held")

    def __init__(self, module):
        by_id, index = {}, {}
        self.params, self.names = [], []
        self._qualified = {}  # every qualified name of a parameter (a shared one has several) -> index in params
        for owner_name, owner in module.named_modules(remove_duplicate=False):
            for name, p in owner._parameters.items():
                if p is None:
                    continue
                qualified = f"{owner_name}.{name}" if owner_name else name
                if id(p) not in by_id:
                    by_id[id(p)] = []
                    index[id(p)] = len(self.params)
                    self.params.append(p)
                    self.names.append(qualified)
                self._qualified.setdefault(qualified, index[id(p)])
                if (owner, name) not in by_id[id(p)]:
                    by_id[id(p)].append((owner, name))
        self.slots = [[(weakref.ref(owner), name) for owner, name in by_id[id(p)]] for p in self.params]
        # The dict holding each parameter's first slot and its key: what `stale` checks
        self._held = ([by_id[id(p)][0][0]._parameters for p in self.params], [by_id[id(p)][0][1] for p in self.params])
        # Parametrized modules compute their weights from `parametrizations.*`: only
        # functional_call knows how to substitute those.
        self.parametrized = any(parametrize.is_parametrized(m) for m in module.modules())
        # fully_shard marks every module whose parameters it swaps (also read by torch.compile).
        self.managed = any(getattr(owner, "_is_fsdp_managed_module", False)
                           for slots in by_id.values() for owner, _ in slots)
        self._by_name = None

    def stale(self, every=False):
        """Whether a parameter was replaced without a registration (see the module docstring): the
        first slot no longer holds the first parameter (with `every`, some slot no longer holds its
        parameter: ``torch.func.functional_call`` may swap any of them). False for FSDP-managed
        slots (`refresh`)."""
        if self.managed or not self.params:
            return False
        dicts, names = self._held
        if not every:
            return dicts[0].get(names[0]) is not self.params[0]
        return any(map(operator.is_not, map(dict.get, dicts, names), self.params))  # (no bytecode per slot)

    def refresh(self):
        """Re-reads each parameter from its first slot (see `managed`)."""
        for i, slots in enumerate(self.slots):
            owner, name = slots[0]
            p = owner()._parameters[name]
            if p is not self.params[i]:
                self.params[i] = p
                self._by_name = None

    def by_name(self):
        """{qualified name: parameter}, under every name of a shared parameter."""
        if self._by_name is None:
            self._by_name = {name: self.params[i] for name, i in self._qualified.items()}
        return self._by_name

    @contextlib.contextmanager
    def substituted(self, aliases):
        """Runs the body with `aliases` ({index in params: tensor}) in place of the parameters."""
        try:
            for i, alias in aliases.items():
                for owner, name in self.slots[i]:
                    owner()._parameters[name] = alias
            yield
        finally:
            for i in aliases:
                for owner, name in self.slots[i]:
                    owner()._parameters[name] = self.params[i]


def param_slots(module):
    """The module's `ParamSlots` (cached; the current parameters of an FSDP-managed module, and
    built again after a conversion replaced them)."""
    slots = cached(module, "param_slots", ParamSlots)
    if slots.managed:
        slots.refresh()
    elif slots.stale():
        invalidate()
        slots = cached(module, "param_slots", ParamSlots)
    return slots


def coupling_kind(block):
    """The coupling `block`'s forward step computes, as its class declares it (a ``coupling``
    attribute on the class that defines ``forward_with_state`` or on a subclass of it): "full" (y1 = x1 + F(x2),
    y2 = x2 + G(y1): `ReversibleBlock`, and fused blocks computing the same), "half" (y1 = x2,
    y2 = x1 + F(x2): `HalfCouplingBlock`), or None: a class with a forward step of its own that
    declares none (the engines then run its own steps only). Blocks declare; the engine tests no
    class."""
    return _declared_coupling(type(block))


@functools.cache
def _declared_coupling(cls):
    # the nearest class that defines the step or declares a coupling: a step defined below the
    # nearest declaration is undeclared
    for klass in cls.__mro__:
        if "forward_with_state" in vars(klass) or "coupling" in vars(klass):
            return vars(klass).get("coupling")
    return None


def branch_count(block):
    """How many branches (F, and G where there is one) `block` runs: how many generator states its
    forward keeps when it draws random numbers (`BlockState`'s rng_f, rng_g)."""
    return 1 if block._modules.get("g") is None else 2


def y2_only_params(blocks):
    """Ids of the parameters only the last block's y2 depends on: those of its G (of its F for a
    half block) that no other F or G of `blocks` holds. When a loss does not use y2, plain autograd
    leaves their ``.grad`` None, and so do the engines (a zero grad would still move them under
    momentum or weight decay). Empty for a last block with a forward of its own."""
    kind = coupling_kind(blocks[-1])
    if kind is None:
        return frozenset()
    last, branch = len(blocks) - 1, "g" if kind == "full" else "f"
    only = {id(p) for p in param_slots(blocks[-1]._modules[branch]).params}
    for i, block in enumerate(blocks):
        for name, module in block._modules.items():  # by name: F may be G's very module
            if module is not None and not (i == last and name == branch):
                only.difference_update(id(p) for p in param_slots(module).params)
    return frozenset(only)


def submodule_hooked(module, backward=False):
    """Whether a forward hook (with `backward`, also a backward hook) is registered globally or on a
    submodule of `module` (its own hooks aside: the engines never call the block module itself)."""
    if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks or (
            backward and (module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks)):
        return True
    # Each module keeps its hook dicts for life (hooks are added to and removed from them).
    return any(cached(module, ("hook_dicts", backward), lambda m: [
        hooks for sub in list(m.modules())[1:]
        for hooks in ((sub._forward_hooks, sub._forward_pre_hooks, sub._backward_hooks, sub._backward_pre_hooks)
                      if backward else (sub._forward_hooks, sub._forward_pre_hooks))]))


def module_input(leaf):
    """What a recompute calls a module on, `leaf` being the tensor it differentiates with respect to
    (``torch.autograd.grad``): a view of it while a global forward pre-hook is registered. Such a
    hook (torch's ``ModuleTracker``, which ``FlopCounterMode`` runs) hangs a multi-grad hook on the
    module's inputs, which ``torch.autograd.grad`` refuses on a leaf."""
    return leaf.view_as(leaf) if module_hooks._global_forward_pre_hooks else leaf


def running_stats_layers(module):
    """The layers under `module` that keep running statistics (BatchNorm and InstanceNorm, both
    `_NormBase`; cached; `module` itself is not part of its own cache entry, which must not keep
    its key alive)."""
    layers = cached(module, "running_stats", lambda m: [layer for layer in m.modules()
                                                        if layer is not m and isinstance(layer, _NormBase)])
    return [module, *layers] if isinstance(module, _NormBase) else layers


def _may_draw(m):
    return isinstance(m, (_DropoutNd, nn.MultiheadAttention)) or hasattr(m, "draws_random")


def _stochastic_modules(module):
    # `module` itself is left out: a block's own `draws_random` method calls this function.
    return [m for m in module.modules() if m is not module and _may_draw(m)]


def stochastic_modules(module):
    """The submodules of `module` that may draw random numbers (see `draws_random`; cached)."""
    return cached(module, "stochastic", _stochastic_modules)


def draws_random(module, itself=False):
    """Whether a submodule of `module` (with `itself`, `module` too: a PETRA stage that is a
    dropout layer) can draw random numbers in its current mode: a dropout layer with p > 0 in
    training, an `nn.MultiheadAttention` with dropout > 0 in training, or a module whose
    ``draws_random`` attribute (a bool, or a method taking no argument) says so. Randomness drawn
    any other way (``F.dropout`` with a float attribute in a custom module) is not visible here:
    such a module must declare ``draws_random``."""
    if itself and _may_draw(module) and _module_draws(module):
        return True
    for m in stochastic_modules(module):
        if _module_draws(m):
            return True
    return False


def _module_draws(m):
    declared = getattr(m, "draws_random", None)
    if declared is not None:
        return bool(declared() if callable(declared) else declared)
    if isinstance(m, nn.MultiheadAttention):
        return m.training and m.dropout > 0
    return m.training and m.p > 0


def spectral_norms(module):
    """The spectral-norm parametrizations (``torch.nn.utils.parametrizations.spectral_norm``) under
    `module` (cached)."""
    return cached(module, "spectral_norms", lambda m: [n for n in m.modules() if isinstance(n, _SpectralNorm)])


def recompute_context(*modules):
    """A context for a recompute of what the forward ran: the BatchNorm and InstanceNorm layers in
    training mode under `modules` use batch (instance) statistics without updating running_mean/
    running_var/num_batches_tracked, and the spectral-norm parametrizations in training mode skip
    their power iteration (the forward updated both; the recomputed weight is then bitwise the
    forward's, from the updated vectors). Under ``parametrize.cached()`` the parametrized tensors
    are computed afresh: the cache holds the forward's, computed without grad, so the recompute
    would not differentiate them. A no-op context where there is none of these."""
    layers = [layer for module in modules for layer in running_stats_layers(module)
              if layer.training and layer.track_running_stats]
    norms = [norm for module in modules for norm in spectral_norms(module) if norm.training]
    uncached = _cache_holds_parametrizations(modules)
    return _untracked(layers, norms, uncached) if layers or norms or uncached else contextlib.nullcontext()


def parametrize_cache_off(*modules):
    """For a forward without grad under ``parametrize.cached()``: the parametrized tensors of
    `modules` are computed without filling the cache, whose tensor (without a graph) another use of
    the module in the same scope would get instead of one it can differentiate. A no-op context
    outside ``cached()`` or without parametrizations."""
    return _untracked((), (), True) if _cache_holds_parametrizations(modules) else contextlib.nullcontext()


def _cache_holds_parametrizations(modules):
    return parametrize._cache_enabled > 0 and any(param_slots(module).parametrized for module in modules)


_RUNNING_STATS = ("running_mean", "running_var")


@contextlib.contextmanager
def _untracked(layers, norms, uncached):
    cache_enabled = parametrize._cache_enabled
    # InstanceNorm hands its running statistics to F.instance_norm whatever track_running_stats says,
    # and the op updates them: they are hidden instead (BatchNorm passes None when it is off).
    hidden = [(layer, [layer._buffers[name] for name in _RUNNING_STATS])
              for layer in layers if isinstance(layer, _InstanceNorm)]
    for layer in layers:
        layer.track_running_stats = False
    for layer, _ in hidden:
        for name in _RUNNING_STATS:
            layer._buffers[name] = None
    for norm in norms:
        norm.training = False
    if uncached:
        parametrize._cache_enabled = 0  # what parametrize's getters read (its cache is left as it is)
    try:
        yield
    finally:
        if uncached:
            parametrize._cache_enabled = cache_enabled
        for layer in layers:
            layer.track_running_stats = True
        for layer, buffers in hidden:
            for name, buffer in zip(_RUNNING_STATS, buffers):
                layer._buffers[name] = buffer
        for norm in norms:
            norm.training = True


# ---- buffers a forward changes ----
# A module may change its buffers in a training forward (an EMA of its inputs, a step counter, a
# quantization observer). The recompute must see them as the forward saw them, and leave them as the
# forward left them (plain autograd runs the forward once): `BufferRecord` keeps the values a block's
# forward changed, `buffers_as_before` puts copies of them in for the recompute. The buffers that
# `recompute_context` handles (running statistics, spectral norm's vectors) are left to it.

_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


class _WatchedBuffers:
    """The buffer slots of a block that a forward may change (cached per structure), with the slots
    seen changed in place (their values are copied before each forward; a buffer assigned anew
    keeps its old tensor, which needs no copy)."""

    __slots__ = ("slots", "in_place", "first", "warned")

    def __init__(self, module):
        handled = {id(m) for m in running_stats_layers(module)}
        vectors = {id(m) for m in spectral_norms(module)}
        self.slots = [(weakref.ref(m), name, f"{prefix}.{name}" if prefix else name)
                      for prefix, m in module.named_modules() for name in m._buffers
                      if id(m) not in vectors and not (id(m) in handled and name in _STATISTICS)]
        self.in_place = set()  # indices into slots
        self.first = True  # no forward seen yet: every value is copied
        self.warned = False


class BufferRecord:
    """What a block's buffers held before its forward (`record_buffers`); `changed` lists, after
    it, those the forward changed (assigned anew or changed in place) with their old values."""

    __slots__ = ("watched", "entries")

    def __init__(self, watched):
        self.watched = watched
        copy_all = watched.first
        self.entries = []
        for i, (ref, name, _) in enumerate(watched.slots):
            holder = ref()
            t = None if holder is None else holder._buffers.get(name)
            if t is None:
                continue
            version = None if t.is_inference() else t._version
            copy = t.clone() if (copy_all or i in watched.in_place) and version is not None else None
            self.entries.append((i, holder, name, t, version, copy))

    def changed(self, label):
        """``((holder, name, value before the forward), ...)`` for the buffers the forward changed;
        `label()` names the block in the warning for a buffer first seen changed in place (its old
        value was not kept, None here: that step's recompute sees the new one)."""
        watched, changed, missed = self.watched, [], []
        for i, holder, name, t, version, copy in self.entries:
            now = holder._buffers.get(name)
            in_place = version is not None and t._version != version
            if now is t and not in_place:
                continue
            if in_place:
                watched.in_place.add(i)
                if copy is None:
                    missed.append(watched.slots[i][2])
            changed.append((holder, name, copy if in_place else t))
        watched.first = False
        if missed and not watched.warned:
            watched.warned = True
            warnings.warn(f"revkernels: the forward of {label()} changed buffer(s) {missed} in place for the first "
                          "time since its first step; their values before it were not kept, so this step's "
                          "recompute sees the new ones (later steps keep them)", UserWarning, stacklevel=4)
        return tuple(changed)

    def put_back(self, label):
        """Puts the buffers back as they were when recorded: a tensor assigned anew is replaced by
        the old one, a value changed in place is copied back (where it was copied: see `changed`)."""
        self.changed(label)
        for i, holder, name, t, version, copy in self.entries:
            holder._buffers[name] = t
            if version is not None and t._version != version and copy is not None:
                with torch.no_grad():
                    t.copy_(copy)


def record_buffers(block):
    """A `BufferRecord` of `block`'s buffers before a forward, or None when it holds none that a
    forward could change unseen."""
    watched = cached(block, "watched_buffers", _WatchedBuffers)
    return BufferRecord(watched) if watched.slots else None


@contextlib.contextmanager
def buffers_kept(block):
    """The body (a rebuild with no forward record: ``inverse``, ``reverse``) leaves the buffers of
    `block` as it found them (see `BufferRecord.put_back`)."""
    record = record_buffers(block)
    try:
        yield
    finally:
        if record is not None:
            record.put_back(lambda: type(block).__name__)


@contextlib.contextmanager
def buffers_as_before(changed):
    """The body (a recompute) runs with each buffer of `changed` (`BufferRecord.changed`) holding a
    copy of its value before the forward (of the value the forward left, where that was not kept);
    the values the forward left are put back after, whatever the body did to the copies."""
    if not changed:
        yield
        return
    now = [(holder, name, holder._buffers.get(name)) for holder, name, _ in changed]
    for (holder, name, before), (_, _, value) in zip(changed, now):
        holder._buffers[name] = (value if before is None else before).clone()
    try:
        yield
    finally:
        for holder, name, value in now:
            holder._buffers[name] = value


def detached_aliases(slots):
    """{index: detached leaf requiring grad} for the parameters of `slots` that require grad."""
    return {i: p.detach().requires_grad_() for i, p in enumerate(slots.params) if p.requires_grad}


__all__ = ["structure_version", "invalidate", "cached", "ParamSlots", "param_slots", "running_stats_layers",
           "draws_random", "recompute_context", "parametrize_cache_off", "record_buffers", "buffers_kept",
           "buffers_as_before", "detached_aliases"]


def check_residual(out, stream, name, stream_name):
    """Raises, naming branch `name`, unless `out` (a branch output) can be added to `stream`."""
    # The coupling inverts only if F/G keep the stream's shape; a promoted stream dtype would change
    # the output's dtype from block to block.
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"revkernels: {name} must return a single tensor, got {type(out).__name__}")
    if out.shape != stream.shape:
        raise ValueError(
            f"revkernels: {name} must preserve the shape of its input {tuple(stream.shape)} "
            f"(a reversible coupling needs shape-preserving F and G), got {tuple(out.shape)}"
        )
    if not out.is_floating_point():
        raise TypeError(f"revkernels: {name} must return a floating-point tensor, got {out.dtype}")
    if torch.promote_types(out.dtype, stream.dtype) != stream.dtype:
        raise ValueError(
            f"revkernels: {name} returned {out.dtype}, which would promote the {stream_name} stream "
            f"({stream.dtype}); keep the streams in the wider dtype"
        )


def unique_params(blocks):
    """The parameters of `blocks` (a ModuleList), each once, in module order: the cached list
    (the same list object while no module changed), checked slot by slot against the modules
    (a conversion or ``torch.func.functional_call`` may have swapped tensors in; then the caches
    are built again)."""
    managed, params, slots = cached(blocks, "unique_params", _unique_params)
    if managed:  # FSDP swaps the parameters without a registration: the current ones
        params = _unique_params(blocks)[1]
    elif slots.stale(every=True):
        invalidate()
        params = cached(blocks, "unique_params", _unique_params)[1]
    return params


def unique_grad_params(blocks):
    """`unique_params` that require grad."""
    return [p for p in unique_params(blocks) if p.requires_grad]


def swapped_params(blocks, params):
    """{id(the parameter a module holds now): the one it held}, where `params` (what `unique_params`
    returned when the run's forward ran) and the modules differ now; empty for a run managed by
    FSDP, which swaps its parameters itself. ``torch.func.functional_call`` swaps tensors in for
    the forward and puts the modules' own back before the backward runs."""
    managed = cached(blocks, "unique_params", _unique_params)[0]
    now = unique_params(blocks)
    if managed or now is params:
        return {}
    if len(now) != len(params):
        raise RuntimeError("revkernels: the run's modules gained or lost parameters between its forward and its "
                           "backward; the backward rebuilds activations from the modules")
    return {id(current): p for current, p in zip(now, params) if current is not p}


def _unique_params(blocks):
    """(managed, the parameters, their `ParamSlots`: the blocks' own, unless FSDP manages them)."""
    slots = param_slots(blocks)  # a ModuleList's slots: its blocks' parameters, each once, in module order
    return slots.managed, slots.params, slots
