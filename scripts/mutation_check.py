#!/usr/bin/env python
"""Mutation check: does the test suite catch the bugs it claims to guard against?

Each mutation below is one semantic bug, written as an exact text replacement ``(file, old, new)`` in
the library, with the test selection that should catch it. The script copies the repository (with
the built ``revkernels/_C*.so``) to a temporary directory, checks that every ``old`` text occurs
exactly once (else it stops with "pattern not found" / "pattern occurs N times": the library changed,
update the table), runs the selections once unmutated (a selection that fails there cannot kill
anything), then for each mutation: applies it to the copy, rebuilds the C++ extension in the copy
when the file is under csrc/ (``setup.py build_ext --inplace``), runs the selection with a timeout
and restores the file (and the original .so). A mutant is *killed* when its selection fails (the
first failing test is reported), *survived* when it passes: each survivor is a missing test.

    python scripts/mutation_check.py                        # every mutation
    python scripts/mutation_check.py --only revvit_ln_swap_grads petra_accum_count
    python scripts/mutation_check.py --list
    python scripts/mutation_check.py --out /tmp/mutation_check.txt

Run on demand (minutes: one pytest process per mutant), not in CI. Mutations marked ``cuda`` need a
GPU (they change code that only runs on CUDA) and are reported as "not run" without one.

The library is being rewritten in places; when a pattern is not found, edit its row: keep each row
one bug, the smallest text that makes it, and a selection of the tests that should catch it.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, file, old text, new text, pytest selection (arguments), options ("cuda": needs a GPU)
M = []


def mutation(name, file, old, new, tests, needs=None):
    M.append({"name": name, "file": file, "old": old, "new": new, "tests": tests.split(), "needs": needs})


REVVIT = "revkernels/nn/revvit.py"
REV = "revkernels/nn/reversible.py"
SEQ = "revkernels/engine/sequential.py"
STATE = "revkernels/engine/state.py"
STRUCTURE = "revkernels/engine/structure.py"
PARE = "revkernels/engine/pareprop.py"
SIM = "revkernels/petra/simulate.py"
PART = "revkernels/petra/partition.py"
DIST = "revkernels/petra/distributed.py"
BNACT = "revkernels/nn/batch_norm.py"
T_REVVIT = "tests/nn/test_revvit.py"
T_SEQ = "tests/engine/test_sequential.py"
T_REF = "tests/petra/test_reference.py"
T_SIM = "tests/petra/test_simulate.py"

# --- fused RevViTBlock: F/G parameters, drop-path ----------------------------------------------------
mutation("revvit_ln2_recompute_uses_F_params", REVVIT,
         'torch.native_layer_norm(y1, [dim], P["g.norm.weight"], P["g.norm.bias"], m.g_norm.eps)',
         'torch.native_layer_norm(y1, [dim], P["f.norm.weight"], P["f.norm.bias"], m.g_norm.eps)', T_REVVIT)
mutation("revvit_ln1_rebuild_uses_G_params", REVVIT,
         'sub_layer_norm(y2, g_out, P["f.norm.weight"], P["f.norm.bias"], m.f_norm.eps)',
         'sub_layer_norm(y2, g_out, P["g.norm.weight"], P["g.norm.bias"], m.f_norm.eps)', T_REVVIT)
mutation("revvit_ln2_bwd_uses_F_weight", REVVIT,
         'dln2, rec.y1, P["g.norm.weight"],', 'dln2, rec.y1, P["f.norm.weight"],', T_REVVIT)
mutation("revvit_ln1_bwd_uses_G_weight", REVVIT,
         'dln1, rec.x2_rows, P["f.norm.weight"],', 'dln1, rec.x2_rows, P["g.norm.weight"],', T_REVVIT)
mutation("revvit_swap_F_G_norm_grads", REVVIT,
         "            dln1, rec.x2_rows, P[\"f.norm.weight\"], rec.mean1, rec.rstd1, dy2)\n        return dx2\n",
         "            dln1, rec.x2_rows, P[\"f.norm.weight\"], rec.mean1, rec.rstd1, dy2)\n"
         "        named[\"f.norm.weight\"], named[\"g.norm.weight\"] = named[\"g.norm.weight\"], named[\"f.norm.weight\"]\n"
         "        return dx2\n",
         T_REVVIT)
mutation("revvit_swap_norm_weight_bias_grads", REVVIT,
         'dx2, named["f.norm.weight"], named["f.norm.bias"] = layer_norm_bwd_add(',
         'dx2, named["f.norm.bias"], named["f.norm.weight"] = layer_norm_bwd_add(', T_REVVIT)
mutation("revvit_proj_grad_ignores_drop_path", REVVIT,
         "dproj = dy1_total if rec.f_scale is None else dy1_total * rec.f_scale", "dproj = dy1_total", T_REVVIT)
mutation("revvit_rebuild_ignores_drop_path", REVVIT,
         "    return (out * scale).view(-1, shape[-1]), keep,", "    return out.view(-1, shape[-1]), keep,", T_REVVIT)
mutation("revvit_no_rng_replay_for_G", REVVIT,
         "with maybe_replay(None if state is None else state.rng_g):\n                # The ops",
         "with maybe_replay(None):\n                # The ops", T_REVVIT)
mutation("revvit_skip_proj_bias_grad", REVVIT,
         'named["f.proj.bias"] = lambda: _to(dproj.sum(0, dtype=',
         'named["f.proj.bias"] = lambda: _to(0 * dproj.sum(0, dtype=',
         T_REVVIT)

# --- generic blocks and the sequential engine ----------------------------------------------------------
mutation("block_rebuild_wrong_sign", REV,
         "x2 = coupling_sub(y2.detach(), g_out.detach()).requires_grad_()",
         "x2 = coupling_add(y2.detach(), g_out.detach()).requires_grad_()",
         f"{T_SEQ} -k equal_plain")
mutation("block_grad_add_wrong_sign", REV,
         "dx2 = dy2 if dx2_from_f is None else dx2_from_f if dy2 is None else coupling_add(dy2, dx2_from_f)",
         "dx2 = dy2 if dx2_from_f is None else dx2_from_f if dy2 is None else coupling_sub(dy2, dx2_from_f)",
         f"{T_SEQ} -k equal_plain")
mutation("block_dy1_misses_G_term", REV,
         "dy1_total = dy1 if dy1_from_g is None else coupling_add(dy1, dy1_from_g)", "dy1_total = dy1",
         f"{T_SEQ} -k equal_plain")
mutation("block_no_rng_replay_for_F", REV,
         "with maybe_replay(None if state is None else state.rng_f):\n                f_out, f_aliases = _call_with_aliases(",
         "with maybe_replay(None):\n                f_out, f_aliases = _call_with_aliases(", f"{T_SEQ} -k dropout")
mutation("rng_state_not_restored_after_replay", STATE,
         "            saved.restore()\n", "            pass\n", f"{T_SEQ} -k dropout")
mutation("batchnorm_stats_updated_in_recompute", STRUCTURE,
         "        layer.track_running_stats = False\n", "", f"{T_SEQ} -k batchnorm")
mutation("batchnorm_act_stats_updated_in_recompute", BNACT,
         "if self.training and self.track_running_stats and self.running_mean is not None:",
         "if self.training and self.running_mean is not None:",
         "tests/models/test_revnet.py::test_one_training_step_matches_plain_autograd[revnet18]")
mutation("engine_no_autocast_reentry", SEQ,
         "    with autocast():\n        rec = recompute_step", "    with contextlib.nullcontext():\n        rec = recompute_step",
         f"{T_SEQ} -k autocast")
mutation("engine_skips_1d_param_grads", SEQ,
         "        if grad is None or k is None:\n            continue",
         "        if grad is None or k is None or p.dim() == 1:\n            continue",
         f"{T_SEQ} -k equal_plain")
mutation("engine_param_grads_counted_twice", SEQ,
         "param_grads[k] = grad if param_grads[k] is None else param_grads[k] + grad",
         "param_grads[k] = 2 * grad if param_grads[k] is None else param_grads[k] + grad", f"{T_SEQ} -k equal_plain")
mutation("engine_keeps_block_activations_on_ctx", SEQ,
         "        y1, y2, ctx.states, ctx.monitor = forward(seq, x1, x2, context)\n",
         "        y1, y2, ctx.states, ctx.monitor = forward(seq, x1, x2, context)\n"
         "        ctx.kept = [t.clone() for _ in seq.blocks for t in (x1, x2)]\n",
         "tests/engine/test_memory.py")
mutation("engine_saves_every_block_output", SEQ,
         "        save_with_context(ctx, context, y1, y2)\n",
         "        save_with_context(ctx, context, y1, y2, *[torch.zeros_like(y1) for _ in ctx.states])\n",
         "tests/engine/test_memory.py")
mutation("engine_no_rng_state_per_block", REV,
         "        rng_f = RngState(devices) if keep else None\n        fx2 = self.f(", "        rng_f = None\n        fx2 = self.f(",
         f"{T_SEQ} -k dropout")
mutation("pareprop_forgets_record_stream", PARE,
         "            _hand_over((x1, x2), other)\n", "", "tests/engine/test_pareprop.py", needs="cuda")

mutation("block_keeps_its_input", REV,
         "        rng_g = RngState(devices) if keep else None\n        gy1 = self.g(",
         "        rng_g = RngState(devices) if keep else None\n        self._kept = x1.clone()\n        gy1 = self.g(",
         "tests/engine/test_memory.py")

# --- half couplings (PETRA's reversible stages) ---------------------------------------------------------
mutation("half_coupling_rebuild_wrong_sign", REV,
         "x1 = coupling_sub(y2.detach(), f_out.detach())", "x1 = coupling_add(y2.detach(), f_out.detach())", T_REF)
mutation("half_coupling_dx2_misses_F_term", REV,
         "dx2 = dy1 if dx2_from_f is None else coupling_add(dy1, dx2_from_f)", "dx2 = dy1", T_REF)
mutation("half_coupling_bias_grads_off_by_1e-3", REV,
         "return BlockGrads(dx1=dy2, dx2=dx2, params=list(rec.f_aliases), param_grads=f_grads)",
         "return BlockGrads(dx1=dy2, dx2=dx2, params=list(rec.f_aliases),\n"
         "                          param_grads=[g if g is None or g.dim() > 1 else g * 1.001 for g in f_grads])",
         f"{T_SIM} -k one_batch")

# --- PETRA --------------------------------------------------------------------------------------------
mutation("petra_accum_count_off_by_one", SIM,
         "                    p.grad.div_(k)", "                    p.grad.div_(k + 1)", T_REF)
mutation("petra_accum_window_off_by_one", SIM,
         "if self.backward_steps % self.trainer.accum_k:", "if (self.backward_steps + 1) % self.trainer.accum_k:", T_REF)
mutation("petra_staleness_off_by_one", SIM,  # forward messages arrive in the tick they are sent
         "incoming = new_input if w == 0 else self._fwd_msgs.get(w - 1)",
         "incoming = new_input if w == 0 else fwd_msgs.get(w - 1)", T_REF)
mutation("petra_rebuild_with_forward_params", PART,
         "                                                                    [state], context)\n",
         "                                                                    [state], context)\n"
         "            x1, x2 = y[1].detach() - self.module.f(y[0]).detach() * 0.99, y[0].detach()\n", T_REF)
mutation("petra_stage_draws_fresh_masks", PART,
         "            state = self._next_replay()\n", "            state = self._next_replay() and None\n",
         "tests/petra/test_stage_randomness.py")
mutation("petra_batch_kept_by_reference", SIM,
         "    return (images.detach().clone(), labels.clone(),", "    return (images.detach(), labels,",
         f"{T_SIM} -k refill")
mutation("models_hand_runs_autocast_streams", "revkernels/models/staged.py",
         "    return tuple(s if s.dtype == dtype else s.to(dtype) for s in streams)", "    return streams",
         "tests/models/test_staged.py")
mutation("petra_lr_linear_scaling_wrong", SIM,
         "return self.base_lr * self.batch_size * self.accum_k / 256", "return self.base_lr * self.batch_size / 256", T_REF)
mutation("petra_delayed_uses_current_params", PART,
         "            p.data = old\n", "            pass\n", "tests/petra/test_delayed_analysis.py -k stashed")
mutation("petra_bias_gets_weight_decay", SIM,
         'no_decay if isinstance(m, _NORMS) or name == "bias" else decay', 'no_decay if isinstance(m, _NORMS) else decay',
         f"{T_SIM} -k param_groups")
mutation("distributed_reversed_stage_order", DIST,
         "        self.worker = self.trainer.workers[self.rank]\n",
         "        self.worker = self.trainer.workers[self.world_size - 1 - self.rank]\n",
         "tests/petra/test_distributed.py::test_distributed_equals_simulator")

mutation("bench_petra_claim_compares_backwards", "benchmarks/bench_petra_accuracy.py",
         "{'yes' if cos['petra'] > cos['delayed'] else 'no'}", "{'yes' if cos['petra'] < cos['delayed'] else 'no'}",
         "tests/benchmarks/test_bench_petra_accuracy.py")

# --- ops and C++ kernels --------------------------------------------------------------------------------
mutation("cpp_coupling_ignores_b_stride", "csrc/ops/coupling_layout.cpp",
         "    layout->b_strides[d] = b_strides[d];", "    layout->b_strides[d] = a_strides[d];", "tests/ops/test_coupling.py")
mutation("cpp_batch_norm_channels_last_stride", "csrc/ops/batch_norm_cpu.cpp",
         "v.n_stride = c * v.s, v.c_stride = 1, v.s_stride = c;", "v.n_stride = c * v.s, v.c_stride = v.s, v.s_stride = 1;",
         "tests/fuzz/test_fuzz_ops.py -k batch_norm_act")  # the fuzz test alone (tests/ops/ has layout tests too)

# --- the lean walker: structure caches, RNG only where drawn; op entry points ----------------------------
mutation("structure_cache_never_rebuilt", STRUCTURE,
         "if entry is None or entry[0] != _version:", "if entry is None:", "tests/engine/test_structure.py")
mutation("declared_randomness_ignored", STRUCTURE,
         "        return bool(declared() if callable(declared) else declared)", "        return False",
         "tests/engine/test_structure.py")
mutation("op_scalar_guard_dropped", "revkernels/ops/_library.py",
         "        check_scalars(*args, **kwargs)\n", "", "tests/ops/test_batch_norm.py -k scalars")


# --- backward-time checks, compiled steps, statistics (fourteenth session) --------------------------------
mutation("param_versions_unchecked", STATE,
         "    if param_versions(params) == versions:\n        return\n", "    return\n",
         "tests/nn/test_reversible.py -k in_place")
mutation("create_graph_marks_only_grads_requiring_grad", STATE,
         "        if not torch.is_grad_enabled():\n            return outputs\n",
         "        if not torch.is_grad_enabled() or not any(g is not None and g.requires_grad for g in grads):\n"
         "            return outputs\n",
         "tests/nn/test_reversible.py -k gradient_penalty")
mutation("guard_filter_drops_user_globals", "revkernels/engine/compiled.py",
         "        if root in _own_globals() or root.startswith(\"G['__builtins_dict\"):\n            return False\n",
         "        return False\n",
         "tests/engine/test_compiled.py -k module_level_constant")
mutation("guard_filter_takes_every_module_for_a_library", "revkernels/engine/compiled.py",
         "    if top in (\"torch\", \"revkernels\"):\n        return True\n", "    return True\n",
         "tests/engine/test_compiled.py -k guard_filter_drops")
mutation("drop_path_rate_as_float", "revkernels/nn/drop_path.py",
         ">= self._rate", ">= self._p", "tests/engine/test_compiled.py -k stochastic_depth")
mutation("compiled_attention_in_low_precision", "revkernels/nn/attention.py",
         "        if q.dtype in (torch.bfloat16, torch.float16):", "        if False:",
         "tests/models/test_revtext.py -k low_precision")
mutation("triton_layer_norm_mean_unshifted", "revkernels/triton/layer_norm.py",
         "    pivot = stats_pivot(tl.sum(tl.where(cols == 0, x, 0.0), axis=0))\n",
         "    pivot = stats_pivot(tl.sum(tl.where(cols == 0, x, 0.0), axis=0)) * 0.0\n",
         "tests/ops/test_layer_norm.py -k triton_sub_layer_norm_constant")
mutation("triton_batch_norm_stats_unshifted", "revkernels/triton/batch_norm.py",
         "    return stats_pivot(tl.load(x_ptr + chans * xc, mask=cmask, other=0.0).to(acc_type))\n",
         "    return stats_pivot(tl.load(x_ptr + chans * xc, mask=cmask, other=0.0).to(acc_type)) * 0.0\n",
         "tests/ops/test_batch_norm.py -k constant_and_offset")
mutation("triton_layer_norm_chunked_mean_merged", "revkernels/triton/layer_norm.py",
         "    mean = pivot + total_sum / n\n", "    mean += pivot\n",
         "tests/ops/test_layer_norm.py -k triton_sub_layer_norm_mean_of_a_row_starting_with_inf")
mutation("triton_batch_norm_split_mean_merged", "revkernels/triton/batch_norm.py",
         "total_sum / tl.maximum(count, 1.0), mask=cmask)", "mean, mask=cmask)",
         "tests/ops/test_batch_norm.py -k triton_mean_of_a_channel_starting_with_inf")

# --- fifteenth session: fallback tangents, NaN reports, tree changes, unused y2, hooks, shapes, context ----
mutation("fallback_kernels_keep_tangents", "revkernels/ops/_library.py",
         "        _FRAGMENT.impl(name, _refusing_tangents(kernel), key)\n", "        _FRAGMENT.impl(name, kernel, key)\n",
         "tests/ops/test_dispatch.py -k without_the_library")
mutation("max_error_drops_nan", "revkernels/check.py",
         "        return math.nan if any(map(math.isnan, errors)) else max(errors, default=0.0)\n",
         "        return max(errors, default=0.0)\n", "tests/test_check.py -k nan")
mutation("members_unchecked", STRUCTURE,
         "    if snapshot is not None:\n        invalidate()\n", "",
         "tests/engine/test_structure.py -k without_a_registration")
mutation("unused_y2_differentiated_with_zeros", SEQ,
         '    if dy2 is None and not getattr(type(block).grads, "takes_missing_dy2", False):\n',
         "    if dy2 is None:\n", "tests/engine/test_sequential.py -k differentiate_what_only")
mutation("compiled_inference_input_not_copied", "revkernels/engine/compiled.py",
         "    return t if t.is_inference() else t.clone()\n", "    return t\n",
         "tests/engine/test_compiled.py -k inference_mode_compiles")
mutation("compiled_backward_linears_not_flattened", "revkernels/engine/compiled.py",
         "    with _FlatLinears() if torch.compiler.is_compiling() else contextlib.nullcontext():\n",
         "    with contextlib.nullcontext():\n", "tests/engine/test_compiled.py -k transformer_streams_take")
mutation("direct_step_calls_skip_the_guards", "revkernels/engine/compiled.py",
         "if entry_guards(e.guard_manager, differentiating_only).check(frame_locals)), None)", "), None)",
         "tests/engine/test_compiled.py -k attribute_changed_after")
mutation("direct_step_calls_ignore_the_stance", "revkernels/engine/compiled.py",
         'if stance.stance != "default":', "if False:",
         "tests/engine/test_compiled.py -k without_dynamos_frame_hook")
mutation("unsafe_stance_checks_no_guards", "revkernels/engine/compiled.py",
         "    return manager if diff is None else diff\n",
         "    return types.SimpleNamespace(check=lambda f: True) if differentiating_only else manager\n",
         "tests/engine/test_compiled.py -k unsafe_stance")
mutation("unsafe_stance_compiles_or_falls_back", "revkernels/engine/compiled.py",
         "        if stance.skip_guard_eval_unsafe and _eval_frame._debug_get_cache_entry_list(code):\n",
         "        if False:\n", "tests/engine/test_compiled.py -k unsafe_stance")
mutation("unsafe_stance_takes_dynamos_hook", "revkernels/engine/compiled.py",
         'if stance.stance != "default":', 'if stance.stance != "default" or stance.skip_guard_eval_unsafe:',
         "tests/engine/test_compiled.py -k unsafe_stance")
mutation("direct_step_calls_start_no_generation", "revkernels/engine/compiled.py",
         "    torch._dynamo.mutation_guard.install_generation_tagging_init()\n    return types",
         "    return types",
         "tests/engine/test_compiled.py -k without_dynamos_frame_hook")
mutation("random_branch_steps_always_static", "revkernels/engine/compiled.py",
         "if name in any_shape and _any_shape(block)", "if False",
         "tests/engine/test_compiled.py -k take_any_shape")
mutation("context_keyword_nobody_uses_accepted", STATE,
         "    if unused:\n        return (", "    if False:\n        return (",
         "tests/nn/test_revtransformer.py -k no_branch_uses")
mutation("block_hooks_fire_without_a_graph", SEQ,
         "            x1, x2 = block.forward(x1, x2, **context)\n", "            x1, x2 = block(x1, x2, **context)\n",
         "tests/test_interop.py -k own_hooks_never")
mutation("batch_norm_act_double_backward_by_the_fused_kernel", "csrc/ops/batch_norm_autograd.cpp",
         "    if (at::GradMode::is_enabled()) {", "    if (false) {",
         "tests/ops/test_batch_norm.py::test_double_backward tests/nn/test_batch_norm.py -k gradient_penalty")
mutation("linear_sub_da_in_the_weight_dtype", "csrc/ops/linear_sub_autograd.cpp",
         "da = at::mm(g.to(gemm).neg(), weight.to(gemm))", "da = at::mm(g.to(weight.scalar_type()).neg(), weight)",
         "tests/ops/test_linear_sub.py -k mixed_a_and_weight")
mutation("batch_norm_spatial_mean_unshifted", "csrc/cpu/vec_kernels.cpp",
         "      const acc_t pivot = count > 0 ? stats_pivot(load<acc_t>(xc)) : acc_t(0);",
         "      const acc_t pivot = acc_t(0);",
         "tests/ops/test_batch_norm.py -k constant_and_offset_channels")
mutation("batch_norm_channels_mean_unshifted", "csrc/cpu/vec_kernels.cpp",
         "pivots[l] = stats_pivot(pivots[l]);", "pivots[l] = acc_t(0);",
         "tests/ops/test_batch_norm.py -k constant_and_offset_channels")
mutation("stream_threshold_ignores_the_variable", "csrc/cpu/dispatch.cpp",
         "if (text == nullptr || *text == '\\0') return last_level_cache_bytes();", "return last_level_cache_bytes();",
         "tests/ops/test_cpu_isa.py")
mutation("layer_norm_infinite_pivot", "csrc/cpu/vec_kernels.cpp",
         "stats_pivot(load<acc_t>(&first_x))", "load<acc_t>(&first_x)",
         "tests/ops/test_layer_norm.py -k starting_with_inf")
mutation("revvit_hooked_block_fused_recompute", REVVIT,
         "        if not m.fused or submodule_hooked(self, backward=True):", "        if not m.fused:",
         "tests/test_interop.py -k hooked_revvit")
mutation("submodule_modes_not_put_back", STATE, "    if now == modes:", "    if now[0][:1] == modes[0][:1]:",
         "tests/engine/test_structure.py -k switch_between")
mutation("dropout_rates_not_put_back", STATE, "    for (m, name), rate in zip(slots, rates):\n",
         "    for (m, name), rate in zip(slots, ()):\n",
         "tests/engine/test_structure.py -k rates tests/engine/test_compile.py -k rates")
mutation("fsdp_block_rebuilt_in_the_backwards_modes", "revkernels/engine/fsdp.py",
         "        with in_mode(block, ctx.modes):", "        with in_mode(block, module_modes(block)):",
         "tests/engine/test_fsdp.py -k switch")
mutation("compiled_fall_back_redraws", "revkernels/engine/compiled.py", "        rng_f.restore()\n", "",
         "tests/engine/test_compiled.py -k fall_back_after_f")
mutation("sub_layer_norm_fallback_double_backward_by_the_fused_op", "revkernels/ops/layer_norm.py",
         "    if torch.is_grad_enabled():  # create_graph", "    if False:  # create_graph",
         "tests/ops/test_layer_norm.py::test_pure_pytorch_fallback_when_library_missing")
mutation("context_container_tensors_not_saved", SEQ,  # the container kept as the caller's, as before 0eab64b
         "        if isinstance(v, CONTEXT_CONTAINERS):  # kept as its leaves (tensors saved) and structure\n",
         "        if False:\n            pass\n        if k not in names:\n            ctx.context_values[k] = v\n"
         "        elif False:\n", "tests/engine/test_context.py -k inside_a_context_container_are")
mutation("second_backward_error_off_the_path", STATE,
         "        anchors = [t for t in (*ctx.saved_tensors, *getattr(ctx, \"params\", ())) if t.requires_grad]\n",
         "        anchors = []\n", "tests/nn/test_reversible.py::test_a_second_backward_restricted_to_some_inputs_raises_too "
         "tests/engine/test_recompute.py::test_gradient_penalty_through_a_recompute_raises")
mutation("triton_stats_pivot_infinite", "revkernels/triton/_stats.py",
         "    return tl.where(first - first == 0, first, 0.0)", "    return first",
         "tests/ops/test_layer_norm.py tests/ops/test_batch_norm.py -k starting_with_inf")
mutation("petra_stages_share_the_process_generator", PART,  # as before the stage streams
         "        with torch.no_grad(), self._stream.drawing(cuda_devices_of(*x)) if stochastic else contextlib.nullcontext():",
         "        with torch.no_grad():",
         "tests/petra/test_distributed.py::test_distributed_equals_simulator tests/petra/test_stage_randomness.py")
mutation("petra_meet_with_a_deadline", DIST,  # a barrier under the process group's timeout, as before meet
         "        store = self._watchdog.store\n        if store is None:", "        store = None\n        if store is None:",
         "tests/petra/test_distributed.py -k busy_rank")
mutation("petra_ranks_get_the_forkservers_environment", DIST,  # the environment the forkserver started with
         "    os.environ.clear()\n    os.environ.update(env)\n", "    pass\n",
         "tests/petra/test_distributed.py -k launchers_environment")
mutation("compiled_static_branch_steps_get_marked_tensors", "revkernels/engine/compiled.py",
         "                    args = [_unmarked(a) for a in args]\n", "                    pass\n",
         "tests/engine/test_compiled.py -k dropout_block_below")
mutation("cuda_build_failure_not_falling_back", "setup.py",  # the failed CUDA build's extension left as it was
         "                    ext.__dict__.update({k: v for k, v in vars(fallback).items() if not k.startswith(\"_\")})",
         "                    pass", "tests/test_packaging.py")
mutation("cuda_arch_list_not_from_torch", "setup.py",  # torch's own rule again: an IndexError with no GPU
         "    if os.environ.get(\"TORCH_CUDA_ARCH_LIST\") or torch.cuda.is_available():",
         "    if True:", "tests/test_packaging.py")
mutation("isa_builds_take_torchs_cxx_standard", "setup.py",  # torch 2.11's C++17 for the sources again
         '    cxx_flags = ["-O3", "-fopenmp", "-g0", "-ffp-contract=off", "-std=c++20"]',
         '    cxx_flags = ["-O3", "-fopenmp", "-g0", "-ffp-contract=off"]', "tests/test_packaging.py")
mutation("opaque_run_skipped_where_is_exporting_lies", REV,  # torch 2.11: blocks traced, activations saved
         "            if _exporting() or not records_graph(",
         "            if torch.compiler.is_exporting() or not records_graph(",
         "tests/engine/test_compile.py -k is_exporting")
mutation("static_steps_keep_torch_211_dynamic_marks", "revkernels/engine/compiled.py",
         '    marked = hasattr(t, "_dynamo_propagated_dynamic_indices") or hasattr(t, "_dynamo_weak_dynamic_indices")',
         '    marked = hasattr(t, "_dynamo_propagated_dynamic_indices")',
         "tests/engine/test_compiled.py -k dynamic_size_marks")
mutation("sync_debug_mode_set_before_its_restore_is_armed", "revkernels/engine/graphs.py",
         "    try:\n        _set_sync_debug_mode(\"error\")\n        yield",
         "    torch.cuda.set_sync_debug_mode(\"error\")\n    try:\n        yield",
         "tests/engine/test_graphs.py -k warm_up_sync_check")
GRAPHS = "revkernels/engine/graphs.py"
T_GRAPHS = "tests/engine/test_graphs.py"
mutation("graphs_random_rule_of_its_own", GRAPHS,  # MHA dropout, declared draws_random: captured, masks redrawn
         "    return [i for i, block in enumerate(seq.blocks) if block.draws_random()]",
         "    return [i for i, block in enumerate(seq.blocks)\n"
         "            if any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for m in block.modules())]",
         T_GRAPHS + " -k draws_random")
mutation("graphs_capture_fires_parameter_hooks", GRAPHS,
         "    y1, y2 = run_reversible(seq, x1, x2, walker, param_inputs=aliases)",
         "    y1, y2 = run_reversible(seq, x1, x2, walker)\n    aliases = params",
         T_GRAPHS + " -k parameter_hooks")
mutation("graphs_signature_without_hyperparameters", GRAPHS,  # eps/causal changed: the old graph replayed
         "            autocast, hyperparameters(seq), tensors)",
         "            autocast, tuple(m.training for m in seq.modules()), tensors)",
         T_GRAPHS + " -k signature_tracks")
COMPILED = "revkernels/engine/compiled.py"
mutation("compiled_recompile_budget_per_process", COMPILED,  # a width sweep's later models ran eagerly
         "        functions, any_shape = self._compiled(_layout(block).key)",
         "        functions, any_shape = self._compiled(None)",
         "tests/engine/test_compiled.py -k recompile_budget_of_its_own")
mutation("compiled_anomaly_step_marks_the_structure_failed", COMPILED,
         "    return torch.is_anomaly_enabled() or torch._C._len_torch_dispatch_stack() > 0",
         "    return torch._C._len_torch_dispatch_stack() > 0",
         "tests/engine/test_compiled.py -k debugging_mode")
mutation("compiled_dispatch_mode_step_marks_the_structure_failed", COMPILED,
         "    return torch.is_anomaly_enabled() or torch._C._len_torch_dispatch_stack() > 0",
         "    return torch.is_anomaly_enabled()",
         "tests/engine/test_compiled.py -k debugging_mode")
mutation("undeclared_randomness_not_checked", "revkernels/engine/state.py",
         "    if torch.equal(before.cpu, after.cpu) and all(",
         "    if True or all(",
         "tests/engine/test_state.py")
mutation("compile_options_keyed_by_repr", COMPILED,  # a backend lambda made per call: a new compile each time
         "    key = (device_type, _option_key(options))",
         "    key = (device_type, repr(options))",
         "tests/engine/test_compiled.py -k compile_options_are_shared")
mutation("expired_context_structure_not_reported", "revkernels/engine/opaque.py",
         "    spec = _CONTEXT_SPECS.get(handle)\n    if spec is None:",
         "    spec = _CONTEXT_SPECS.get(handle)\n    if False:",
         "tests/engine/test_context.py -k registry_of_compiled")
mutation("auto_captures_runs_graphs_cannot_replay", "revkernels/engine/__init__.py",
         "    if x1.is_cuda and eager_reason(seq, context) is None:", "    if x1.is_cuda:",
         "tests/engine/test_engines.py")
# --- model semantics against independent plain-PyTorch definitions (tests/models/test_independent_forward.py)
T_INDEP = "tests/models/test_independent_forward.py"
TEXT = "revkernels/models/revtext.py"
VIT = "revkernels/models/revvit.py"
SWIN = "revkernels/models/revswin.py"
NET = "revkernels/models/revnet.py"
mutation("revtext_position_embedding_zeroed", TEXT, "h = self.tok_embed(tokens) + self.pos_embed(", "h = self.tok_embed(tokens) + 0 * self.pos_embed(", f"{T_INDEP} -k revtext")
mutation("revtext_positions_offset", TEXT, "self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))", "self.pos_embed(torch.arange(1, tokens.shape[1] + 1, device=tokens.device) % self.max_len)", f"{T_INDEP} -k revtext")
mutation("causal_mask_dropped_with_padding_mask", REVVIT, "    if causal:\n        future = ", "    if False:\n        future = ", f"{T_INDEP} -k revtext_forward")
mutation("causal_mask_transposed_with_mask", REVVIT, ".triu_(1)", ".tril_(-1)", f"{T_INDEP} -k revtext_forward")
mutation("causal_flag_dropped_without_mask", REVVIT, "        return None, causal\n", "        return None, False\n", f"{T_INDEP} -k revtext_forward")
mutation("revtext_padding_mask_ignored", TEXT, 'context["attn_mask"] = attention_mask != 0', 'context["attn_mask"] = attention_mask == attention_mask', f"{T_INDEP} -k revtext_forward")
mutation("bool_attn_mask_inverted", REVVIT, '.masked_fill_(~attn_mask, float("-inf"))', '.masked_fill_(attn_mask, float("-inf"))', f"{T_INDEP} -k revtext_forward")
mutation("additive_attn_mask_ignored", REVVIT, "mask = attn_mask.to(device=q.device, dtype=q.dtype)", "mask = attn_mask.to(device=q.device, dtype=q.dtype) * 0", f"{T_INDEP} -k rev_transformer_block")
mutation("revtext_stream_sum_not_average", TEXT, "out = self.norm((y1 + y2) * 0.5)", "out = self.norm(y1 + y2)", f"{T_INDEP} -k revtext")
mutation("revtext_only_y2", TEXT, "out = self.norm((y1 + y2) * 0.5)", "out = self.norm(y2)", f"{T_INDEP} -k revtext")
mutation("revtext_final_norm_skipped", TEXT, "out = self.norm((y1 + y2) * 0.5)", "out = (y1 + y2) * 0.5", f"{T_INDEP} -k revtext")
mutation("revtext_head_not_tied", TEXT, "F.linear(out, self.tok_embed.weight)", "F.linear(out, self.tok_embed.weight.roll(1, 0))", f"{T_INDEP} -k revtext")
mutation("revtext_embed_norm_skipped", TEXT, "            h = self.embed_norm(h)", "            h = h", f"{T_INDEP} -k revtext")
mutation("revtext_gpt2_exact_gelu", TEXT, 'embed_norm=False, approximate="tanh"', 'embed_norm=False, approximate="none"', f"{T_INDEP} -k revtext")
mutation("revtext_gpt2_not_causal", TEXT, "heads=12, causal=True", "heads=12, causal=False", f"{T_INDEP} -k revtext")
mutation("revtext_eps_not_passed", TEXT, "causal=causal, drop_path=r, eps=eps,", "causal=causal, drop_path=r,", f"{T_INDEP} -k revtext")
mutation("attention_qkv_layout_interleaved", REVVIT, "qkv = qkv.reshape(batch, tokens, 3, self.num_heads, dim3 // (3 * self.num_heads))", "qkv = qkv.reshape(batch, tokens, self.num_heads, 3, dim3 // (3 * self.num_heads)).transpose(2, 3)", f"{T_INDEP} -k rev_vit_block")
mutation("fused_forward_G_reads_x1", REVVIT, 'h = F.layer_norm(v1, (dim,), P["g.norm.weight"]', 'h = F.layer_norm(x1, (dim,), P["g.norm.weight"]', f"{T_INDEP} -k rev_vit_block")
mutation("attention_branch_skips_norm", REVVIT, "out = self.proj(self.attend(self.qkv(self.norm(x)), attn_mask))", "out = self.proj(self.attend(self.qkv(x), attn_mask))", f"{T_INDEP} -k rev_transformer_block")
mutation("mlp_branch_ignores_approximate", REVVIT, "F.gelu(self.fc1(self.norm(x)), approximate=self.approximate)", "F.gelu(self.fc1(self.norm(x)))", f"{T_INDEP} -k rev_transformer_block")
mutation("residual_dropout_active_in_eval", REVVIT, "        return self.training and self.p > 0.0", "        return self.p > 0.0", f"{T_INDEP} -k rev_transformer_block")
mutation("generic_inverse_F_reads_y2", REV, "x1 = coupling_sub(y1, self.f(x2, **context))", "x1 = coupling_sub(y1, self.f(y2, **context))", f"{T_INDEP} -k rev_vit_block")
mutation("fused_recompute_exact_gelu", REVVIT, "hidden = F.gelu(pre, approximate=m.g.approximate)", "hidden = F.gelu(pre)", f"{T_INDEP} -k rev_transformer_block")
mutation("revvit_positions_dropped", VIT, ".transpose(1, 2) + self.pos_embed", ".transpose(1, 2)", f"{T_INDEP} -k revvit")
mutation("revvit_first_token_pooling", VIT, "self.norm((y1 + y2) * 0.5).mean(dim=1)", "self.norm((y1 + y2) * 0.5)[:, 0]", f"{T_INDEP} -k revvit")
mutation("revvit_final_norm_eps", VIT, "nn.LayerNorm(dim, eps=1e-6)", "nn.LayerNorm(dim)", f"{T_INDEP} -k revvit")
mutation("revvit_single_stream", VIT, "self.norm((y1 + y2) * 0.5)", "self.norm(y1)", f"{T_INDEP} -k revvit")
mutation("swin_shift_regions_merged", SWIN, "band[n - shift_size:] = 2", "band[n - shift_size:] = 1", f"{T_INDEP} -k revswin")
mutation("swin_roll_wrong_direction", SWIN, "h = torch.roll(h, shifts=(-s, -s), dims=(1, 2))", "h = torch.roll(h, shifts=(s, s), dims=(1, 2))", f"{T_INDEP} -k revswin")
mutation("swin_relative_index_transposed", SWIN, "return dr * (2 * window_size - 1) + dc", "return dc * (2 * window_size - 1) + dr", f"{T_INDEP} -k revswin")
mutation("swin_even_blocks_shifted", SWIN, "shift if j % 2 else 0", "shift if j % 2 == 0 else 0", f"{T_INDEP} -k revswin")
mutation("swin_global_stage_shifted", SWIN, "shift = window // 2 if grid > window_size else 0", "shift = window // 2", f"{T_INDEP} -k revswin")
mutation("swin_merging_order", SWIN, "x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2]", "x[:, 0::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 0::2]", f"{T_INDEP} -k revswin")
mutation("swin_merging_sum_not_average", SWIN, "x = ((x1 + x2) * 0.5).view(", "x = (x1 + x2).view(", f"{T_INDEP} -k revswin")
mutation("swin_stem_norm_skipped", SWIN, "tokens = self.norm(self.proj(images).flatten(2).transpose(1, 2))", "tokens = self.proj(images).flatten(2).transpose(1, 2)", f"{T_INDEP} -k revswin")
mutation("swin_window_bias_dropped", SWIN, "o = scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))", "o = scaled_dot_product_attention(q, k, v, attn_mask=(bias * 0).to(q.dtype))", f"{T_INDEP} -k revswin")
mutation("revnet_stem_streams_swapped", NET, "return streams_in(self.conv.weight.dtype, *x.chunk(2, dim=1))", "return streams_in(self.conv.weight.dtype, *reversed(x.chunk(2, dim=1)))", f"{T_INDEP} -k revnet")
mutation("revnet_stem_pool_2x2", NET, "self.pool = nn.MaxPool2d(3, stride=2, padding=1)", "self.pool = nn.MaxPool2d(2, stride=2)", f"{T_INDEP} -k revnet")
mutation("revnet_basic_no_inner_relu", NET, "self.bn1 = BatchNormAct2d(channels, relu=True)", "self.bn1 = BatchNormAct2d(channels, relu=False)", f"{T_INDEP} -k revnet")
mutation("revnet_downbasic_no_relu", NET, "self.bn2(self.conv2(torch.relu(h)))", "self.bn2(self.conv2(h))", f"{T_INDEP} -k revnet")
mutation("revnet_downbottleneck_carry_x1", NET, "self.carry(x2), self.shortcut(x1)", "self.carry(x1), self.shortcut(x1)", f"{T_INDEP} -k revnet")
mutation("half_coupling_no_swap", REV, "        return x2, x1 + fx2, BlockState(rng_f, None)", "        return x1 + fx2, x2, BlockState(rng_f, None)", f"{T_INDEP} -k revnet")
mutation("revnet_head_max_pool", NET, "z = torch.nn.functional.adaptive_avg_pool2d(", "z = torch.nn.functional.adaptive_max_pool2d(", f"{T_INDEP} -k revnet")
mutation("bnact_train_eps", BNACT, "out, mean, rstd = batch_norm_act(x, weight, bias, self.eps, self.relu)", "out, mean, rstd = batch_norm_act(x, weight, bias, self.eps * 100, self.relu)", f"{T_INDEP} -k revnet")
mutation("bnact_eval_no_relu", BNACT, "            return torch.relu(out) if self.relu else out", "            return out", f"{T_INDEP} -k revnet")
BUDGET = "revkernels/engine/budget.py"
T_BUDGET = "tests/engine/test_budget.py"
mutation("budget_keeps_a_block_past_the_budget", BUDGET,
         "            if saved > 0 and used + added <= budget_bytes:", "            if saved > 0 and used <= budget_bytes:",
         T_BUDGET + " -k within_the_budget")
mutation("budget_measurement_counts_a_batch_norm_batch", BUDGET,
         "            with recompute_context(block), buffers_kept(block), probe, \\\n",
         "            with buffers_kept(block), probe, \\\n", T_BUDGET + " -k batch_norm")
mutation("budget_measurement_draws_from_the_stream", BUDGET,
         "    with torch.random.fork_rng(devices=devices), torch.enable_grad():",
         "    with torch.enable_grad():", T_BUDGET + " -k every_budget")
mutation("budget_plan_ignores_training_flags", BUDGET,
         "            tuple(m.training for m in modules), ctx)", "            (), ctx)",
         T_BUDGET + " -k once_per_signature")
mutation("budget_plans_per_rank_under_fsdp", "revkernels/engine/fsdp.py",  # ranks' own timings, own plans
         "    box = [value]\n    for group in groups:\n        torch.distributed.broadcast_object_list(box, group_src=0, "
         "group=group)\n    return box[0]", "    return value",
         "tests/engine/test_fsdp.py -k budget")
mutation("budget_measures_sharded_parameters", BUDGET,  # a DTensor has no storage here: the plan raised
         "            b1, b2 = enter(module_units(block), probed, a1, a2)", "            b1, b2 = probed(a1, a2)",
         "tests/engine/test_fsdp.py -k budget")
mutation("member_checks_of_two_runs_drop_the_caches_in_turn", "revkernels/engine/structure.py",
         "        if snapshot[3] == _registrations:\n            _MEMBERS[module] = (_version, *snapshot[1:])\n"
         "            return\n", "", T_BUDGET + " -k structure_caches")
mutation("petra_cli_memory_budget_dropped", "revkernels/petra/train.py",
         '        kwargs["memory_budget"] = args.memory_budget\n', "        pass\n",
         "tests/petra/test_train.py -k exact_stages")
mutation("petra_cli_exact_dropped", "revkernels/petra/train.py",
         "args.stem, exact=args.exact)", "args.stem)", "tests/petra/test_train.py -k exact_stages")
mutation("budget_compiled_engine_keeps_blocks_eagerly", BUDGET,
         '        elif seq.engine == "compiled":  # (the block', '        elif False:  # (the block',
         T_BUDGET + " -k compiles_its_kept")
mutation("budget_compiled_kept_block_skips_its_hooks", COMPILED,
         "    if not (_eager_block(block, layout) or own_hooks or layout.key",
         "    if not (_eager_block(block, layout) or layout.key", T_BUDGET + " -k own_forward_hooks")
mutation("budget_trace_ignores_the_plan", BUDGET,  # under torch.compile every block was rebuilt
         "    options = traced_plan(seq, x1, x2, context)\n", "    options = None\n", T_BUDGET + " -k torch_compile")
mutation("budget_trace_guards_on_the_plan_cache", BUDGET,  # a plan for other inputs retraced every graph
         "            return _planned_options(run, planned, seq.memory_budget)\n",
         "            entry = dict.get(_budget_state(seq)[0].by_key, planned)\n"
         "            made = None if entry is None else entry[1].get((seq.memory_budget, False))\n"
         "            return None if made is None else made.under_compile.options\n", T_BUDGET + " -k does_not_retrace")
mutation("budget_trace_key_not_specialized", BUDGET,  # dynamic sizes: the key was no constant (fullgraph raised)
         "    for planned in _planned_keys(run):  # (comparing the sizes",
         "    return _planned_options(run, key, seq.memory_budget)\n    for planned in _planned_keys(run):  # (comparing the sizes",
         T_BUDGET + " -k second_batch_size")
mutation("budget_trace_slices_the_blocks", BUDGET,  # a new ModuleList per call: a recompile per call
         "    for block, option in zip(list(seq.blocks)[k:], options[k:]):  # (a list: see",
         "    for block, option in zip(seq.blocks[k:], options[k:]):  # (a list: see",
         T_BUDGET + " -k trace_runs_the_plan")
mutation("budget_run_slices_the_blocks", BUDGET,  # a new ModuleList per call: every structure cache dropped
         "    for i, (block, option) in enumerate(zip(list(seq.blocks)[k:], made.options[k:]), start=k):\n",
         "    for i, (block, option) in enumerate(zip(seq.blocks[k:], made.options[k:]), start=k):\n",
         T_BUDGET + " -k structure_caches")
mutation("petra_checkpoint_ignores_exact_bits", "revkernels/petra/simulate.py",
         "        check_exact_bits(state, self.exact_bits)\n", "", "tests/petra/test_exact_stages.py -k exact_bits")
mutation("petra_specs_copy_stages_on_their_device", PART,
         "x = _as_tuple(meta_copy(s.module)(", 'x = _as_tuple(copy.deepcopy(s.module).to("meta")(',
         "tests/petra/test_memory_budget.py -k meta_copies")
mutation("petra_rank_checkpoint_ignores_exact_bits", "revkernels/petra/distributed.py",
         "        check_exact_bits(state, tr.exact_bits)\n", "", "tests/petra/test_exact_stages.py -k exact_bits")
mutation("budget_trace_head_keeps_the_plans_settings", BUDGET,  # an engine set after memory_plan was not traced
         "    if 0 < k < len(made.options):  # (the head run takes", "    if False:  # (the head run takes",
         T_BUDGET + " -k take_the_runs_settings")
mutation("fsdp_plan_broadcast_over_the_default_group", "revkernels/engine/fsdp.py",  # replicas got rank 0's plan
         "    return tuple(mesh.get_group(dim) for dim in range(mesh.ndim) if mesh.size(dim) > 1)",
         "    return (None,)", "tests/engine/test_fsdp.py -k for_itself")
mutation("fsdp_exact_plain_forward_drops_its_outputs", "revkernels/engine/fsdp.py",
         "        streams.outputs = x1, x2  # (a caller may go on", "        pass  # (a caller may go on",
         "tests/engine/test_fsdp.py -k exact-block-raf")
mutation("bench_budget_rows_share_one_frame", "benchmarks/bench_budget.py",  # every amb row ran budget 0's graph
         'compiled = torch.compile(own_frame(rk.nn.ReversibleSequential(*seq.blocks, engine="autograd")))',
         'compiled = torch.compile(rk.nn.ReversibleSequential(*seq.blocks, engine="autograd"))',
         "tests/benchmarks/test_bench_budget.py -k quick_run")
mutation("budget_key_sorts_context_items", BUDGET,  # a trace cannot sort (name, tensor) pairs: fullgraph raised
         "    ctx = tuple((k, tuple(context[k].shape), context[k].dtype) if isinstance(context[k], torch.Tensor)\n"
         "                else (k, repr(context[k])) for k in sorted(context)) if context else ()",
         "    ctx = tuple((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v))\n"
         "                for k, v in sorted(context.items())) if context else ()", T_BUDGET + " -k context_mask")
mutation("budget_copy_keeps_the_plan_cache", "revkernels/nn/reversible.py",  # deepcopy/pickle raised (an LRU)
         'if k not in ("_budget", "_planned_run")}', 'if k not in ("_planned_run",)}', T_BUDGET + " -k copies_and_pickles")
mutation("budget_copy_keeps_the_plan_number", "revkernels/nn/reversible.py",  # a copy's trace took its original's plan
         'if k not in ("_budget", "_planned_run")}', 'if k not in ("_budget",)}', T_BUDGET + " -k copies_and_pickles")
mutation("budget_trace_checkpoint_runs_plain", BUDGET,
         '        elif option == "checkpoint":  # (the partitioner', "        elif False:  # (the partitioner",
         T_BUDGET + " -k trace_runs_the_plan")
mutation("budget_trace_plan_without_checkpoint", BUDGET, "under_compile=plan(budget_bytes, costs, traced=True)",
         "under_compile=plan(budget_bytes, costs, traced=False)", T_BUDGET + " -k every_option")
mutation("budget_needed_ms_keeps_written_storages", BUDGET, "            need = (need - written) | (read - inputs)",
         "            need = need | (read - inputs)", T_BUDGET + " -k needed_ms")
mutation("budget_measurement_times_one_pass", BUDGET, "TIMING_PASSES = 3", "TIMING_PASSES = 1",
         T_BUDGET + " -k least_time")
mutation("budget_measurement_keeps_the_slowest_time", BUDGET, "= min(self.calls[self.at][1], ms)",
         "= max(self.calls[self.at][1], ms)", T_BUDGET + " -k least_time")
mutation("budget_selective_blocks_redraw", BUDGET,  # a selective block's recompute drew new dropout masks
         "            x1, x2 = run_selective(block, x1, x2, context, seq.preserve_rng_state)",
         "            x1, x2 = run_selective(block, x1, x2, context, False)",
         "tests/engine/test_conformance.py -k memory_budget")
mutation("budget_measurement_hands_saved_tensors_back", BUDGET,  # each plan leaked its measured graph
         "        alive.append(t)\n", "        alive.append(t)\n        return t\n",
         T_BUDGET + " -k nothing_of_its_forward")
mutation("budget_head_run_keyed_by_its_length", BUDGET,  # a replaced block: the old one kept running
         "    if head is None or any(a is not b for a, b in zip(head.blocks, seq.blocks)):", "    if head is None:",
         T_BUDGET + " -k replaced_or_inserted")
mutation("compiled_forward_detaches_the_context", COMPILED,  # a grad-requiring mask got a grad, no error
         "    x1, x2 = x1.detach(), x2.detach()\n", "    x1, x2, context = x1.detach(), x2.detach(), _detached(context)\n",
         "tests/nn/test_revtransformer.py -k requires_grad_raises")
mutation("recompute_calls_modules_on_the_leaf", "revkernels/engine/structure.py",  # FlopCounterMode: backward raised
         "    return leaf.view_as(leaf) if module_hooks._global_forward_pre_hooks else leaf", "    return leaf",
         "tests/test_interop.py -k flop_counter")
mutation("randomness_check_under_fake_tensor_mode", "revkernels/engine/state.py",  # torch.equal on fake states raised
         " or \\\n            torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:", ":",
         "tests/engine/test_state.py -k fake_tensor")
mutation("reverse_keeps_the_grads_dtypes", "revkernels/nn/reversible.py",  # dx1, dx2 came back in mixed dtypes
         "            dy1, dy2 = dy1.to(y1.dtype), dy2.to(y2.dtype)\n", "            pass\n",
         "tests/nn/test_reversible.py -k casts_each")
mutation("petra_stage_itself_random_not_seen", PART,  # a dropout stage's backward drew a new mask
         "        stochastic = draws_random(self.module, itself=True)", "        stochastic = draws_random(self.module)",
         "tests/petra/test_stage_randomness.py -k itself")
mutation("bench_takes_any_device", "revkernels/bench/report.py",  # --device meta wrote meta timings as results
         '    if parsed.type not in ("cpu", "cuda"):', "    if False:",
         "tests/benchmarks/test_bench_suite.py -k refuses_a_bad_device")
mutation("petra_baseline_checkpoint_drops_the_generators", SIM,  # resumed baselines drew other masks
         '"global_rng": _global_rng() if self.method in BASELINES else None', '"global_rng": None',
         "tests/petra/test_stage_randomness.py -k baselines")
mutation("budget_trace_no_warning_without_a_plan", BUDGET,
         ' and traced_plan(seq, x1, x2, context) is None:', ' and False:', T_BUDGET + " -k without_a_plan")
mutation("reference_vjp_skips_g_path", "revkernels/reference.py", "            dy1 = dy1 + _grad_of(y1)\n",
         "            dy1 = dy1\n", "tests/test_reference.py")
mutation("reference_half_coupling_drops_dy1", "revkernels/reference.py", "dy2, dy1 + _grad_of(x2)", "dy2, _grad_of(x2)",
         "tests/test_reference.py")
mutation("reference_recompute_without_autocast", "revkernels/reference.py", "enabled=ctx.autocast)", "enabled=False)",
         "tests/test_reference.py -k autocast")
mutation("bench_petra_bound_from_profile", "revkernels/bench/petra.py",
         '    bound = times["revbackprop_1thread"] / compute_s\n',
         '    bound = times["revbackprop_1thread"] / (max(group_ms) / 1e3)\n',
         "tests/benchmarks/test_bench_petra.py -k returns_its_rows")
mutation("eps_bool_accepted", "revkernels/ops/_library.py",
         "    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):", "    if not isinstance(eps, numbers.Real):",
         "tests/test_dependencies.py")
mutation("bench_memory_quick_hides_peak", "revkernels/bench/memory.py", "(2048 if args.quick else 1024)",
         "(256 if args.quick else 1024)", "tests/benchmarks/test_bench_suite.py -k quick_kernels_and_memory")
mutation("cuda_cpp_schema_without_the_public_defaults", "csrc/ops/batch_norm_cuda.cpp",
         "float eps=1e-05, bool relu=True) ", "float eps, bool relu) ",
         "tests/ops/test_dispatch.py -k cuda_cpp_ops_take")
mutation("auto_backend_takes_cuda_cpp_at_the_threshold", "revkernels/ops/_library.py",
         'numel < AUTO_CUDA_CPP_BELOW)', 'numel <= AUTO_CUDA_CPP_BELOW)',
         "tests/ops/test_dispatch.py -k default_cuda_backend")
mutation("petra_failed_tick_not_kept", SIM,  # a tick that raised, then the trainer went on mid-tick
         '            self._failed_tick = f"tick {self.tick} ({type(error).__name__}: {first_line})"\n', "",
         f"{T_SIM} -k tick_that_raises")


# --- exact mode: fixed-point streams (tests/nn/test_exact.py, the conformance table's exact column) ------
EXACT = "revkernels/nn/exact.py"
T_EXACT = "tests/nn/test_exact.py"
mutation("exact_recompute_skips_f_replay", EXACT,
         "            with maybe_replay(None if state is None else state.rng_f):\n"
         "                f_out, f_aliases = _call_with_aliases(block.f, x2_leaf, context)\n"
         "            v1, x1 = streams.sub(y1, f_out.detach())",
         "            f_out, f_aliases = _call_with_aliases(block.f, x2_leaf, context)\n"
         "            v1, x1 = streams.sub(y1, f_out.detach())", f"{T_EXACT} -k bit_for_bit")
mutation("exact_straight_through_flips_the_sign", EXACT, "        return d_view, d_view.to(ctx.f_dtype), None, None, None",
         "        return d_view, -d_view.to(ctx.f_dtype), None, None, None", f"{T_EXACT} -k fixed_point_network")
mutation("exact_overflow_flags_never_read", EXACT, "        if not bad.any():\n            return",
         "        if True:\n            return", f"{T_EXACT} -k overflow")
mutation("exact_view_cache_matches_by_shape", EXACT, "            if kept is stream:", "            if kept.shape == stream.shape:",
         f"{T_EXACT} -k view_cache")
mutation("exact_fused_rebuild_rounds_f_to_bf16", REVVIT, "v1, x1 = streams.sub(stream1.reshape(-1, dim), f_out)",
         "v1, x1 = streams.sub(stream1.reshape(-1, dim), f_out.bfloat16())", f"{T_EXACT} -k fused")
mutation("exact_run_returns_y1_twice", SEQ, "outputs = ctx.streams.view(y1), ctx.streams.view(y2)",
         "outputs = ctx.streams.view(y1), ctx.streams.view(y1)", f"{T_EXACT} -k memory_saving")
mutation("exact_monitor_keeps_its_threshold", "revkernels/check.py", "threshold = 0.0 if self.exact else self.threshold",
         "threshold = self.threshold", f"{T_EXACT} -k does_not_recompute")
mutation("opaque_exact_backward_walks_float_streams", "revkernels/engine/opaque.py", "            if fixed:\n",
         "            if False:\n", f"{T_EXACT} -k torch_compile")
mutation("budget_exact_suffix_rounds_the_views_again", "revkernels/engine/budget.py",
         "fixed if k else None, first=k)", "None, first=k)", f"{T_EXACT} -k memory_budget")
mutation("missing_grad_zeros_in_the_streams_dtype", SEQ, "        dy1 = grad_zeros(y1, dy2)",
         "        dy1 = torch.zeros_like(y1)", f"{T_EXACT} -k one_output")
mutation("fsdp_exact_node_returns_y1_twice", "revkernels/engine/fsdp.py",
         "        return run.streams.view(y1), run.streams.view(y2)", "        return run.streams.view(y1), run.streams.view(y1)",
         "tests/engine/test_fsdp.py -k exact")


# --- memory budget: rebuild / selective / keep per block, the greedy plan (tests/engine/test_budget.py) ------
mutation("budget_selective_recompute_updates_statistics_again", BUDGET, "                t.copy_(value)\n",
         "                pass\n", T_BUDGET + " -k batch_norm")
mutation("budget_selective_recompute_draws_new_masks", BUDGET,
         "use_reentrant=False, preserve_rng_state=preserve_rng_state,",
         "use_reentrant=False, preserve_rng_state=False,", T_BUDGET + " -k dropout_masks")
mutation("budget_selective_block_runs_plain", BUDGET, '        if option == "selective":\n            x1, x2 = run_selective',
         "        if False:\n            x1, x2 = run_selective", T_BUDGET + " -k within_the_budget")
mutation("budget_trace_selective_block_runs_plain", BUDGET,
         '        if option == "selective":  # (the compiled graph', "        if False:  # (the compiled graph",
         T_BUDGET + " -k trace_runs_the_plan")
mutation("budget_policy_recomputes_matmuls", BUDGET,
         "CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else", "CheckpointPolicy.PREFER_RECOMPUTE if op in SAVED_OPS else",
         T_BUDGET + " -k no_matrix_product")
mutation("budget_selective_bytes_without_the_inputs", BUDGET, "sum({**inputs, **probe.saved}.values())",
         "sum(probe.saved.values())", T_BUDGET + " -k within_the_budget")
mutation("budget_node_outputs_not_counted", BUDGET,
         "    return costs[k].input_bytes if 0 < k < len(options)", "    return 0 if 0 < k < len(options)",
         T_BUDGET + " -k greedy_plan")
mutation("budget_ties_go_to_the_earlier_block", BUDGET, "if best is None or (rate, i) > best[:2]:",
         "if best is None or (rate, -i) > (best[0], -best[1]):", T_BUDGET + " -k greedy_plan")
mutation("budget_selective_cost_without_dispatch", BUDGET, "        return self.recompute_ms + 2 * self.ops * overhead_ms",
         "        return self.recompute_ms", T_BUDGET + " -k greedy_plan")
mutation("budget_recompute_sees_the_changed_buffers", BUDGET,
         "        with buffers_as_before(tuple(changed)), sac:", "        with sac:", T_BUDGET + " -k sees_and_leaves")
mutation("budget_selective_offered_to_spectral_norm", BUDGET,
         "    return not spectral_norms(block) and", "    return True or not spectral_norms(block) and",
         T_BUDGET + " -k measurement_times")


# --- fixed-point ops (exact mode's int64 streams): kernels against their references -----------------------
T_FP = "tests/ops/test_fixed_point.py"
mutation("fixed_point_scalar_quantize_truncates", "csrc/kernels/fixed_point.h",  # the scalar (DEFAULT) kernel
         "    return _mm_cvtss_si64(_mm_set_ss(v));", "    return _mm_cvttss_si64(_mm_set_ss(v));",
         f"{T_FP} -k every_isa_build")
mutation("fixed_point_avx512_view_through_fp64", "csrc/cpu/vec_kernels.cpp",  # killed on AVX-512 CPUs only
         "  return _mm256_mul_ps(_mm512_cvt_roundepi64_ps(r, kNearest), _mm256_set1_ps(s.down_f));",
         "  return _mm256_mul_ps(_mm512_cvtpd_ps(_mm512_cvt_roundepi64_pd(r, kNearest)), _mm256_set1_ps(s.down_f));",
         f"{T_FP} -k view_rounds_the_integer_once")
mutation("fixed_point_cpu_flag_of_the_first_range_only", "csrc/ops/fixed_point_cpu.cpp",
         "      overflow.store(true, std::memory_order_relaxed);",
         "      if (begin == 0) overflow.store(true, std::memory_order_relaxed);", f"{T_FP} -k from_every_thread")
mutation("fixed_point_autograd_sign_swapped", "csrc/ops/fixed_point_autograd.cpp",
         "  using Backward = std::conditional_t<kSub, torch::autograd::generated::SubBackward0,",
         "  using Backward = std::conditional_t<!kSub, torch::autograd::generated::SubBackward0,",
         f"{T_FP} -k straight_through")
mutation("fixed_point_cuda_flag_of_thread_zero_only", "csrc/kernels/fixed_point.cu",
         "  if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = true;", "  if (bad && threadIdx.x == 0) *flag = true;",
         f"{T_FP} -k cuda_overflow", needs="cuda")
mutation("fixed_point_triton_ties_away_from_zero", "revkernels/triton/fixed_point.py",
         "    up = (size > 0.5) | ((size == 0.5) & ((t & 1) != 0))", "    up = size >= 0.5",
         "tests/triton/test_fixed_point_triton.py")
mutation("fixed_point_triton_view_through_fp64", "revkernels/triton/fixed_point.py",
         "    view = r.to(tl.float64 if VIEW_FP64 else tl.float32) * down",
         "    view = (r.to(tl.float64) * down).to(tl.float64 if VIEW_FP64 else tl.float32)",
         "tests/triton/test_fixed_point_triton.py -k double_rounding")
mutation("fixed_point_reference_flag_through_fp32", "revkernels/ops/fixed_point.py",  # the reference as it was
         "    return (bad | (out >= limit) | (out <= -limit)).any()", "    return (bad | (out.abs() >= LIMIT)).any()",
         f"{T_FP} -k reference_flags_exactly")
mutation("fixed_point_bits_true_taken_for_1", "revkernels/ops/fixed_point.py",
         "    if isinstance(bits, bool) or not isinstance(bits, int):", "    if not isinstance(bits, int):",
         f"{T_FP} -k bad_arguments")

def _copy_repo(dst):
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".venv", "build", "*.egg-info", ".pytest_cache",
                                    ".hypothesis", "results", "*.png")
    shutil.copytree(ROOT, dst, ignore=ignore, symlinks=True)


def _check_patterns(root, mutations):
    problems = []
    for m in mutations:
        path = os.path.join(root, m["file"])
        if not os.path.exists(path):
            problems.append(f"{m['name']}: file {m['file']} not found")
            continue
        n = open(path).read().count(m["old"])
        if n == 0:
            problems.append(f"{m['name']}: pattern not found in {m['file']}: {m['old']!r}")
        elif n > 1:
            problems.append(f"{m['name']}: pattern occurs {n} times in {m['file']}: {m['old']!r}")
    if problems:
        raise SystemExit("mutation_check: update the mutation table:\n  " + "\n  ".join(problems))


def _pytest(root, args, timeout):
    env = {**os.environ, "PYTHONPATH": root, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-m", "not gpu and not slow", *args]
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"timed out after {timeout} s", time.perf_counter() - t0
    out = r.stdout + r.stderr
    if r.returncode == 0:
        return "passed", "", time.perf_counter() - t0
    if r.returncode == 5:
        return "error", "no tests collected", time.perf_counter() - t0
    failed = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", out, re.M)
    return "failed", failed.group(1) if failed else out.strip().splitlines()[-1][:200], time.perf_counter() - t0


def _build(root, timeout=1800):
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode == 0, (r.stdout + r.stderr)[-2000:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help="mutation names to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--timeout", type=int, default=600, help="seconds per mutant's test run")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the selections")
    p.add_argument("--out", help="also write the report to this file")
    args = p.parse_args(argv)
    mutations = [m for m in M if not args.only or m["name"] in args.only]
    if args.only and len(mutations) != len(set(args.only)):
        raise SystemExit(f"unknown mutation(s): {sorted(set(args.only) - {m['name'] for m in M})}")
    if args.list:
        for m in mutations:
            print(f"{m['name']:45s} {m['file']:35s} {' '.join(m['tests'])}")
        return 0
    _check_patterns(ROOT, mutations)
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False

    t_start = time.perf_counter()
    lines = []

    def say(line=""):
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory(prefix="revkernels-mutants-") as tmp:
        root = os.path.join(tmp, "repo")
        _copy_repo(root)
        sos = glob.glob(os.path.join(root, "revkernels", "_C*.so"))
        if not sos:
            raise SystemExit("mutation_check: no built revkernels/_C*.so in the repository (build it first)")
        so_backup = {so: open(so, "rb").read() for so in sos}
        runnable = [m for m in mutations if m["needs"] != "cuda" or has_cuda]
        if not args.no_baseline:
            selections = []
            for m in runnable:
                if m["tests"] not in selections:
                    selections.append(m["tests"])
            for sel in selections:
                status, detail, secs = _pytest(root, sel, args.timeout)
                if status != "passed":
                    raise SystemExit(f"mutation_check: the unmutated selection {' '.join(sel)} {status}: {detail}")
            say(f"baseline: {len(selections)} selections pass unmutated ({time.perf_counter() - t_start:.0f} s)")
        results = []
        for m in mutations:
            if m["needs"] == "cuda" and not has_cuda:
                results.append((m, "not run", "needs CUDA", 0.0))
                say(f"{'NOT RUN':8s} {m['name']:45s} (needs CUDA)")
                continue
            path = os.path.join(root, m["file"])
            original = open(path).read()
            open(path, "w").write(original.replace(m["old"], m["new"], 1))
            try:
                if m["file"].startswith("csrc/"):
                    ok, log = _build(root)
                    if not ok:
                        results.append((m, "killed", "build failed", 0.0))
                        say(f"{'KILLED':8s} {m['name']:45s} by the build: {log.splitlines()[-1] if log else ''}")
                        continue
                status, detail, secs = _pytest(root, m["tests"], args.timeout)
            finally:
                open(path, "w").write(original)
                for so, data in so_backup.items():
                    if open(so, "rb").read() != data:
                        open(so, "wb").write(data)
            verdict = {"passed": "SURVIVED", "failed": "KILLED", "timeout": "KILLED", "error": "ERROR"}[status]
            results.append((m, verdict.lower(), detail, secs))
            say(f"{verdict:8s} {m['name']:45s} {secs:6.1f} s  {detail}")
    killed = sum(r[1] == "killed" for r in results)
    survived = [r[0]["name"] for r in results if r[1] == "survived"]
    errors = [r[0]["name"] for r in results if r[1] == "error"]
    not_run = [r[0]["name"] for r in results if r[1] == "not run"]
    say()
    say(f"{len(results)} mutants: {killed} killed, {len(survived)} survived, {len(errors)} errors, "
        f"{len(not_run)} not run; total {time.perf_counter() - t_start:.0f} s")
    if survived:
        say("survived (missing tests): " + ", ".join(survived))
    if not_run:
        say("not run here: " + ", ".join(not_run))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
