"""Non-reversible pieces between reversible runs (stems, downsampling blocks): keep only their
input and recompute them in the backward.

Like `torch.utils.checkpoint`, but with the engines' invariants: the parameters are inputs of the
autograd Function (grads reach `.grad` once, through the normal accumulation, and parameter hooks
fire once), randomness is replayed from the forward's generator state, the forward's autocast mode
is re-entered, and BatchNorm running statistics are not updated a second time by the recompute.
Under torch.compile (which cannot trace this Function's backward) it is torch.utils.checkpoint,
which the compiler handles.
"""
import functools

import torch
import torch.utils.checkpoint
from torch.func import functional_call

from revkernels.engine.fsdp import enter, module_units
from revkernels.engine.state import (AutocastState, RngState, check_param_versions, cuda_devices_of, differentiated_once,
                                     in_mode, maybe_replay, module_modes, param_versions)
from revkernels.engine.structure import module_input, recompute_context


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, module, names, n_inputs, *tensors):
        inputs = tensors[:n_inputs]
        # The parameters as the forward used them (a torch.func.functional_call's, which are back
        # out of the module by the backward) and the module's mode then
        ctx.module, ctx.names, ctx.n_inputs = module, names, n_inputs
        ctx.params, ctx.modes = tensors[n_inputs:], module_modes(module)
        ctx.param_versions = param_versions(ctx.params)
        ctx.rng = RngState(cuda_devices_of(*inputs))
        ctx.autocast_state = AutocastState.capture(inputs[0].device.type)
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            out = module(*inputs)
        ctx.tuple_output = isinstance(out, tuple)
        return out if ctx.tuple_output else (out,)

    @staticmethod
    @differentiated_once
    def backward(ctx, *grads):
        check_param_versions(ctx.params, ctx.param_versions, ctx.module)
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        aliases = {name: p.detach().requires_grad_() for name, p in zip(ctx.names, ctx.params)}
        with torch.enable_grad(), in_mode(ctx.module, ctx.modes), recompute_context(ctx.module), \
                maybe_replay(ctx.rng), ctx.autocast_state.enter():
            out = functional_call(ctx.module, aliases, tuple(module_input(t) if t.requires_grad else t for t in inputs))
        outs = out if isinstance(out, tuple) else (out,)
        wrt = [t for t in inputs if t.requires_grad] + list(aliases.values())
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        computed = torch.autograd.grad([o for o, _ in pairs], wrt, [g.to(o.dtype) for o, g in pairs], allow_unused=True)
        computed = iter(computed)
        input_grads = [next(computed) if t.requires_grad else None for t in inputs]
        return (None, None, None, *input_grads, *computed)


def run_recomputed(module, *inputs):
    """`module(*inputs)` keeping only `inputs` for the backward, which recomputes the module.
    Returns what the module returns (a tensor or a tuple of tensors). A module that holds FSDP2
    units runs as their forward (`revkernels.engine.fsdp.enter`): FSDP all-gathers the parameters
    for the forward and for the recompute and reduce-scatters their grads, as for any module."""
    units = () if torch.compiler.is_compiling() else module_units(module)
    if units:
        return enter(units, functools.partial(_run_recomputed, module), *inputs)
    return _run_recomputed(module, *inputs)


def _run_recomputed(module, *inputs):
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    params = dict(module.named_parameters())
    needs_grad = any(t.requires_grad for t in inputs) or names
    if not torch.is_grad_enabled() or not needs_grad:
        return module(*inputs)
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(module, *inputs, use_reentrant=False)
    out = _Recomputed.apply(module, names, len(inputs), *inputs, *(params[n] for n in names))
    return out if len(out) > 1 else out[0]
