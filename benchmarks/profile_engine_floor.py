"""How close the sequential engine runs, on generic blocks, to the cheapest autograd Function its
design allows, and how that compares with the minREV-style stack.

    python benchmarks/profile_engine_floor.py                         # host_bound
    python benchmarks/profile_engine_floor.py --config compute_bound

The overhead benchmark's configuration, input, loss and train step (`revkernels.bench.overhead`),
generic blocks ``ReversibleBlock(AttentionBranch, MlpBranch)`` with the same weights in every
variant:

    reversible_plain     the minREV-style stack (`revkernels.bench.overhead.PlainReversibleStack`
                         on `revkernels.reference`): parameter grads accumulated into ``.grad`` by
                         ``torch.autograd.backward`` inside its backward
    floor                `FloorRun`, an autograd Function as the design's invariants
                         (docs/design.md) lay the engines out (the parameters are its inputs and
                         their grads its outputs, captured from each block's local graphs without
                         accumulation), with nothing else: no argument, structure, mode or version
                         check, no RNG replay, no hooks
    floor_block_steps    the same Function rebuilding each block with the block's own steps
                         (``recompute``, then ``grads`` through `revkernels.engine.sequential.block_grads`)
    revkernels_generic_sequential   the sequential engine

Before timing, every variant's grads are checked against plain autograd through the same blocks
(relative error <= `revkernels.bench.overhead.GRAD_CHECK_TOL`; the part fails otherwise). Then
`--rounds` rounds of one timed step per variant (each right after an untimed step of its own), as
in the overhead benchmark: step_ms is the median, vs_reversible_plain the median of the per-round
ratios plain / variant (> 1: faster) with their quartiles.

Results: engine_floor_<config>_cpu.csv under --out (default benchmarks/results), with commit,
device and versions on every row. CPU only. A development diagnostic: it reads the sequential
engine's block steps (`revkernels.engine.sequential.block_grads`), which are internal.
"""
import argparse
import os
import statistics
import sys
import time

import torch
from torch.autograd.graph import _engine_run_backward
from tqdm import tqdm

from revkernels.bench import overhead as ov
from revkernels.bench.helptext import description
from revkernels.bench.report import parse_checked, provenance, write_csv
from revkernels.engine.sequential import block_grads
from revkernels.reference import Coupling

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VARIANTS = ("reversible_plain", "floor", "floor_block_steps", "revkernels_generic_sequential")


class FloorRun(torch.autograd.Function):
    """A run of generic reversible blocks: forward without a graph, backward rebuilding each block
    from its output and capturing its parameter grads (see the module docstring)."""

    @staticmethod
    def forward(ctx, blocks, param_lists, block_steps, x1, x2, *params):
        for block in blocks:
            x1, x2 = Coupling.forward(block, x1, x2)  # the coupling of revkernels.reference on the block's F, G
        ctx.blocks, ctx.param_lists, ctx.block_steps = blocks, param_lists, block_steps
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = (t.detach() for t in ctx.saved_tensors)  # (saved outputs carry this node)
        grads = []
        for block, (f_params, g_params) in zip(reversed(ctx.blocks), reversed(ctx.param_lists)):
            if ctx.block_steps:
                rec = block.recompute(y1, y2, None)
                step = block_grads(block, rec, y1, y2, dy1, dy2)
                grads.append(step.param_grads)  # F's parameters, then G's
                y1, y2, dy1, dy2 = rec.x1, rec.x2.detach(), step.dx1, step.dx2
                continue
            with torch.enable_grad():
                y1_leaf = y1.detach().requires_grad_()
                g_out = block.g(y1_leaf)
                x2 = (y2 - g_out.detach()).requires_grad_()
                f_out = block.f(x2)
            # dy1' = dy1 + (dG/dy1)^T dy2,  dx2 = dy2 + (dF/dx2)^T dy1'
            g_grads = _engine_run_backward((g_out,), (dy2,), False, False, (y1_leaf, *g_params), True,
                                           accumulate_grad=False)
            dy1 = dy1 + g_grads[0]
            f_grads = _engine_run_backward((f_out,), (dy1,), False, False, (x2, *f_params), True,
                                           accumulate_grad=False)
            dy2 = dy2 + f_grads[0]
            grads.append([*f_grads[1:], *g_grads[1:]])
            y1, y2 = y1 - f_out.detach(), x2.detach()
        return (None, None, None, dy1, dy2, *(g for chunk in reversed(grads) for g in chunk))


class FloorStack(torch.nn.Module):
    """`FloorRun` over `blocks` (generic `ReversibleBlock`s with every parameter requiring grad),
    the input as both streams, the streams averaged at the end (the overhead benchmark's layout)."""

    def __init__(self, blocks, block_steps):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.block_steps = block_steps
        self.param_lists = [(list(b.f.parameters()), list(b.g.parameters())) for b in blocks]

    def forward(self, x):
        if not x.requires_grad:
            x = x.detach().requires_grad_()
        params = [p for f_params, g_params in self.param_lists for p in (*f_params, *g_params)]
        y1, y2 = FloorRun.apply(list(self.blocks), self.param_lists, self.block_steps, x, x, *params)
        return (y1 + y2) * 0.5


def make_variant(variant, cfg, device):
    """The model of `variant` (see the module docstring), built from the overhead benchmark's seed."""
    if variant == "reversible_plain" or variant.startswith("revkernels_"):
        return ov.make_model(variant, cfg, device)
    model = ov.make_model("revkernels_generic_sequential", cfg, device)  # (same blocks, same weights)
    return FloorStack(list(model.seq.blocks), block_steps=variant == "floor_block_steps")


def _blocks_of(model):
    return list(model.seq.blocks if hasattr(model, "seq") else model.blocks)


def check_grads(models, x, device):
    """Raises RuntimeError unless every model's parameter grads match plain autograd's through
    its own blocks (`revkernels.reference.Coupling`'s forward on each block's F and G)."""
    for variant, model in models.items():
        ours = _grads(model, lambda: ov.train_step(model, x, device))

        def plain():
            x1 = x2 = x.detach().requires_grad_()
            for block in _blocks_of(model):
                x1, x2 = Coupling.forward(block, x1, x2)
            ov.loss_of((x1 + x2) * 0.5).backward()

        for i, (got, want) in enumerate(zip(ours, _grads(model, plain), strict=True)):
            if got is None:
                raise RuntimeError(f"engine_floor: {variant}: grad of parameter {i} missing")
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            if not err <= ov.GRAD_CHECK_TOL:
                raise RuntimeError(f"engine_floor: {variant}: grad of parameter {i} off by {err:.2e} (relative)")


def _grads(model, step):
    for p in model.parameters():
        p.grad = None
    step()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def measure(config, rounds, warmup=3, progress=None):
    """CSV rows, one per variant (see the module docstring)."""
    cfg = ov.CONFIGS[config]
    device = torch.device("cpu")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        x = ov.make_input(cfg, device)
        models = {v: make_variant(v, cfg, device) for v in VARIANTS}
        check_grads(models, x, device)

        def timed_step(model):
            for p in model.parameters():
                p.grad = None
            start = time.perf_counter()
            ov.train_step(model, x, device)
            return (time.perf_counter() - start) * 1e3

        for model in models.values():
            for _ in range(warmup):
                timed_step(model)
        times = {v: [] for v in VARIANTS}
        for k in range(rounds):
            for variant, model in models.items():
                timed_step(model)  # untimed: the timed step finds the caches as this variant leaves them
                times[variant].append(timed_step(model))
            if progress is not None:
                progress()
    finally:
        torch.set_num_threads(previous_threads)
    rows = []
    for variant in VARIANTS:
        ratios = [p / v for p, v in zip(times["reversible_plain"], times[variant])]
        q1, q3 = ov.round_ratio_quartiles(times["reversible_plain"], times[variant])
        rows.append({"config": config, **{k: cfg[k] for k in ("depth", "dim", "heads", "tokens", "batch", "threads")},
                     "variant": variant, "step_ms": round(statistics.median(times[variant]), 4),
                     "vs_reversible_plain": round(statistics.median(ratios), 4),
                     "vs_reversible_plain_q1": round(q1, 4), "vs_reversible_plain_q3": round(q3, 4),
                     "rounds": rounds})
    return rows


def main(argv=None, default_out=RESULTS):
    parser = argparse.ArgumentParser(prog="python benchmarks/profile_engine_floor.py", description=description(__doc__))
    parser.add_argument("--config", default="host_bound", choices=list(ov.CONFIGS))
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds, one step per variant each (default: 40)")
    parser.add_argument("--out", default=default_out, help=f"results folder (default: {default_out})")
    args = parse_checked(parser, argv, ["rounds"])
    ov.keep_freed_memory()
    meta = provenance("cpu")
    with tqdm(total=args.rounds, desc=f"engine floor {args.config}", unit="round", file=sys.stderr, leave=False) as bar:
        rows = measure(args.config, args.rounds, progress=lambda: bar.update())
    print(f"engine floor: {args.config}, generic blocks, {args.rounds} rounds (step ms, speed vs reversible_plain)")
    for row in rows:
        print(f"  {row['variant']:>30} {row['step_ms']:8.2f} ms  {row['vs_reversible_plain']:.3f}x "
              f"(q1-q3 {row['vs_reversible_plain_q1']:.3f}-{row['vs_reversible_plain_q3']:.3f})")
    path = os.path.join(args.out, f"engine_floor_{args.config}_cpu.csv")
    write_csv(path, rows, meta)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
