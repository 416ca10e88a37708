"""Speed against memory: a reversible run under memory budgets against the ways plain PyTorch trades
memory for time, all measured in one run on the same blocks.

    python benchmarks/bench_budget.py                        # CPU compute-bound configuration
    python benchmarks/bench_budget.py --device cuda --dim 768 --heads 12 --tokens 197 --batch 32 --depth 12
    python benchmarks/bench_budget.py --quick                # a small configuration, seconds

Rows (each a train step of the same RevViTBlock stack, forward + backward, median ms after warm-up,
timed in rounds, the eager rows together and the compiled rows together: one untimed and one timed
step of every row per round, so a change of load on the machine hits them alike;
``saved_mib`` is what the forward leaves alive for the backward, parameters aside, *measured* over one
forward: the eager rows by `revkernels.bench.report.retained_bytes` (what autograd saves, what a
checkpoint keeps beside it (its inputs, selective checkpointing's cache of matrix-product outputs) and
the outputs, each storage once; ``measured_by`` "storages"), the compiled rows by the allocator
(`revkernels.bench.report.allocated_bytes`: the memory in use after the forward less that before it;
``measured_by`` "allocator"), as compiled code runs no Python dispatch mode or saved-tensor hook)):

- ``revkernels budget=b``: the sequential engine with ``memory_budget=b`` for b in 0, 0.1, 0.25,
  0.5, 0.75, 1.0: the planner of `revkernels.engine.budget` gives each block rebuild, selective or
  keep (column ``plan``: one letter a block, R/C/S/K; ``planned_mib``: the bytes it expects to keep);
- ``standard``: ordinary autograd through the blocks (the autograd engine);
- ``checkpoint every k``: torch.utils.checkpoint (non-reentrant) around each group of k blocks;
- ``selective checkpoint``: torch's selective activation checkpointing around each block, saving the
  outputs of matrix products and attention and recomputing the rest (the policy of revkernels'
  selective option, `revkernels.engine.budget.save_matmuls`).

With ``--compiled``, the same under torch.compile: the run (compiled engine) at each budget under
``torch.compile``, following the plan for torch.compile (``plan.under_compile``: the rebuilt blocks
one opaque op running the compiled steps, the others compiled into the graph, checkpointed (C),
selectively checkpointed or kept) against the standard stack compiled with
``torch._functorch.config.activation_memory_budget`` at the same fractions (compiled against
compiled). Writes ``budget_<device>.csv`` (with the commit, device and versions on every row) and
``budget_<device>.png``: step time against saved memory.
"""
import argparse
import functools
import itertools
import os
import statistics
import types

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

import revkernels as rk
from revkernels.bench.report import (allocated_bytes, check_device, parse_checked, plotted, provenance, retained_bytes,
                                     timed_ms, write_results)
from revkernels.engine.budget import save_matmuls

BUDGETS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


def stack(args, device):
    torch.manual_seed(0)
    blocks = [rk.nn.RevViTBlock(args.dim, args.heads) for _ in range(args.depth)]
    return rk.nn.ReversibleSequential(*blocks, engine="sequential").to(device)


def checkpointed(seq, every, selective=False):
    """The blocks under ordinary autograd, each group of `every` blocks inside torch.utils.checkpoint."""
    blocks = list(seq.blocks)
    context_fn = functools.partial(create_selective_checkpoint_contexts, save_matmuls) if selective else None

    def group(a, b, part):
        for block in part:
            a, b = block(a, b)
        return a, b

    def run(x1, x2):
        for i in range(0, len(blocks), every):
            part = blocks[i:i + every]
            kwargs = {"context_fn": context_fn} if selective else {}
            x1, x2 = checkpoint(group, x1, x2, part, use_reentrant=False, **kwargs)
        return x1, x2
    return run


def _within(seq, budget, x1, x2):
    """`seq` called under `budget` (the eager rows share one run and switch its budget per call)."""
    seq.memory_budget = budget
    return seq(x1, x2)


def loss_of(y1, y2, target):
    return torch.nn.functional.mse_loss((y1 + y2) * 0.5, target)


def train_step(fn, params, x, target):
    def step():
        for p in params:
            p.grad = None
        loss_of(*fn(x, x), target).backward()
    return step


def measure(args, device):
    seq = stack(args, device)
    params = [p for p in seq.parameters() if p.requires_grad]
    x = torch.randn(args.batch, args.tokens, args.dim, device=device, requires_grad=True)
    target = torch.randn_like(x)
    held = [*seq.parameters(), *seq.buffers(), x]  # (not counted: held whatever the method)
    rows = []

    rounds = {"eager": [], "compiled": []}  # (row, step) of each group's rows, timed together in rounds

    def show(row):
        print(f"{row['group']:8s} {row['method']:28s} {row['step_ms']:9.2f} ms  saved {row['saved_mib']:9.2f} MiB  "
              f"{row['plan']}", flush=True)

    def record(method, group, budget, fn, plan=None):
        step = train_step(fn, params, x, target)
        step()  # (a plan's measurement, a compile, lazy initialisation: before the counting step)
        if group == "eager":
            out, saved = retained_bytes(lambda: fn(x, x), held)
        else:
            out, saved = allocated_bytes(lambda: fn(x, x), device)
        loss_of(*out, target).backward()
        del out
        for _ in range(args.warmup):
            step()
        row = {"group": group, "method": method, "budget": budget, "step_ms": float("nan"),
               "saved_mib": round(saved / 2**20, 4), "measured_by": "storages" if group == "eager" else "allocator",
               "plan": "", "planned_mib": ""}
        if plan is not None:
            row.update(plan="".join(o[0].upper() for o in plan.options), planned_mib=round(plan.kept_bytes / 2**20, 4))
        rows.append(row)
        rounds[group].append((row, step))

    def time_in_rounds(group):
        times = {id(row): [] for row, _ in rounds[group]}
        for _ in range(args.reps):
            for row, step in rounds[group]:
                step()  # (untimed: the timed step finds the caches as this row's own step leaves them)
                times[id(row)] += timed_ms(step, device, 1)
        for row, _ in rounds[group]:
            row["step_ms"] = round(statistics.median(times[id(row)]), 3)
            show(row)

    for budget in BUDGETS:
        seq.memory_budget = budget
        record(f"revkernels budget={budget:g}", "eager", budget, functools.partial(_within, seq, budget),
               seq.memory_plan(x, x))
    seq.memory_budget = 0
    standard = rk.nn.ReversibleSequential(*seq.blocks, engine="autograd")
    record("standard", "eager", "", standard)
    for every in sorted({1, 2, 3, args.depth // 2} - {0}):
        record(f"checkpoint every {every}", "eager", "", checkpointed(seq, every))
    record("selective checkpoint", "eager", "", checkpointed(seq, 1, selective=True))
    time_in_rounds("eager")

    if args.compiled:
        from torch._functorch import config as functorch_config

        torch._dynamo.reset()
        for budget in BUDGETS:
            run = rk.nn.ReversibleSequential(*seq.blocks, engine="compiled", memory_budget=budget)
            plan = run.memory_plan(x, x).under_compile  # (made eagerly: the trace follows it)
            record(f"revkernels compiled budget={budget:g}", "compiled", budget, torch.compile(own_frame(run)), plan)
        for budget in BUDGETS:
            with functorch_config.patch(activation_memory_budget=budget):  # (read when record compiles)
                compiled = torch.compile(own_frame(rk.nn.ReversibleSequential(*seq.blocks, engine="autograd")))
                record(f"standard compiled budget={budget:g}", "compiled", budget, compiled)
        time_in_rounds("compiled")
    return rows


_FRAMES = itertools.count()


def own_frame(module):
    """A function calling `module` with a code object of its own: Dynamo keeps compiled graphs per
    code object and, inlining modules, does not guard on which module of a structure it traced, so
    every compiled row calling ReversibleSequential.forward would run the first row's graph."""
    def call(x1, x2):
        return module(x1, x2)
    code = call.__code__.replace(co_name=f"row_{next(_FRAMES)}")
    return types.FunctionType(code, call.__globals__, code.co_name, None, call.__closure__)


@plotted((7.5, 4.8))
def plot(fig, ax, rows, title):
    for group, marker in (("eager", "o"), ("compiled", "s")):
        ours = [r for r in rows if r["group"] == group and r["method"].startswith("revkernels")]
        if ours:
            ax.plot([r["saved_mib"] for r in ours], [r["step_ms"] for r in ours], marker + "-",
                    label=f"revkernels ({group}), budgets 0..1", color="C0" if group == "eager" else "C3")
        theirs = [r for r in rows if r["group"] == group and not r["method"].startswith("revkernels")]
        label = "torch (eager): standard, checkpointing" if group == "eager" else \
            "torch.compile, activation_memory_budget"
        ax.plot([r["saved_mib"] for r in theirs], [r["step_ms"] for r in theirs], marker, label=label if theirs else None,
                color="C1" if group == "eager" else "C2")
        for r in theirs:
            ax.annotate(r["method"].replace("standard compiled ", "compiled "), (r["saved_mib"], r["step_ms"]),
                        fontsize=7, xytext=(4, 3), textcoords="offset points")
    floor = min((r["saved_mib"] for r in rows if r["method"].startswith("checkpoint")), default=None)
    if floor is not None:
        ax.axvspan(0, floor, color="0.9", zorder=0)
        ax.text(floor, 0.02, " below every torch.utils.checkpoint", fontsize=7, transform=ax.get_xaxis_transform(),
                va="bottom")
    ax.set_xlabel("saved for backward (MiB, measured)")
    ax.set_ylabel("train step (ms, median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=65)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--compiled", action="store_true", help="add the torch.compile rows (minutes on CPU)")
    parser.add_argument("--quick", action="store_true", help="dim 32, 2 heads, 9 tokens, batch 2, depth 4, 3 reps")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parse_checked(parser, argv, ["reps", "depth"])
    device = check_device(parser, args.device)
    if args.quick:
        args.dim, args.heads, args.tokens, args.batch, args.depth, args.warmup, args.reps = 32, 2, 9, 2, 4, 1, 3
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    rows = measure(args, device)
    meta = provenance(device)
    config = f"dim {args.dim}, {args.heads} heads, {args.tokens} tokens, batch {args.batch}, depth {args.depth}"
    write_results(os.path.join(args.out, f"budget_{device.type}.csv"), [{**r, "config": config} for r in rows], meta,
                  lambda png: plot(png, rows, f"speed against memory: {config}\n{meta['device']}, torch "
                                   f"{meta['torch']}, {meta['commit']}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
