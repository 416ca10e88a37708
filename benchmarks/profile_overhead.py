"""Where a train step of the overhead benchmark spends its host time: torch.profiler over a few steps
of each variant, every recorded event's self CPU time put in one category, plus the Python that ran
outside any recorded event.

    python benchmarks/profile_overhead.py --config host_bound \
        --variants standard reversible_plain revkernels_sequential revkernels_compiled

writes ``profile_<config>_<device>.txt`` (the category table, then each variant's top events) and
``.csv`` (the table with the run's provenance). Models, inputs, thread counts and the step (forward
+ backward of the loss, no optimizer) are the overhead benchmark's (`revkernels.bench.overhead`).
Categories, by self CPU time (each event's own time, its children's excluded, so the categories add
up to the step):

    gemm_attention    ATen matrix products and scaled-dot-product attention (the kernels every
                      variant must run; a reversible step runs each linear layer's GEMM four
                      times, standard training three)
    compiled_graphs   inside inductor's compiled graphs (their kernels, GEMMs and attention
                      included: inductor's C++ wrapper calls them without the profiler seeing them)
    dynamo_entry      entering a compiled function: Dynamo's cache lookup and guards (the compiled
                      engine checks its steps' guards itself), the compiled region's bytecode,
                      AOTAutograd's runtime wrapper
    autograd_engine   autograd's node evaluation, gradient accumulation and built-in backward nodes
    python_functions  inside `torch.autograd.Function`s written in Python (the engines' walkers,
                      the naive stack's backward), outside the ops they call
    revkernels_ops    the fused ops (``revkernels::*``), their C++ argument checks included
    other_aten        every other ATen op (elementwise, views, allocation, copies)
    other             any other recorded event
    python_untraced   wall time of the step outside every recorded event (module calls, the
                      engines' forward walkers, argument handling)

The profiler adds its own cost to every event, so absolute times run above the benchmark's: compare
shares and differences between variants, and quote step times from the benchmark's CSV. On CUDA the
categories are the host's time (a GEMM's is its launch; the kernels run asynchronously), what a
host-bound GPU step is made of; the step still ends with a device synchronisation.
"""
import argparse
import os
import re
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

from revkernels.bench import overhead as ov
from revkernels.bench.helptext import description
from revkernels.bench.report import check_device, parse_checked, provenance, synchronize, write_csv
from revkernels.engine.compiled import GUARDS_EVENT

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the default --out
CATEGORIES = ("gemm_attention", "compiled_graphs", "dynamo_entry", "autograd_engine", "python_functions",
              "revkernels_ops", "other_aten", "other", "python_untraced")
GEMM_ATTENTION = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"}
DYNAMO_ENTRY = ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "Pregraph bytecode", "AOTDispatcher Runtime",
                "CompiledFunction", GUARDS_EVENT)
DEFAULT_VARIANTS = {
    "host_bound": ("standard", "reversible_plain", "checkpoint", "revkernels_sequential",
                   "revkernels_generic_sequential", "revkernels_compiled", "standard_compile"),
    "compute_bound": ("standard", "reversible_plain", "revkernels_sequential", "revkernels_compiled",
                      "standard_compile"),
}
HEADINGS = dict(zip(CATEGORIES, ("gemm+attn", "compiled", "dynamo", "autograd", "py_function", "rk_ops",
                                  "other_aten", "other", "py_untraced")))
WARMUP_STEPS = 3  # unprofiled steps before the profiled ones, per variant
_BUILTIN_BACKWARD = re.compile(r"^[A-Z][A-Za-z0-9_]*Backward\d+$")  # ATen's nodes: AddmmBackward0, ...


def python_function_names():
    """Event names of Python `torch.autograd.Function`s: each subclass's name (its forward) and
    the name with "Backward" (its backward node)."""
    names, stack = set(), list(torch.autograd.Function.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        names.update((cls.__name__, cls.__name__ + "Backward"))
    return names


def category(name, function_names):
    """The category (see the module docstring) of a profiler event called `name`."""
    if name in GEMM_ATTENTION or name.startswith("aten::_scaled_dot_product"):
        return "gemm_attention"
    if name.startswith("## Call CompiledFxGraph"):
        return "compiled_graphs"
    if name.startswith(DYNAMO_ENTRY):
        return "dynamo_entry"
    if name in function_names:
        return "python_functions"
    if (name.startswith("autograd::engine::") or name.startswith("torch::autograd::")
            or _BUILTIN_BACKWARD.match(name)):
        return "autograd_engine"
    if name.startswith("revkernels::"):
        return "revkernels_ops"
    if name.startswith("aten::"):
        return "other_aten"
    return "other"


def breakdown(events, wall_us, steps, function_names=None):
    """{category: ms per step} from profiler events (objects with `key` and `self_cpu_time_total`
    in us, e.g. ``prof.key_averages()``) over `steps` steps that took `wall_us` in all; the
    remainder of the wall time is `python_untraced` (never below zero)."""
    function_names = python_function_names() if function_names is None else function_names
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        totals[category(event.key, function_names)] += event.self_cpu_time_total
    totals["python_untraced"] = max(wall_us - sum(totals.values()), 0.0)
    return {k: v / steps / 1e3 for k, v in totals.items()}


def profile_variant(variant, cfg, device, steps, warmup=WARMUP_STEPS):
    """(ms per profiled step, {category: ms per step}, key_averages) of `variant` on `cfg`."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        model = ov.make_model(variant, cfg, device)
        x = ov.make_input(cfg, device)

        def step():
            for p in model.parameters():
                p.grad = None
            ov.train_step(model, x, device)

        for _ in range(warmup):
            step()
        synchronize(device)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            synchronize(device)
            wall_us = (time.perf_counter() - start) * 1e6
    finally:
        torch.set_num_threads(previous_threads)
    events = prof.key_averages()
    return wall_us / steps / 1e3, breakdown(events, wall_us, steps), events


def profile_config(config, variants, device, steps):
    """{variant: profile_variant(...)} for the overhead benchmark's configuration `config`."""
    results = {}
    for variant in tqdm(variants, desc=f"profile {config}", unit="variant", file=sys.stderr, leave=False):
        results[variant] = profile_variant(variant, ov.CONFIGS[config], device, steps)
    return results


def rows_of(config, results, steps):
    """CSV rows: one per variant, the profiled step time and each category in ms per step."""
    return [{"config": config, "variant": variant, "steps": steps, "step_ms_profiled": round(step_ms, 4),
             **{f"{c}_ms": round(by_category[c], 4) for c in CATEGORIES}}
            for variant, (step_ms, by_category, _) in results.items()]


def report(config, results, steps, meta, rows=15):
    """The text report of `profile_config`'s results: provenance, the category table (ms per
    step, a row per variant) and each variant's top events by self CPU time."""
    cfg = ov.CONFIGS[config]
    variants = list(results)
    shape = ", ".join(f"{k} {cfg[k]}" for k in ("depth", "dim", "heads", "tokens", "batch", "threads"))
    lines = [f"Host time of a train step by category: {config} ({shape}), {steps} profiled steps per variant "
             f"after {WARMUP_STEPS} warm-up steps, ms per step (self CPU time; see benchmarks/profile_overhead.py).",
             "Profiled times include the profiler's own cost per event: compare shares and differences, quote "
             "step times from the overhead benchmark's CSV.",
             "provenance: " + ", ".join(f"{k} {v}" for k, v in meta.items()), ""]
    width = max(len(v) for v in variants) + 2
    lines.append(f"{'variant':<{width}}" + "".join(f"{HEADINGS[c]:>12}" for c in CATEGORIES) + f"{'step':>12}")
    for variant in variants:
        step_ms, by_category, _ = results[variant]
        lines.append(f"{variant:<{width}}" + "".join(f"{by_category[c]:>12.3f}" for c in CATEGORIES)
                     + f"{step_ms:>12.3f}")
    lines.append("columns: " + ", ".join(f"{HEADINGS[c]} = {c}" for c in CATEGORIES)
                 + ", step = the profiled step's wall time")
    for variant in variants:
        lines += ["", f"== {variant}: top events by self CPU time (all {steps} steps)",
                  results[variant][2].table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)]
    return "\n".join(lines) + "\n"


def main(argv=None, default_out=RESULTS):
    parser = argparse.ArgumentParser(prog="python benchmarks/profile_overhead.py",
                                     description=description(__doc__))
    parser.add_argument("--config", default="host_bound", choices=list(ov.CONFIGS))
    parser.add_argument("--variants", nargs="+", metavar="VARIANT", choices=ov.variants(),
                        help="variants to profile (default: the configuration's baselines and main engines)")
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps per variant (default: 20)")
    parser.add_argument("--rows", type=int, default=15, help="events listed per variant (default: 15)")
    parser.add_argument("--out", default=default_out, help=f"results folder (default: {default_out})")
    args = parse_checked(parser, argv, ["steps"])
    device = check_device(parser, args.device)
    ov.keep_freed_memory()
    meta = provenance(args.device)
    results = profile_config(args.config, args.variants or DEFAULT_VARIANTS[args.config], device, args.steps)
    text = report(args.config, results, args.steps, meta, args.rows)
    base = os.path.join(args.out, f"profile_{args.config}_{device.type}")
    write_csv(base + ".csv", rows_of(args.config, results, args.steps), meta)
    with open(base + ".txt", "w") as handle:
        handle.write(text)
    print(text.split("\n\n== ")[0])
    print(f"wrote {base}.txt, {base}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
