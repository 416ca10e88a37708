"""The compiled engine under torch's "warmed up" compiler stance: its train steps after the first under
``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``, against the same engine under the default
stance and the overhead benchmark's baselines.

    python benchmarks/bench_compiler_stance.py                       # host_bound and compute_bound, CPU
    python benchmarks/bench_compiler_stance.py --configs host_bound --rounds 10

Under that stance the compiled engine's steps check only their entries' differentiating guards
(docs/compile.md). The overhead benchmark's configurations, models, inputs, loss and timing loop
(`revkernels.bench.overhead`): each variant's warm-up steps (the first timed alone: it compiles), then
rounds of one timed step per variant, each right after an untimed step of its own; step_ms is the
median, vs_<baseline> the ratio baseline ms / variant ms (> 1: faster). Variants, RevViTBlocks for the
engine ones:

    standard, reversible_plain           the overhead benchmark's baselines
    revkernels_compiled                  the compiled engine, default stance
    revkernels_compiled_unsafe_stance    the same, its steps after the first under the stance above

Results: compiler_stance_<device>.csv under --out (default benchmarks/results), the overhead CSV's
columns plus vs_revkernels_compiled, with commit, device and versions on every row.
"""
import argparse
import contextlib
import os
import sys

import torch

from revkernels.bench import overhead as ov
from revkernels.bench.helptext import description
from revkernels.bench.report import check_device, check_out_folder, provenance, write_csv
from revkernels.bench.train import ReversibleStack
from revkernels.nn.revvit import RevViTBlock

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the default --out
UNSAFE_STANCE = "revkernels_compiled_unsafe_stance"
VARIANTS = ("standard", "reversible_plain", "revkernels_compiled", UNSAFE_STANCE)


class UnsafeStanceStack(ReversibleStack):
    """A `ReversibleStack` whose train steps after the first run under
    ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` (see `stance_of`; `train_step` sets
    `warmed_up` after a step)."""

    def __init__(self, blocks, engine):
        super().__init__(blocks, engine)
        self.warmed_up = False


def make_model(variant, cfg, device, seed=0):
    """The overhead benchmark's model of `variant`; for the unsafe-stance variant, the compiled
    engine's RevViTBlocks built as revkernels_compiled's (same seed, same weights)."""
    if variant != UNSAFE_STANCE:
        return ov.make_model(variant, cfg, device, seed)
    torch.manual_seed(seed)
    with torch.device(device):
        return UnsafeStanceStack([RevViTBlock(cfg["dim"], cfg["heads"]) for _ in range(cfg["depth"])], "compiled")


def stance_of(model):
    """The compiler stance of a train step of `model`: for an `UnsafeStanceStack` past its first step
    skip_guard_eval_unsafe (the first compiles its steps under the default stance), else unchanged."""
    if isinstance(model, UnsafeStanceStack) and model.warmed_up:
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    return contextlib.nullcontext()


def train_step(model, x, device):
    """The overhead benchmark's train step, under `stance_of(model)`."""
    with stance_of(model):
        ov.train_step(model, x, device)
    if isinstance(model, UnsafeStanceStack):
        model.warmed_up = True


def measure(config, device, warmup, rounds, variants=VARIANTS):
    """The rows of one of the overhead benchmark's configurations (see the module docstring)."""
    rows = ov.measure_config(config, ov.CONFIGS[config], list(variants), device, warmup, rounds,
                             build_model=make_model, step=train_step)
    compiled_ms = next((r["step_ms"] for r in rows if r["variant"] == "revkernels_compiled"), float("nan"))
    for row in rows:
        if row["variant"] == UNSAFE_STANCE:
            row["engine"] = "compiled"
        row["vs_revkernels_compiled"] = round(ov._ratio_value(compiled_ms, row["step_ms"]), 4)
    return rows


def main(argv=None, default_out=RESULTS):
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_compiler_stance.py", description=description(__doc__))
    parser.add_argument("--device", default="cpu", help="device to run on (default: cpu)")
    parser.add_argument("--configs", nargs="+", choices=list(ov.CONFIGS), default=list(ov.CONFIGS),
                        help="the overhead benchmark's configurations (default: all)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per variant, the first timed alone (default 3)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds of one step per variant (default 20)")
    parser.add_argument("--out", default=default_out, help=f"results folder (default: {default_out})")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    device = check_device(parser, args.device)
    if args.warmup < 1 or args.rounds < 1:
        parser.error("--warmup and --rounds must be at least 1")
    if device.type == "cpu":
        ov.keep_freed_memory()
    meta = provenance(args.device)
    rows = [row for config in args.configs for row in measure(config, device, args.warmup, args.rounds)]
    print(f"compiled engine under the skip_guard_eval_unsafe stance ({meta['device']}, torch {meta['torch']}); "
          "median step ms, speed = baseline ms / variant ms")
    print(f"{'config':<14} {'variant':<34} {'step ms':>9} {'vs standard':>12} {'vs plain':>9} {'vs compiled':>12}")
    for r in rows:
        print(f"{r['config']:<14} {r['variant']:<34} {ov._fmt(r['step_ms'], '9.2f'):>9} {ov._speed(r['vs_standard']):>12} "
              f"{ov._speed(r['vs_reversible_plain']):>9} {ov._speed(r['vs_revkernels_compiled']):>12}")
    os.makedirs(args.out, exist_ok=True)
    path = write_csv(os.path.join(args.out, f"compiler_stance_{device.type}.csv"), rows, meta)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
