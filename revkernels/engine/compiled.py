r"""The compiled engine: each block's forward and backward step as a pure function, compiled once
per block signature and shared by every block with that signature.

Steps (``torch.func``: the parameters and context tensors are inputs, never baked into a graph)::

    block_forward(block, kind, x1, x2, context) -> (y1, y2)     y1 = x1 + F(x2);  y2 = x2 + G(y1)
    branch_forward(module, name, res, a, context) -> res + H(a) (kind "half": (x2, x1 + F(x2)))
    block_backward(block, kind, f_names, g_names, y1, y2, dy1, dy2, context, grad_context)
        -> (x1, x2, dx1, dx2, f_grads, g_grads, context_grads)  G half, then F half:
    branch_backward(module, names, a, b, da, db, context, grad_context)   b_in = b - H(a)
        -> (b_in, da + (dH/da)^T db, (dH/dparams)^T db, (dH/dc)^T db)   (one `torch.func.vjp` of H)

Context (``seq(x1, x2, **context)``): every H is called as ``H(a, **context, **grad_context)``;
`grad_context` holds the context tensors that require grad (differentiated like the parameters,
their grads summed over F and G in the step and over the blocks by the walker), `context` the
rest. Tensors in either dict are graph inputs; plain values (a float scale, a flag) are guarded
on by Dynamo, so they are part of the step's signature (a new value compiles a new graph).

`names`: the slots of the branch's parameters that require grad (every slot of a tied parameter),
read from the module inside the step and differentiated through ``functional_call``; everything
else (frozen parameters, buffers) is read from the module too. Dynamo lifts them all to graph
inputs: passing the parameters as arguments besides the module would add a Python aliasing guard
per parameter to every call. The block is an argument of the compiled
function, so Dynamo guards on its structure (types, hyperparameters, training flags), shapes,
dtypes, autocast mode and which parameters require grad, not on its identity (the streams are
detached: whether the run's input requires grad does not matter): a stack of identical blocks
compiles one forward and one backward graph (``torch._dynamo.config.recompile_limit``, default 8,
bounds the signatures per step; past it Dynamo runs the step eagerly). Guards the engine does not
need are left out (`keeps_guard`: module hook dicts, which the walkers check before each step, and
library code); a ``guard_filter_fn`` in the compile options replaces that filter.

What the engine does with BatchNorm, randomness, shapes, parametrized modules, failing steps
and hooks: docs/compile.md.
"""
import contextlib
import functools
import sys
import sysconfig
import types
import warnings
import weakref

import torch
from torch.func import functional_call, vjp
from torch.nn.utils import parametrize
from torch.overrides import TorchFunctionMode

from revkernels.engine.fsdp import block_units, run_sharded
from revkernels.engine.sequential import eager_backward, reverse_blocks, run_reversible, walk_forward
from revkernels.engine.state import (NO_CONTEXT, AutocastState, BlockState, RngState, autograd_recording,
                                     cuda_devices_of, grad_names, grad_tensors, maybe_replay, records_graph)
from revkernels.engine.structure import (LRU, cached, check_residual, coupling_kind, invalidate, param_slots, recompute_context,
                                         stochastic_modules, submodule_hooked, unique_grad_params)


# ---- pure steps ----

def branch_forward(module, name, res, a, context):
    """``res + module(a, **context)``: one coupling half (`name`: "f" or "g", for errors)."""
    out = module(a, **context)
    check_residual(out, res, name, "x1" if name == "f" else "x2")
    return res + out


def block_forward(block, kind, x1, x2, context):
    """The block's forward: ``(x1 + F(x2), x2 + G(y1))``, or ``(x2, x1 + F(x2))`` for a half block."""
    y = branch_forward(block.f, "f", x1, x2, context)
    if kind == "half":
        return x2, y
    return y, branch_forward(block.g, "g", x2, y, context)


def branch_backward(module, names, a, b, da, db, context, grad_context):
    """Inverts ``b = b_in + H(a)`` and differentiates it: ``(b - H(a), da + (dH/da)^T db, grads,
    context_grads)`` with `grads` aligned to `names` (parameter slots of `module`) and
    `context_grads` a dict over `grad_context`."""
    params = tuple(_slot(module, name) for name in names)

    def h(ps, cs, x):
        return functional_call(module, dict(zip(names, ps)), (x,), {**context, **cs}, strict=False, tie_weights=False)

    with _FlatLinears() if torch.compiler.is_compiling() else contextlib.nullcontext():
        out, pull = vjp(h, params, grad_context, a)
        d_params, d_context, d_a = pull(db.to(out.dtype))
    return b - out, da + d_a, d_params, d_context


class _FlatLinears(TorchFunctionMode):
    """``F.linear`` with a bias on an input of more than two dimensions, as rows: (-1, in) ->
    (-1, out) and back, the reshape ATen's linear makes for it anyway. Traced under
    ``torch.func.vjp`` on the 3-D input itself, Dynamo specializes the backward step on its leading
    sizes (torch 2.13): a transformer's backward step compiled once per batch size and token
    count, and after `recompile_limit` sizes its blocks ran eagerly. Entered while Dynamo traces a
    step only (in eager steps the mode would only add a Python call per op)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and len(args) >= 2:  # (nn.Linear passes them positionally)
            x, weight = args[:2]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if bias is not None and x.dim() > 2:
                rows = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), weight, bias)
                return rows.view(*x.shape[:-1], rows.shape[-1])
        return func(*args, **kwargs)


def _slot(module, name):
    """What the slot `name` ("sub.weight") of `module` holds: ``module.get_parameter(name)``, also
    when it is a plain tensor (``torch.func.functional_call``'s, swapped back in for a backward)."""
    owner, _, last = name.rpartition(".")
    return module.get_submodule(owner)._parameters[last]


def block_backward(block, kind, f_names, g_names, y1, y2, dy1, dy2, context, grad_context):
    """Rebuilds the block's input from its output and returns
    ``(x1, x2, dx1, dx2, f_grads, g_grads, context_grads)`` (context grads of F and G summed)."""
    if kind == "half":  # (y1, y2) = (x2, x1 + F(x2))
        x1, dx2, f_grads, context_grads = branch_backward(block.f, f_names, y1, y2, dy1, dy2,
                                                          context, grad_context)
        return x1, y1, dy2, dx2, f_grads, (), context_grads
    x2, dy1_total, g_grads, g_context = branch_backward(block.g, g_names, y1, y2, dy1, dy2,
                                                        context, grad_context)
    x1, dx2, f_grads, f_context = branch_backward(block.f, f_names, x2, y1, dy2, dy1_total,
                                                  context, grad_context)
    return x1, x2, dy1_total, dx2, f_grads, g_grads, {k: f_context[k] + g_context[k] for k in grad_context}


# ---- compilation ----

def isolated(fn):
    """A copy of `fn` with its own code object: Dynamo keeps compiled graphs and counts recompiles
    per code object, so each `CompiledSteps` (set of options) gets its own caches and limits (and
    each compile of the attention benchmark and tests its own, not a recompile of a shared one)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


_STEPS = {"block_forward": block_forward, "block_backward": block_backward,
          "branch_forward": branch_forward, "branch_backward": branch_backward}


class CompiledSteps:
    """The compiled step functions for one set of compile options (``torch.compile`` keywords) and
    device type. On CPU inductor's ``cpp_wrapper`` is on unless the options set it."""

    def __init__(self, compile_options, device_type):
        options = dict(compile_options or {})
        unknown = set(options) - {"backend", "mode", "dynamic", "options"}
        if unknown:
            raise ValueError("revkernels: compile_options accepts backend, mode, dynamic and options, "
                             f"got {sorted(unknown)}")
        backend = options.pop("backend", "inductor")
        # The branch steps (blocks that draw random numbers) with static shapes unless asked: a
        # symbolic-size recompile cannot differentiate nn.Dropout under torch.func.vjp (but see
        # `any_shape` below)
        self.branch_dynamic = options.get("dynamic", False)
        if backend == "inductor":
            # fallback_random: random ops draw from the global generator as in eager (docs/compile.md)
            mode = options.pop("mode", None)
            inductor = dict(torch._inductor.list_mode_options(mode, options.get("dynamic")) if mode else {})
            inductor.update(options.pop("options", None) or {})
            inductor["fallback_random"] = True
            if device_type == "cpu":
                # A C++ wrapper calls the step's kernels: a small step's host time is mostly inductor's
                # Python wrapper otherwise (see docs/compile.md)
                inductor.setdefault("cpp_wrapper", True)
            options["options"] = inductor
        self.options = dict(backend=backend, **options)
        self._by_structure = {}  # `_Layout.key` -> (step functions, any-shape branch steps)
        self.failed = set()  # structures (`_Layout.key`) whose blocks run the eager steps

    def _compiled(self, key):
        """The compiled step functions of the blocks of structure `key` (`_Layout.key`): each
        structure gets copies with code objects of their own (`isolated`), so Dynamo's recompile
        limit counts the signatures of one structure (one model's blocks), not of every model of
        the process (the ninth width of a sweep compiled nothing with shared code)."""
        compiled = self._by_structure.get(key)
        if compiled is None:
            branch = {**self.options, "dynamic": self.branch_dynamic}
            functions = {name: torch.compile(isolated(fn), fullgraph=True, **_with_guard_filter(
                branch if name.startswith("branch") else self.options)) for name, fn in _STEPS.items()}
            # The branch steps of blocks whose random layers all take symbolic sizes (`_any_shape`),
            # with the block steps' dynamic shapes
            any_shape = {name: torch.compile(isolated(_STEPS[name]), fullgraph=True,
                                             **_with_guard_filter(self.options))
                         for name in ("branch_forward", "branch_backward")}
            compiled = self._by_structure[key] = (functions, any_shape)
        return compiled

    def fell_back(self, block):
        """Whether `block` runs the eager steps after a step of its structure failed (`StepFailed`)."""
        return _layout(block).key in self.failed

    def call(self, name, block, position, *args):
        """``step(*args)`` compiled for `block` (blocks[`position`] of its run); raises
        `StepFailed` where it does not compile."""
        hooks_enabled = torch._C._autograd._saved_tensors_hooks_is_enabled()
        functions, any_shape = self._compiled(_layout(block).key)
        try:
            if name in any_shape and _any_shape(block):
                step = any_shape[name]
            else:
                step = functions[name]
                if name in any_shape:  # a static branch step (see `_unmarked`)
                    args = [_unmarked(a) for a in args]
            classes = cached(block, "shared_classes", _shared_classes)
            if not classes:
                return run_step(step, args)
            with _under_shared_classes(classes):
                return run_step(step, args)
        except NoEntryUnderUnsafeStance:
            raise RuntimeError(
                f"revkernels: the {name} step of blocks[{position}] ({type(block).__name__}) has no compiled graph "
                "whose differentiating guards (tensor shapes, dtypes, ...) pass, and under "
                "torch.compiler.set_stance(skip_guard_eval_unsafe=True) it compiles no new one (as Dynamo compiles "
                "nothing more under that stance): run a step with these inputs outside that stance first") from None
        except Exception as error:  # noqa: BLE001  (any compile error: the block runs the eager steps)
            if hooks_enabled and not torch._C._autograd._saved_tensors_hooks_is_enabled():
                # A failed compile of torch.func.vjp over saved-tensor hooks (torch.utils.checkpoint
                # in F or G) leaves them disabled for the whole process (torch 2.13)
                torch._C._autograd._saved_tensors_hooks_enable()
            if isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit):
                what = (f"the {name} step reached torch._dynamo.config.recompile_limit "
                        f"({torch._dynamo.config.recompile_limit} signatures) at blocks[{position}] "
                        f"({type(block).__name__}; blocks differing in a Python attribute, such as a dropout "
                        "probability, or new shapes are signatures of their own: raise the limit before the first "
                        "step to compile them; blocks that fell back run eagerly for the rest of the process)")
            else:
                what = f"compiling the {name} step of blocks[{position}] ({type(block).__name__}) failed"
            raise StepFailed(self.failed, _layout(block).key, what, error) from error


# `run_step` does what Dynamo's frame hook does on a cache hit, without the hook's set-up and
# tear-down (a host-bound run makes two step calls per block); docs/compile.md, "Guards and the step
# call", says when it defers to the hook. Like the hook, it runs a cached entry whatever
# ``torch._dynamo.config.disable`` says (Dynamo reads that flag only when it would compile).
_eval_frame = torch._C._dynamo.eval_frame
_DIRECT = [None]  # whether this torch has what `run_step` uses (looked up at its first call: importing
#                   revkernels imports no Dynamo); cleared if its cache entries turn out to differ
GUARDS_EVENT = "revkernels step guards"  # profiler event of `run_step`'s guard check


def run_step(step, args):
    """``step(*args)``, `step` a torch.compile'd step function and `args` all its arguments."""
    fn = getattr(step, "_torchdynamo_orig_callable", None) if _direct_calls() else None
    code = getattr(fn, "__code__", None)
    if code is None or len(args) != code.co_argcount or _eval_frame.get_eval_frame_callback() is not None:
        return step(*args)
    stance = torch._dynamo.eval_frame._stance
    if stance.stance != "default":
        return step(*args)
    frame_locals = dict(zip(code.co_varnames, args))
    if torch.autograd.profiler._is_profiler_enabled:  # (host profiles count it as Dynamo's entry)
        with torch.profiler.record_function(GUARDS_EVENT):
            entry = _passing_entry(code, frame_locals, stance.skip_guard_eval_unsafe)
    else:
        entry = _passing_entry(code, frame_locals, stance.skip_guard_eval_unsafe)
    if entry is None:
        if stance.skip_guard_eval_unsafe and _eval_frame._debug_get_cache_entry_list(code):
            raise NoEntryUnderUnsafeStance()  # (Dynamo's hook would raise a RuntimeError saying so)
        return step(*args)
    # as the hook's entry does: CUDA graph trees count iterations by these generations
    torch._dynamo.mutation_guard.install_generation_tagging_init()
    return types.FunctionType(entry.code, fn.__globals__)(*args)


class NoEntryUnderUnsafeStance(Exception):
    """`run_step` under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: the step has
    compiled graphs, none of them for these arguments, and the stance forbids compiling another."""


def _direct_calls():
    if _DIRECT[0] is None:
        _DIRECT[0] = (all(hasattr(_eval_frame, name) for name in ("_debug_get_cache_entry_list",
                                                                  "get_eval_frame_callback"))
                      and hasattr(torch._dynamo.eval_frame, "_stance")
                      and hasattr(torch._dynamo.mutation_guard, "install_generation_tagging_init"))
    return _DIRECT[0]


def _passing_entry(code, frame_locals, differentiating_only=False):
    """The first cache entry of `code` whose guards (with `differentiating_only`, its differentiating
    guards where Dynamo made them) pass on `frame_locals`, or None."""
    try:
        return next((e for e in _eval_frame._debug_get_cache_entry_list(code)
                     if entry_guards(e.guard_manager, differentiating_only).check(frame_locals)), None)
    except (AttributeError, TypeError):  # another torch's cache entries: Dynamo's hook from now on
        _DIRECT[0] = False
        return None


def entry_guards(manager, differentiating_only):
    """A cache entry's guard manager (``entry.guard_manager``), or with `differentiating_only` the
    manager of its differentiating guards (``diff_guard_root``) where Dynamo made one."""
    diff = getattr(manager, "diff_guard_root", None) if differentiating_only else None
    return manager if diff is None else diff


def _unmarked(t):
    """`t`, or where it is an output of a step compiled with dynamic shapes, a detached alias
    without the dynamic-size marks Dynamo leaves on such outputs (``_dynamo_propagated_dynamic_indices``;
    ``_dynamo_weak_dynamic_indices`` in torch 2.11): a static branch step given the marked tensor
    traced it with symbolic sizes despite ``dynamic=False``, and F.dropout then failed under
    ``torch.func.vjp`` (a dropout block backed by a deterministic block fell back to the eager steps
    at its second batch size)."""
    marked = hasattr(t, "_dynamo_propagated_dynamic_indices") or hasattr(t, "_dynamo_weak_dynamic_indices")
    return t.detach() if marked and isinstance(t, torch.Tensor) else t


def _any_shape(block):
    """Whether every layer of `block` that may draw random numbers draws through ops that take
    symbolic sizes (``draws_with_symbolic_sizes``: revkernels' `DropPath` and `ResidualDropout`),
    so its branch steps can compile with dynamic shapes. ``nn.Dropout`` cannot: F.dropout under
    ``torch.func.vjp`` calls numel() on a symbolic-size tensor."""
    return cached(block, "any_shape", lambda b: all(getattr(m, "draws_with_symbolic_sizes", False)
                                                    for m in stochastic_modules(b)))


def _with_guard_filter(options):
    """torch.compile keywords with `keeps_guard` as Dynamo's ``guard_filter_fn`` unless the
    options name one (torch.compile pops it from the dict it gets: each call gets its own)."""
    inner = dict(options.get("options") or {})
    inner.setdefault("guard_filter_fn", keeps_guard_list)
    return {**options, "options": inner}


# Dynamo guards on everything a compiled step read (452 guard entries for a ViT block's backward
# step, torch 2.13); `keeps_guard` leaves out the two kinds docs/compile.md names ("Guards and the
# step call"): module hook dicts, and library code (torch, revkernels, the standard library, the
# builtins, this module's globals). Library values that are not code stay guarded.
_CODE_ATTRIBUTES = ("__defaults__", "__kwdefaults__", "__closure__", "cell_contents", "_LEAF_SPEC")


def keeps_guard(entry):
    """Whether the compiled steps keep a Dynamo guard (a ``torch._dynamo.types.GuardFilterEntry``)."""
    if entry.guard_type == "EMPTY_NN_MODULE_HOOKS_DICT":
        return False
    if getattr(entry, "is_global", False):
        root = entry.name.split("]", 1)[0] + "]"  # G['name'] (the step's globals) or G['__import_<module>']
        if root in _own_globals() or root.startswith("G['__builtins_dict"):
            return False
        if not _library_root(root):
            return True
    elif "__import__('torch')" not in entry.name:  # (torch reached from a local: pytree's registry)
        return True
    return entry.guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH") and not any(
        attribute in entry.name for attribute in _CODE_ATTRIBUTES)


def _library_root(root):
    """Whether a global guard's root (G['__import_torch_dot_nn'], G['torch']) is a module of torch,
    of revkernels or of the standard library (by where it was loaded from: a user's ``test.py`` is not)."""
    name = root[3:-2]
    name = name[len("__import_"):] if name.startswith("__import_") else name
    top = name.split("_dot_", 1)[0]
    if top in ("torch", "revkernels"):
        return True
    origin = getattr(getattr(sys.modules.get(top), "__spec__", None), "origin", None) or ""
    return top in sys.stdlib_module_names and (origin in ("built-in", "frozen")
                                               or origin.startswith(sysconfig.get_paths()["stdlib"]))


def keeps_guard_list(entries):
    """Dynamo's ``guard_filter_fn``: `keeps_guard` of each entry."""
    return [keeps_guard(entry) for entry in entries]


@functools.cache
def _own_globals():
    return frozenset(f"G['{name}']" for name in globals() if not name.startswith("__"))


class StepFailed(Exception):
    """A pure step of `block` failed (its compile, or eagerly: ``torch.func.vjp`` takes no
    saved-tensor hooks, such as torch.utils.checkpoint's, nor an autograd.Function without
    ``setup_context``, such as a nested reversible run's). The walkers run the block's eager autograd steps instead (an error of the
    block itself raises from them) and then call `fall_back`: the block's structure (`key`) is
    added to `failed`, so that it and every block of the same structure (module types, parameter
    shapes and dtypes), whose steps would fail alike, run the eager steps from then on without
    trying again, and a warning names the block, once."""

    def __init__(self, failed, key, what, error):
        first_line = (str(error).splitlines() or [""])[0]
        super().__init__(f"revkernels: {what}; that block and the blocks of its structure run the sequential "
                         f"engine's eager steps ({type(error).__name__}: {first_line})")
        self.failed, self.key = failed, key

    def fall_back(self):
        self.failed.add(self.key)
        warnings.warn(str(self), UserWarning, stacklevel=4)


_EAGER_FAILED = set()  # structures whose pure steps failed eagerly (no CompiledSteps)


def _failed(steps):
    """The structures (`_Layout.key`) whose blocks run the eager autograd steps after a pure step
    of such a block failed."""
    return _EAGER_FAILED if steps is None else steps.failed


# ---- parametrized modules ----
# torch.nn.utils.parametrize gives each parametrized module a class of its own (a subclass of the
# module's class with a property per parametrized tensor), and Dynamo guards on a module's class:
# a stack of identical weight_norm blocks compiled once per block, and past the recompile limit its
# blocks ran eagerly. The steps run such a module under a class shared by every module of the same
# class with the same parametrized tensors, swapped in for the call only.

_SHARED_CLASSES = {}  # (class, parametrized tensor names) -> the shared parametrized class


def _parametrized_names(cls):
    """The tensor names of a class torch.nn.utils.parametrize made (one base, parametrize's members
    only; a deep copy adds copyreg's ``__slotnames__``), sorted; None for any other class."""
    if cls.__module__ != parametrize.__name__ or len(cls.__bases__) != 1:
        return None
    names = []
    for key, value in vars(cls).items():
        if isinstance(value, property) and getattr(value.fget, "__module__", None) == parametrize.__name__:
            names.append(key)
        elif key not in ("__module__", "__doc__", "__getstate__", "__deepcopy__", "__slotnames__"):
            return None
    return tuple(sorted(names))


def _computed_tensor(name):
    """A property computing ``self.parametrizations[name]()`` on every access, as parametrize's do
    outside ``parametrize.cached()`` (whose cached tensor would not be a function of the step's
    inputs, the parameters swapped in by ``functional_call``), and assigning through
    ``right_inverse`` as parametrize's do."""
    def get(self):
        return self.parametrizations[name]()

    def set_original(self, value):
        self.parametrizations[name].right_inverse(value)

    return property(get, set_original)


def _shared_classes(block):
    """``[(module, shared class, own class)]`` for the parametrized modules under `block` (cached
    per structure)."""
    classes = []
    for module in block.modules():
        own = type(module)
        names = _parametrized_names(own)
        if not names or tuple(sorted(module.parametrizations.keys())) != names:
            continue
        key = (own.__bases__[0], names)
        shared = _SHARED_CLASSES.get(key)
        if shared is None:
            shared = type(own.__name__, key[:1], {"__module__": __name__, **{n: _computed_tensor(n) for n in names}})
            _SHARED_CLASSES[key] = shared
        classes.append((module, shared, own))
    return classes


@contextlib.contextmanager
def _under_shared_classes(classes):
    try:
        for module, shared, _ in classes:
            object.__setattr__(module, "__class__", shared)
        yield
    finally:
        for module, _, own in classes:
            object.__setattr__(module, "__class__", own)


# ---- per-block layout ----

class _Layout:
    """What the steps need from a block's structure (cached per structure)."""

    __slots__ = ("kind", "slots", "params", "f_slots", "g_slots", "key", "_grad_plans")

    def __init__(self, block):
        self.kind = coupling_kind(block)
        # what a compile of the steps depends on, short of attributes: the module types, the
        # parameters' shapes and dtypes (the failures of `StepFailed` are grouped by it)
        self.key = tuple((_compiled_class(m), tuple((name, tuple(p.shape), p.dtype) for name, p in m._parameters.items()
                                                   if p is not None)) for m in block.modules())
        self.slots = slots = param_slots(block)
        self.params = slots.params
        index = {id(p): i for i, p in enumerate(slots.params)}
        branches = [block.f] + ([block.g] if self.kind == "full" else [])
        slot_lists = [[(name, index[id(p)]) for name, p in m.named_parameters(remove_duplicate=False)]
                      for m in branches]
        self.f_slots = slot_lists[0]
        self.g_slots = slot_lists[1] if self.kind == "full" else []
        self._grad_plans = {}

    def grad_plan(self):
        """``(f_names, g_names, grad_params)`` for the parameters that require grad now: the slot
        names each branch's step differentiates and the parameters their grads belong to (f's,
        then g's), built once per requires_grad pattern."""
        pattern = tuple(p.requires_grad for p in self.params)
        plan = self._grad_plans.get(pattern)
        if plan is None:
            f_names, f_index = _grad_slots(self, self.f_slots)
            g_names, g_index = _grad_slots(self, self.g_slots)
            plan = (f_names, g_names, [self.params[i] for i in f_index + g_index])
            self._grad_plans[pattern] = plan
        return plan


def _compiled_class(module):
    """The class the steps trace `module` as: for a parametrized module, its base class and
    parametrized names (the shared class of `_shared_classes`), not the class parametrize made for
    it alone."""
    names = _parametrized_names(type(module))
    return (type(module).__bases__[0], names) if names else type(module)


def _layout(block):
    layout = cached(block, "compiled_layout", _Layout)
    if layout.slots.stale():  # parameters replaced by a conversion (structure.ParamSlots.stale)
        invalidate()
        layout = cached(block, "compiled_layout", _Layout)
    return layout


def _grad_slots(layout, slots):
    """(names, indices into layout.params) of the slots whose parameter requires grad."""
    names, indices = [], []
    for name, i in slots:
        if layout.params[i].requires_grad:
            names.append(name)
            indices.append(i)
    return tuple(names), indices


# ---- the walkers ----

def forward_blocks(blocks, x1, x2, steps, preserve_rng_state=True, context=NO_CONTEXT):
    """Runs `blocks` forward without autograd through the pure steps (`PureSteps`); returns
    ``(y1, y2, states)`` with each block's `BlockState` (None: nothing to replay). `steps`: a
    `CompiledSteps`, or None for eager pure steps. `context`: the keywords of every F and G."""
    # requires_grad of the run's inputs must not split signatures; a context tensor's does (one
    # that requires grad is differentiated, and a block that takes none, such as an attention
    # mask, must see it: its eager forward raises, as with the other engines)
    x1, x2 = x1.detach(), x2.detach()
    if torch.is_inference_mode_enabled():
        # Dynamo guards on a tensor's dispatch keys, and under inference mode every block after the
        # first gets an inference tensor: the first gets one too, or it is a signature of its own
        x1, x2 = _inference_tensor(x1), _inference_tensor(x2)
        context = {k: _inference_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in context.items()}
    failed = _failed(steps)
    pure = [PureSteps(block, i, steps, failed) for i, block in enumerate(blocks)]
    y1, y2, states, _ = walk_forward(blocks, x1, x2, preserve_rng_state, context, pure)
    return y1, y2, states


class PureSteps:
    """A block's ``forward_with_state`` through the pure steps (what `forward_step` runs for it),
    or through the block's own where the pure steps do not take it (`_eager_block`, a structure
    whose steps failed, `_eager_call`) or fail now (`StepFailed`: the block draws from the state
    before the failed step, as eager does, and its recompute replays these)."""

    __slots__ = ("block", "position", "steps", "failed")

    def __init__(self, block, position, steps, failed):
        self.block, self.position, self.steps, self.failed = block, position, steps, failed

    def forward_with_state(self, x1, x2, preserve_rng_state=True, context=NO_CONTEXT):
        block, position, steps, failed = self.block, self.position, self.steps, self.failed
        layout = _layout(block)
        # (a structure key is a deep tuple, hashed at each lookup: none while nothing failed)
        if not (_eager_block(block, layout) or (failed and layout.key in failed) or _eager_call()):
            try:
                if preserve_rng_state and block.draws_random():
                    return _random_forward(block, position, layout, x1, x2, steps, context)
                y1, y2 = _step(steps, "block_forward", block, position, block, layout.kind, x1, x2, context)
                return y1, y2, None
            except StepFailed as failure:
                out = block.forward_with_state(x1, x2, preserve_rng_state, context=context)
                failure.fall_back()
                return out
        return block.forward_with_state(x1, x2, preserve_rng_state, context=context)


def _eager_block(block, layout):
    """Whether `block` runs the sequential engine's eager steps (``forward_with_state``,
    ``recompute``, ``grads``) instead of the pure ones: a subclass with a forward of its own, or a
    block with module hooks below it (they fire in the forward and the recompute as with the
    sequential engine; a full backward hook cannot run under ``torch.func.vjp``)."""
    return layout.kind is None or submodule_hooked(block, backward=True)


def _eager_call():
    """Whether this call runs the eager steps for every block, leaving the structure's compiled steps
    for later calls (none is marked failed): under anomaly detection, or under a Python dispatch mode
    (a FLOP counter, a memory tracker: TorchDispatchMode), which Dynamo does not trace (its frames are
    skipped and a fullgraph step finds no compiled frame)."""
    return torch.is_anomaly_enabled() or torch._C._len_torch_dispatch_stack() > 0


def _inference_tensor(t):
    """`t`, or a copy of it made under inference mode (an inference tensor)."""
    return t if t.is_inference() else t.clone()


def _detached(context):
    return {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in context.items()} if context else NO_CONTEXT


def _random_forward(block, position, layout, x1, x2, steps, context):
    devices = cuda_devices_of(x1, x2)
    rng_f = RngState(devices)
    y = _step(steps, "branch_forward", block, position, block.f, "f", x1, x2, context)
    if layout.kind == "half":
        return x2, y, BlockState(rng_f, None)
    rng_g = RngState(devices)
    try:
        y2 = _step(steps, "branch_forward", block, position, block.g, "g", x2, y, context)
    except StepFailed:
        # The eager steps that run the block instead draw F's numbers again: from the same state,
        # so the block's numbers and the stream after it are eager's
        rng_f.restore()
        raise
    return y, y2, BlockState(rng_f, rng_g)


def _unexpanded(t):
    return t.contiguous() if 0 in t.stride() else t


def _unexpanded_or_none(t):
    return None if t is None else _unexpanded(t.detach())


def _step(steps, name, block, position, *args):
    if steps is not None:
        return steps.call(name, block, position, *args)
    try:
        return _STEPS[name](*args)
    except Exception as error:  # noqa: BLE001  (the eager autograd steps run instead, see StepFailed)
        raise StepFailed(_EAGER_FAILED, _layout(block).key, f"the pure {name} step of blocks[{position}] "
                         f"({type(block).__name__}) failed", error) from error


def kept_forward(seq, position, x1, x2, context=NO_CONTEXT):
    """(y1, y2) of blocks[`position`] of `seq` (the compiled engine's run) under autograd, as a
    memory budget keeps it: its compiled forward step differentiated by autograd (the compiled
    training graph saves what its backward needs), or the block itself where that does not apply:
    a block that draws random numbers (its compiled graph may draw them in another order than
    eager), one with hooks of its own (they fire, as they do for the other kept blocks), one the
    compiled steps run eagerly, FSDP-sharded blocks, a debugging mode."""
    block = seq.blocks[position]
    layout = _layout(block)
    steps = compiled_steps(seq, x1.device.type)
    own_hooks = block._forward_hooks or block._forward_pre_hooks or block._backward_hooks or block._backward_pre_hooks
    if not (_eager_block(block, layout) or own_hooks or layout.key in steps.failed or _eager_call()
            or block.draws_random() or block_units(seq) is not None):
        try:
            return steps.call("block_forward", block, position, block, layout.kind, x1, x2, context)
        except StepFailed as failure:
            failure.fall_back()
    return block(x1, x2, **context)


def backward_blocks(blocks, states, y1, y2, dy1, dy2, params, steps, autocast_state=None, context=NO_CONTEXT):
    """`revkernels.engine.sequential.reverse_blocks` with the pure steps (`PureBackward`): returns
    ``(x1, x2, dx1, dx2, param_grads)`` with `param_grads` aligned to `params` (None for a
    parameter no block used). `context`: the keywords of every F and G; its tensors that require
    grad must be in `params` to get grads."""
    autocast_state = autocast_state or AutocastState.capture(y1.device.type)
    # A loss like y.sum() hands down expanded (stride-0) grads, which would be a signature of their own
    y1, y2, dy1, dy2 = y1.detach(), y2.detach(), _unexpanded(dy1.detach()), _unexpanded_or_none(dy2)
    return reverse_blocks(blocks, states, y1, y2, dy1, dy2, params, autocast_state, context=context,
                          step=PureBackward(steps, context))


class PureBackward:
    """`reverse_blocks`' step through the pure steps (`CompiledSteps`, or eager ones for None), or
    the blocks' own (`eager_backward`) where the pure steps do not take the block, or fail."""

    __slots__ = ("steps", "failed", "leaves", "grad_context", "plain_context")

    def __init__(self, steps, context):
        self.steps, self.failed = steps, _failed(steps)
        # The steps take detached tensors; which context tensors they differentiate is the dict they are in.
        self.leaves = {k: context[k] for k in grad_names(context)}
        self.grad_context = {k: v.detach() for k, v in self.leaves.items()}
        self.plain_context = _detached({k: v for k, v in context.items() if k not in self.leaves})

    def __call__(self, position, block, state, y1, y2, dy1, dy2, autocast, context):
        layout = _layout(block)
        # A block whose forward changed buffers: its recompute puts their old values in
        # (recompute_step), which the pure steps cannot take (torch.func.vjp rejects a change in
        # place of a tensor it did not get as an input)
        # A grad the loss did not give (None; see sequential.block_grads): the eager steps, for
        # the run's last block only (a None would be a signature of its own)
        # (a structure key is a deep tuple, hashed at each lookup: none while nothing failed)
        if (_eager_block(block, layout) or getattr(state, "buffers", ()) or (self.failed and layout.key in self.failed)
                or dy1 is None or dy2 is None or _eager_call()):
            return self._eager(block, position, state, y1, y2, dy1, dy2, autocast, context)
        steps, plain_context, grad_context = self.steps, self.plain_context, self.grad_context
        f_names, g_names, grad_params = layout.grad_plan()
        try:
            with autocast(), recompute_context(block):
                if state is None:
                    x1, x2, dx1, dx2, f_grads, g_grads, context_grads = _step(
                        steps, "block_backward", block, position, block, layout.kind, f_names, g_names,
                        y1, y2, dy1, dy2, plain_context, grad_context)
                elif layout.kind == "half":
                    with maybe_replay(state.rng_f):
                        x1, dx2, f_grads, context_grads = _step(
                            steps, "branch_backward", block, position, block.f, f_names, y1, y2, dy1, dy2,
                            plain_context, grad_context)
                    x2, dx1, g_grads = y1, dy2, ()
                else:
                    with maybe_replay(state.rng_g):
                        x2, dx1, g_grads, g_context = _step(
                            steps, "branch_backward", block, position, block.g, g_names, y1, y2, dy1, dy2,
                            plain_context, grad_context)
                    with maybe_replay(state.rng_f):
                        x1, dx2, f_grads, f_context = _step(
                            steps, "branch_backward", block, position, block.f, f_names, x2, y1, dy2, dx1,
                            plain_context, grad_context)
                    context_grads = {k: f_context[k] + g_context[k] for k in grad_context}
        except StepFailed as failure:
            out = self._eager(block, position, state, y1, y2, dy1, dy2, autocast, context)
            failure.fall_back()
            return out
        grads = list(zip(grad_params, (*f_grads, *g_grads)))
        grads += [(self.leaves[k], grad) for k, grad in context_grads.items()]
        return x1, x2, dx1, dx2, grads

    @staticmethod
    def _eager(block, position, state, y1, y2, dy1, dy2, autocast, context):
        # autograd_recording: inside the opaque op's backward kernel (torch.compile) too
        with autograd_recording(), torch.enable_grad():
            x1, x2, dx1, dx2, grads = eager_backward(position, block, state, y1, y2, dy1, dy2, autocast, context)
            return x1.detach(), x2, dx1, dx2, list(grads)


# ---- the engine ----

def _option_key(value):
    # A function is keyed by its code and closure, not its repr (which holds its address): a backend
    # written as a lambda in the caller's code is the same backend at every call.
    if isinstance(value, types.FunctionType):
        cells = tuple(id(c.cell_contents) for c in value.__closure__ or ())
        return ("function", value.__code__, cells, value.__defaults__)
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _option_key(v)) for k, v in value.items())))
    return ("repr", repr(value))


def compiled_steps(seq, device_type):
    """The `CompiledSteps` for ``seq.compile_options`` (a dict of torch.compile keywords; unset:
    inductor's defaults) on `device_type`'s tensors, shared by every run with the same options
    (the `MAX_OPTION_SETS` most recently used sets are kept)."""
    options = getattr(seq, "compile_options", None) or {}
    if not isinstance(options, dict):
        raise TypeError(f"revkernels: compile_options must be a dict, got {type(options).__name__}")
    key = (device_type, _option_key(options))
    steps = _SHARED.get(key)
    if steps is None:
        steps = _SHARED[key] = CompiledSteps(options, device_type)
    return steps


MAX_OPTION_SETS = 16
_SHARED = LRU(MAX_OPTION_SETS)
_EXACT_WARNED = weakref.WeakSet()  # runs told once that exact mode runs eagerly


def run_compiled(seq, x1, x2, context=NO_CONTEXT):
    if seq.exact:
        # A compiled rebuild must compute F's and G's bits as the compiled forward did; until the
        # steps are compiled so, exact mode runs them eagerly (exact, at the sequential engine's speed)
        if seq not in _EXACT_WARNED:
            _EXACT_WARNED.add(seq)
            warnings.warn("revkernels: the compiled engine runs exact mode's steps eagerly (the sequential "
                          "engine's schedule): its compiled steps do not keep the streams in fixed point yet",
                          UserWarning, stacklevel=3)
        return run_reversible(seq, x1, x2, reverse_blocks, context)
    steps = compiled_steps(seq, x1.device.type)

    def walker(blocks, states, y1, y2, dy1, dy2, params, autocast_state, monitor=None, context=NO_CONTEXT):
        return backward_blocks(blocks, states, y1, y2, dy1, dy2, params, steps, autocast_state, context)

    units = block_units(seq)
    if units is not None:  # blocks sharded by FSDP2 one by one: one autograd node per block

        def block_step(block, a1, a2, preserve_rng_state, block_context, exact_steps):
            # (`exact_steps` is None: exact mode ran the eager engine above)
            b1, b2, states = forward_blocks([block], a1, a2, steps, preserve_rng_state, block_context)
            return b1, b2, states[0]

        return run_sharded(seq, x1, x2, units, walker, block_step, context)
    params = unique_grad_params(seq.blocks)
    if not records_graph(x1, x2, params, grad_tensors(context)):
        y1, y2, _ = forward_blocks(list(seq.blocks), x1, x2, steps, False, context)
        return y1, y2

    def forward(seq, x1, x2, context):
        y1, y2, states = forward_blocks(list(seq.blocks), x1, x2, steps, seq.preserve_rng_state, context)
        return y1, y2, states, None

    return run_reversible(seq, x1, x2, walker, context, forward=forward)
