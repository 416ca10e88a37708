"""Where a compiled step call's host time goes, layer by layer: the compiled engine's steps
(`revkernels.engine.compiled`), from its walker's call down to inductor's kernels.

    python benchmarks/profile_step_layers.py                          # host_bound, revkernels_compiled
    python benchmarks/profile_step_layers.py --config compute_bound

The overhead benchmark's model and input for the configuration (`revkernels.bench.overhead`) run a
few train steps; the last one's step calls are recorded: each call's arguments and the inputs its
inductor graph got. The calls of the run's first and last block are then made again, grad mode off
as in the engine's autograd Functions, through five nested layers, and timed per call (medians
over rounds; each round times a batch of calls of every layer in turn, so a drift of the machine
hits them alike):

    inductor        the compiled graph's own callable: inductor's C++ wrapper and its kernels
    compiled_graph  + inductor's `CompiledFxGraph` call around it
    entry_code      + what Dynamo runs for a cached entry past its guards: the entry's bytecode
                    (it reads the graph's inputs from the arguments), Dynamo's disable wrappers
                    and AOTAutograd's runtime wrapper
    guards          + the entry's guard check (Dynamo's guard manager, on the arguments)
    run_step        the engine's call as its walkers make it (`run_step`): the entry lookup, the
                    guard check and the entry's code

and two beside them, under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (docs/compile.md), where a call checks only the entry's differentiating guards:

    diff_guards     entry_code + the entry's differentiating guards (``diff_guard_root``)
    run_step_unsafe_stance
                    `run_step` under that stance

Each layer's own cost is its difference from the layer before. The layers are torch internals
(Dynamo's cache entries, inductor's CompiledFxGraph) that another torch may lay out differently:
where they are missing, the part says so and stops. CPU only (on CUDA a call's host time is its
launches).

Results: step_layers_<config>_<device>.csv under --out (a row per step call timed, us per call),
with commit, device and versions on every row.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time
import types

import torch

from revkernels.bench import overhead as ov
from revkernels.bench.helptext import description
from revkernels.bench.report import check_out_folder, provenance, write_csv
from revkernels.engine import compiled

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the default --out
LAYERS = ("inductor", "compiled_graph", "entry_code", "guards", "run_step")
UNSAFE_STANCE_LAYERS = ("diff_guards", "run_step_unsafe_stance")  # (timed under that stance)
WARMUP_STEPS = 3  # train steps before the recorded one (compiles, caches)


def record_step_calls(model, x, device):
    """``[(step name, block position, step, args, graph, graph inputs)]`` for the compiled step calls
    of one train step of `model` on `x`, in call order. Raises RuntimeError when a step ran without
    its inductor graph (an eager fallback, another backend) or torch lacks the internals used."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: F401  (used by layer_calls)
    except ImportError as error:
        raise RuntimeError(f"revkernels: this torch lacks the internals the step layers are read from ({error})") from error
    calls, graphs, current = [], [], []
    steps_call, run_step, graph_call = compiled.CompiledSteps.call, compiled.run_step, CompiledFxGraph.__call__

    def recording_steps_call(self, name, block, position, *args):
        current[:] = [name, position]
        return steps_call(self, name, block, position, *args)

    def recording_run_step(step, args):
        calls.append((*current, step, list(args)))
        return run_step(step, args)

    def recording_graph_call(self, inputs):
        graphs.append((self, list(inputs)))
        return graph_call(self, inputs)

    compiled.CompiledSteps.call, compiled.run_step = recording_steps_call, recording_run_step
    CompiledFxGraph.__call__ = recording_graph_call
    try:
        ov.train_step(model, x, device)
    finally:
        compiled.CompiledSteps.call, compiled.run_step = steps_call, run_step
        CompiledFxGraph.__call__ = graph_call
    if not calls or len(graphs) != len(calls):
        raise RuntimeError(f"revkernels: {len(calls)} compiled step calls ran {len(graphs)} inductor graphs; the "
                           "step layers need every step compiled by inductor (no eager fallback)")
    return [(*call, graph, inputs) for call, (graph, inputs) in zip(calls, graphs)]


def layer_calls(step, args, graph, inputs):
    """{layer: a function making the step call through that layer} (see the module docstring)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    function = step._torchdynamo_orig_callable
    code = function.__code__
    with torch.no_grad():
        entry = next((e for e in _debug_get_cache_entry_list(code)
                      if e.guard_manager.check(dict(zip(code.co_varnames, args)))), None)
    if entry is None:
        raise RuntimeError(f"revkernels: no cached entry of the {function.__name__} step passes its guards")
    entry_code = types.FunctionType(entry.code, function.__globals__)
    guards = entry.guard_manager
    diff_guards = compiled.entry_guards(guards, differentiating_only=True)
    inner = graph.current_callable
    return {
        "inductor": lambda: inner(list(inputs)),  # (a boxed call: the callable empties the list it gets)
        "compiled_graph": lambda: graph(list(inputs)),
        "entry_code": lambda: entry_code(*args),
        "guards": lambda: guards.check(dict(zip(code.co_varnames, args))) and entry_code(*args),
        "run_step": lambda: compiled.run_step(step, args),
        "diff_guards": lambda: diff_guards.check(dict(zip(code.co_varnames, args))) and entry_code(*args),
        "run_step_unsafe_stance": lambda: compiled.run_step(step, args),
    }


def layer_stance(layer):
    """The compiler stance a layer's calls run under."""
    if layer in UNSAFE_STANCE_LAYERS:
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def time_layers(calls, rounds, batch):
    """{layer: median us per call} over `rounds` rounds of `batch` calls of each layer in turn."""
    samples = {layer: [] for layer in calls}
    with torch.no_grad():
        for _ in range(rounds):
            for layer, call in calls.items():
                with layer_stance(layer):
                    start = time.perf_counter()
                    for _ in range(batch):
                        call()
                    samples[layer].append((time.perf_counter() - start) / batch * 1e6)
    return {layer: statistics.median(values) for layer, values in samples.items()}


def measure(config, variant, rounds, batch, progress=None):
    """CSV rows: the layer times of the first and last block's call of each step function."""
    cfg = ov.CONFIGS[config]
    device = torch.device("cpu")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        model, x = ov.make_model(variant, cfg, device), ov.make_input(cfg, device)
        for _ in range(WARMUP_STEPS):
            ov.train_step(model, x, device)
        by_position = {}  # step name -> {block position: its call}
        for call in record_step_calls(model, x, device):
            by_position.setdefault(call[0], {})[call[1]] = call
        rows = []
        for name, calls in by_position.items():
            for position in sorted({min(calls), max(calls)}):  # the run's first and last block
                _, _, step, args, graph, inputs = calls[position]
                times = time_layers(layer_calls(step, args, graph, inputs), rounds, batch)
                rows.append({"config": config, "variant": variant, "step": name, "block": position,
                             "graph_inputs": len(inputs),
                             **{f"{k}_us": round(times[k], 2) for k in LAYERS + UNSAFE_STANCE_LAYERS},
                             "rounds": rounds, "batch": batch})
                if progress is not None:
                    progress(rows[-1])
    finally:
        torch.set_num_threads(previous_threads)
    return rows


def format_row(row):
    """One console line: the step call's total and each layer's own cost in us."""
    own = [row["inductor_us"]] + [row[f"{b}_us"] - row[f"{a}_us"] for a, b in zip(LAYERS, LAYERS[1:])]
    parts = ", ".join(f"{layer} {us:+.1f}" if i else f"{layer} {us:.1f}" for i, (layer, us) in enumerate(zip(LAYERS, own)))
    return (f"{row['step']:>16} blocks[{row['block']}]: run_step {row['run_step_us']:.1f} us = {parts}; "
            f"unsafe stance: diff_guards {row['diff_guards_us'] - row['entry_code_us']:+.1f}, "
            f"run_step {row['run_step_unsafe_stance_us']:.1f} us")


def main(argv=None, default_out=RESULTS):
    parser = argparse.ArgumentParser(prog="python benchmarks/profile_step_layers.py", description=description(__doc__))
    parser.add_argument("--config", default="host_bound", choices=list(ov.CONFIGS))
    parser.add_argument("--variant", default="revkernels_compiled",
                        choices=[v for v in ov.variants() if ov.engine_of(v) == "compiled"])
    parser.add_argument("--rounds", type=int, default=60, help="rounds of timed batches per layer (default: 60)")
    parser.add_argument("--batch", type=int, default=20, help="calls per timed batch (default: 20)")
    parser.add_argument("--out", default=default_out, help=f"results folder (default: {default_out})")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    if args.rounds < 1 or args.batch < 1:
        parser.error("--rounds and --batch must be at least 1")
    ov.keep_freed_memory()
    meta = provenance("cpu")
    print(f"step layers: {args.config}, {args.variant} (us per call, medians of {args.rounds} rounds of {args.batch})")
    rows = measure(args.config, args.variant, args.rounds, args.batch, progress=lambda row: print(format_row(row)))
    path = os.path.join(args.out, f"step_layers_{args.config}_cpu.csv")
    write_csv(path, rows, meta)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
