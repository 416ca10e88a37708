"""Host-overhead benchmark: train steps where the host (Python, dispatcher, autograd) bounds the time,
and each fused op's per-call cost against the ATen op or composition it replaces.

    python -m revkernels.bench.overhead                  # CPU: both configurations and the op table
    python -m revkernels.bench.overhead --quick          # the same shapes, fewer repetitions (~25 s, 2 cores)
    python benchmarks/bench_overhead.py ...              # the same, from a checkout (results in benchmarks/results)
    python -m revkernels.bench --parts overhead          # as a part of the benchmark suite

Train steps: forward and backward of one loss for every variant (the output, streams averaged for the
reversible ones, then .pow(2).mean()); grads set to None between steps (outside the timed region), no
optimizer; fp32 on CPU, bf16 autocast on CUDA. Two configurations:

    host_bound     depth 12, dim 64, 4 heads, 8 tokens, batch 2, 1 thread
    compute_bound  depth 6, dim 192, 3 heads, 65 tokens, batch 16, 2 threads

Variants, all built from the same seed (F = AttentionBranch and G = MlpBranch of revkernels.nn.revvit,
created in the same order in every variant, so they hold the same weights):

    standard                     pre-norm blocks x + F(x), x + G(x), eager autograd
    standard_compile             standard under torch.compile (inductor's defaults); not in --quick runs
                                 unless named with --variants (its first step compiles for tens of
                                 seconds on a few CPU cores: compile_s in the CSV)
    checkpoint                   standard with per-block torch.utils.checkpoint (use_reentrant=False)
    reversible_plain             the minREV-style reversible stack (PlainReversibleStack over
                                 `revkernels.reference`): one autograd Function over the plain F and
                                 G modules, no revkernels engine or op
    revkernels_<engine>          RevViTBlock (fused rebuild and grads), for each engine in
                                 revkernels.engine.ENGINES (an engine added there is picked up)
    revkernels_generic_<engine>  ReversibleBlock(AttentionBranch, MlpBranch), for each engine
    revkernels_exact_sequential, revkernels_generic_exact_sequential
                                 the same two on the sequential engine in exact mode (exact=True:
                                 fixed-point streams); their vs_float_streams column is the speed
                                 ratio against the same variant with float streams (> 1: faster)

The reversible variants take the input as both streams. Each variant first runs its warm-up steps
(the first one timed alone: first_step_ms; for an engine that compiles, such as "compiled",
compile_s = first step - median step; warm-up is never part of the step time; each configuration
starts from reset Dynamo caches, so its compiles are fresh, not recompiles of the previous
configuration's graphs with dynamic sizes); then the timed steps
run in rounds, one step of every variant per round, so a change of load on the machine hits all
variants alike, each timed step right after an untimed step of its own variant, so it finds the
caches (code, weights, allocator) as a training loop repeating that step leaves them, not as the
previous variant left them. step_ms is the median over the rounds; the vs_* columns are speed
ratios against a baseline of the same run (baseline ms / variant ms: > 1 is faster), and
vs_<baseline>_q1 / _q3 the first and third quartiles of the per-round ratios (a round's baseline
step over its variant step): how far the ratio moves through the run. Before timing, reversible_plain's grads are checked against those of revkernels' autograd engine (plain
autograd through the same reversible blocks) on the same weights: the part fails if they differ.

Op table: each fused op (torch.ops.revkernels.*) against what it replaces (the composition in the
op's reference, in ATen ops): per-call time at 8 x 64 fp32 with 1 thread, without grad (case tiny)
and as forward + backward of the sum of its differentiable outputs with every float input requiring
grad (tiny_grad; the *_bwd ops have no autograd formula, so no such row), and the time of one call at
4096 x 768 in fp32 and bf16 with 2 threads (throughput; BatchNorm on 16 x 768 x 16 x 16: 4096 values
per channel; on CUDA the mean of 20 back-to-back calls, a launch being long against the kernel).
wrapper_us is the Python entry point revkernels.ops.<op> (argument checks included)
at the tiny size. ratio = aten_us / fused_us (> 1: the fused op is faster). Medians after warm-up,
the samples of the fused op, its ATen composition and the entry point taken in turn (a drift of the
machine's memory bandwidth during the measurement hits them alike).

On CPU with glibc the benchmark first tells malloc to keep freed memory for reuse (`keep_freed_memory`):
without it, whether a large tensor lands on fresh pages (first-touch page faults can cost more than
the kernel timed) depends on what ran before, for the fused op and its ATen composition alike.

Compile time (full runs; --quick leaves it out unless --compile-variants names variants): a 12-block
ViT-S (dim 384, 6 heads, 65 tokens, batch 2, 2 threads, fp32 on CPU) under revkernels_compiled,
revkernels_generic_compiled and standard_compile, each in a child process with an empty inductor
cache (TORCHINDUCTOR_CACHE_DIR in a temporary folder), so compile_s (first step - median of the next
steps) is what a first run pays: Dynamo tracing, AOTAutograd and inductor's code generation and C++
compiles.

Results under --out: overhead_<device>.csv (steps), overhead_ops_<device>.csv (ops),
overhead_compile_<device>.csv (compile time), all with commit, device and versions on every row, and
overhead_<device>.png (step time per variant).
"""
import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import revkernels as rk
from revkernels.bench.report import (DEFAULT_OUT, check_device, check_out_folder, provenance, pyplot, save_figure,
                                     synchronize, write_csv)
from revkernels.bench.train import ReversibleStack, StandardStack
from revkernels.nn.revvit import AttentionBranch, MlpBranch, RevViTBlock
from revkernels.reference import Coupling, ReversibleFunction

CONFIGS = {
    "host_bound": dict(depth=12, dim=64, heads=4, tokens=8, batch=2, threads=1),
    "compute_bound": dict(depth=6, dim=192, heads=3, tokens=65, batch=16, threads=2),
}
BASELINES = ("standard", "reversible_plain", "checkpoint", "standard_compile")
COMPILE_CONFIG_NAME = "vit_s"
COMPILE_CONFIG = dict(depth=12, dim=384, heads=6, tokens=65, batch=2, threads=2)  # ViT-S
COMPILE_VARIANTS = ("revkernels_compiled", "revkernels_generic_compiled", "standard_compile")
COMPILE_TIMEOUT_S = 1800
TINY = (8, 64)
LARGE = (4096, 768)
TINY_THREADS, LARGE_THREADS = 1, 2
OPS = ("coupling_sub", "coupling_add", "sub_layer_norm", "layer_norm_bwd_add", "bias_gelu", "bias_gelu_bwd",
       "batch_norm_act", "batch_norm_act_bwd", "linear_sub")
COLORS = {"baseline": "tab:gray", "revvit": "tab:blue", "generic": "tab:orange"}
GRAD_CHECK_TOL = 1e-4  # max |grad - reference| / max |reference| per parameter (fp32; ~1e-6 seen)


# --- the minREV-style reversible stack --------------------------------------------------------------

class PlainReversibleStack(nn.Module):
    """The minREV-style reversible stack: `revkernels.reference`'s couplings in its one autograd
    Function (the forward without a graph, saving only the outputs; the backward rebuilding each
    block's input while recomputing G(y1) and F(x2), the parameter grads accumulated into .grad),
    the input as both streams, the streams averaged at the end. The input is made a leaf that
    requires grad (minREV's comes from the patch embedding): autograd calls a Function's backward
    only when an input requires grad."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        if not x.requires_grad:
            x = x.detach().requires_grad_()
        y1, y2 = ReversibleFunction.apply(x, x, tuple(self.blocks))
        return (y1 + y2) * 0.5


# --- variants ---------------------------------------------------------------------------------------

EXACT_ENGINES = ("sequential",)  # engines timed in exact mode too
EXACT_PREFIXES = {"revkernels_generic_exact_": "revkernels_generic_", "revkernels_exact_": "revkernels_"}


def variants(engines=None):
    """Every variant name, the engines from revkernels.engine.ENGINES (or `engines`)."""
    engines = list(rk.engine.ENGINES) if engines is None else list(engines)
    exact = [e for e in EXACT_ENGINES if e in engines]
    return (["standard", "standard_compile", "checkpoint", "reversible_plain"] + [f"revkernels_{e}" for e in engines]
            + [f"revkernels_generic_{e}" for e in engines] + [f"revkernels_exact_{e}" for e in exact]
            + [f"revkernels_generic_exact_{e}" for e in exact])


def float_streams_variant(variant):
    """The variant with float streams of an exact-mode variant; None for the others."""
    for prefix, plain in EXACT_PREFIXES.items():
        if variant.startswith(prefix):
            return plain + variant.removeprefix(prefix)
    return None


def build(variant, depth, dim, heads):
    """The model of `variant`; F then G of each block are created in the same order in every variant."""
    plain = float_streams_variant(variant)
    if plain is not None:
        model = build(plain, depth, dim, heads)
        model.seq.exact = True
        return model
    if variant in ("standard", "checkpoint"):
        return StandardStack(depth, dim, heads, use_checkpoint=variant == "checkpoint")
    if variant == "standard_compile":
        return torch.compile(StandardStack(depth, dim, heads))
    if variant == "reversible_plain":
        return PlainReversibleStack([Coupling(AttentionBranch(dim, heads), MlpBranch(dim, 4 * dim))
                                     for _ in range(depth)])
    if variant.startswith("revkernels_generic_"):
        return ReversibleStack([rk.nn.ReversibleBlock(AttentionBranch(dim, heads), MlpBranch(dim, 4 * dim))
                                for _ in range(depth)], variant.removeprefix("revkernels_generic_"))
    if variant.startswith("revkernels_"):
        return ReversibleStack([RevViTBlock(dim, heads) for _ in range(depth)], variant.removeprefix("revkernels_"))
    raise ValueError(f"unknown variant {variant!r}")


def engine_of(variant):
    """The revkernels engine a variant runs, or None."""
    variant = float_streams_variant(variant) or variant
    for prefix in ("revkernels_generic_", "revkernels_"):
        if variant.startswith(prefix):
            return variant.removeprefix(prefix)
    return None


def compiles(variant):
    """Whether the variant's first step compiles (standard_compile, or an engine named like "compiled")."""
    return variant == "standard_compile" or "compile" in (engine_of(variant) or "")


def make_model(variant, cfg, device, seed=0):
    torch.manual_seed(seed)
    with torch.device(device):
        return build(variant, cfg["depth"], cfg["dim"], cfg["heads"])


def make_input(cfg, device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(cfg["batch"], cfg["tokens"], cfg["dim"], generator=generator).to(device)


def loss_of(y):
    return y.float().pow(2).mean()


def train_step(model, x, device, autocast=True):
    """forward + backward of the benchmark's loss (grads accumulate into .grad); bf16 autocast on
    CUDA unless autocast=False."""
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast and device.type == "cuda"):
        y = model(x)
    loss_of(y).backward()


def check_plain_grads(cfg, device):
    """Max relative grad error of reversible_plain against revkernels' autograd engine on the
    generic block (plain autograd through the same reversible math), same seed, one fp32 step (no
    autocast: a bf16 recompute may round differently where the rebuilt input differs in its last
    fp32 bit). Raises if the weights differ (the variants would not be built alike) or the grads do."""
    plain = make_model("reversible_plain", cfg, device)
    reference = make_model("revkernels_generic_autograd", cfg, device)
    x = make_input(cfg, device)
    pairs = list(zip(plain.parameters(), reference.parameters(), strict=True))
    if not all(p.shape == q.shape and torch.equal(p, q) for p, q in pairs):
        raise RuntimeError("overhead: reversible_plain and revkernels_generic_autograd were not built with the same weights")
    train_step(plain, x, device, autocast=False)
    train_step(reference, x, device, autocast=False)
    error = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item() for p, q in pairs)
    if not error <= GRAD_CHECK_TOL:
        raise RuntimeError(f"overhead: reversible_plain grads differ from the autograd engine's: max relative "
                           f"error {error:.2e} > {GRAD_CHECK_TOL:.0e}")
    return error


def _error_line(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def measure_config(name, cfg, names, device, warmup, rounds, progress=None, build_model=None, step=None):
    """Step rows of one configuration: warm-up per variant (the first step timed alone), then
    `rounds` rounds of one timed step per variant; a variant that fails is printed and gets nan.
    Dynamo's caches are reset first: the compiling variants compile this configuration afresh, as a
    training process of these shapes would, not as a recompile of the previous configuration's
    graphs (which Dynamo would make dynamic in the sizes that changed). `build_model` and `step`
    replace `make_model` and `train_step` (a study of variants of its own reuses the loop)."""
    build_model, step = build_model or make_model, step or train_step
    torch._dynamo.reset()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        x = make_input(cfg, device)
        models, first_ms, times, failed = {}, {}, {v: [] for v in names}, {}

        def timed_step(variant):
            model = models[variant]
            for p in model.parameters():
                p.grad = None
            synchronize(device)
            start = time.perf_counter()
            step(model, x, device)
            synchronize(device)
            return (time.perf_counter() - start) * 1e3

        for variant in names:
            if progress is not None:
                progress.set_postfix_str(f"{name} {variant} warm-up")
            try:
                models[variant] = build_model(variant, cfg, device)
                first_ms[variant] = timed_step(variant)
                for _ in range(warmup - 1):
                    timed_step(variant)
            except Exception as error:  # recorded as nan, never silently
                failed[variant] = error
                models.pop(variant, None)
                print(f"  {name} {variant} FAILED: {_error_line(error)}", flush=True)
            if progress is not None:
                progress.update()
        for k in range(rounds):
            if progress is not None:
                progress.set_postfix_str(f"{name} round {k + 1}/{rounds}")
            for variant in list(models):
                try:
                    timed_step(variant)  # untimed: the timed step finds the caches as this variant leaves them
                    times[variant].append(timed_step(variant))
                except Exception as error:
                    failed[variant] = error
                    models.pop(variant)
                    print(f"  {name} {variant} FAILED: {_error_line(error)}", flush=True)
            if progress is not None:
                progress.update()
    finally:
        torch.set_num_threads(previous_threads)

    nan = float("nan")
    step_ms = {v: statistics.median(times[v]) if v not in failed and times[v] else nan for v in names}
    rows = []
    for variant in names:
        ms = step_ms[variant]
        first = first_ms.get(variant, nan)
        row = {"config": name, **{k: cfg[k] for k in ("depth", "dim", "heads", "tokens", "batch", "threads")},
               "dtype": "bfloat16 autocast" if device.type == "cuda" else "float32", "variant": variant,
               "engine": engine_of(variant) or "", "step_ms": ms, "first_step_ms": first,
               "compile_s": (first - ms) / 1e3 if compiles(variant) else "", "steps": len(times[variant]),
               "warmup": warmup}
        for base in BASELINES:
            row[f"vs_{base}"] = _ratio_value(step_ms.get(base, nan), ms)
        for base in BASELINES:
            row[f"vs_{base}_q1"], row[f"vs_{base}_q3"] = round_ratio_quartiles(
                times.get(base, []) if base not in failed else [], times[variant] if variant not in failed else [])
        plain = float_streams_variant(variant)
        row["vs_float_streams"] = "" if plain is None else _ratio_value(step_ms.get(plain, nan), ms)
        rows.append({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    return rows


def measure_compile(variant, device):
    """The compile-time row of `variant` on the ViT-S configuration, measured in a child process
    with an empty inductor cache (see the module docstring); nan times if the child fails."""
    row = {"config": COMPILE_CONFIG_NAME, **COMPILE_CONFIG, "variant": variant, "cache": "empty"}
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(rk.__file__)))
    with tempfile.TemporaryDirectory(prefix="revkernels-inductor-cache-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache,
                   PYTHONPATH=os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH")))))
        command = [sys.executable, "-m", "revkernels.bench.overhead", "--device", str(device), "--compile-child", variant]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            failure = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            done, failure = None, f"timed out after {COMPILE_TIMEOUT_S} s"
    if failure is not None:
        print(f"  compile time {variant} FAILED: {failure[:200]}", flush=True)
        return {**row, "compile_s": float("nan"), "first_step_ms": float("nan"), "step_ms": float("nan")}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1])}


def _compile_child(variant, device):
    """In the child process: two warm-up steps (the first timed alone), three timed steps; prints
    the times as JSON on the last line."""
    (row,) = measure_config(COMPILE_CONFIG_NAME, COMPILE_CONFIG, [variant], device, warmup=2, rounds=3)
    print(json.dumps({k: row[k] for k in ("dtype", "compile_s", "first_step_ms", "step_ms")}))


def round_ratio_quartiles(base_ms, variant_ms):
    """First and third quartile of the per-round speed ratios base / variant (each round times every
    variant once, so a round's ratio pairs steps taken moments apart): the spread of the ratio
    through the run. nan without two complete rounds of both."""
    if len(base_ms) != len(variant_ms) or len(base_ms) < 2:
        return float("nan"), float("nan")
    q1, _, q3 = statistics.quantiles([b / v for b, v in zip(base_ms, variant_ms)], n=4, method="inclusive")
    return q1, q3


def _ratio_value(a, b):
    return a / b if isinstance(a, float) and isinstance(b, float) and math.isfinite(a) and math.isfinite(b) and b > 0 \
        else float("nan")


# --- op table ---------------------------------------------------------------------------------------

def _op_cases(op, shape, dtype, device):
    """(fused, aten, wrapper, inputs) for one op: fused calls torch.ops.revkernels.<op>, aten the ATen
    composition it replaces, wrapper revkernels.ops.<op>; each returns the op's differentiable
    outputs; inputs: the float tensors to differentiate in the tiny_grad case (none for the *_bwd ops)."""
    rows, width = shape
    gen = torch.Generator().manual_seed(0)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(device=device, dtype=dtype)

    ops, py = torch.ops.revkernels, rk.ops
    eps = 1e-6
    if op in ("coupling_sub", "coupling_add"):
        a, b = rand(rows, width), rand(rows, width)
        aten = (lambda: [a - b]) if op == "coupling_sub" else (lambda: [a + b])
        return (lambda: [getattr(ops, op)(a, b)]), aten, (lambda: [getattr(py, op)(a, b)]), [a, b]
    if op == "sub_layer_norm":
        y, g, w, b = rand(rows, width), rand(rows, width), rand(width), rand(width)

        def aten():
            x = y - g
            return [x, F.layer_norm(x, (width,), w, b, eps)]
        return (lambda: list(ops.sub_layer_norm(y, g, w, b, eps)[:2])), aten, \
            (lambda: list(py.sub_layer_norm(y, g, w, b, eps)[:2])), [y, g, w, b]
    if op == "layer_norm_bwd_add":
        x, w, b, dln, dres = rand(rows, width), rand(width), rand(width), rand(rows, width), rand(rows, width)
        _, mean, rstd = torch.native_layer_norm(x, [width], w, b, eps)
        flat_mean, flat_rstd = mean.reshape(rows), rstd.reshape(rows)

        def aten():
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(dln, x, [width], mean, rstd, w, b, [True, True, True])
            return [dx + dres, dw, db]
        return (lambda: list(ops.layer_norm_bwd_add(dln, x, w, flat_mean, flat_rstd, dres))), aten, \
            (lambda: list(py.layer_norm_bwd_add(dln, x, w, flat_mean, flat_rstd, dres))), []
    if op == "bias_gelu":
        x, b = rand(rows, width), rand(width)
        return (lambda: [ops.bias_gelu(x, b, "none")]), (lambda: [F.gelu(x + b)]), \
            (lambda: [py.bias_gelu(x, b)]), [x, b]
    if op == "bias_gelu_bwd":
        dy, x, b = rand(rows, width), rand(rows, width), rand(width)

        def aten():
            dx = torch.ops.aten.gelu_backward(dy, x + b)
            return [dx, dx.float().sum(0).to(b.dtype)]
        return (lambda: list(ops.bias_gelu_bwd(dy, x, b, "none"))), aten, (lambda: list(py.bias_gelu_bwd(dy, x, b))), []
    if op in ("batch_norm_act", "batch_norm_act_bwd"):
        # (N, C, H, W) with N*H*W = rows values per channel and C = width channels.
        bn_shape = (2, width, 2, 2) if rows == TINY[0] else (16, width, 16, 16)
        x, w, b = rand(*bn_shape), rand(width), rand(width)
        if op == "batch_norm_act":
            def aten():
                return [torch.relu(F.batch_norm(x, None, None, w, b, training=True, eps=eps))]
            return (lambda: [ops.batch_norm_act(x, w, b, eps, True)[0]]), aten, \
                (lambda: [py.batch_norm_act(x, w, b, eps, True)[0]]), [x, w, b]
        dout = rand(*bn_shape)
        _, mean, rstd = ops.batch_norm_act(x, w, b, eps, True)
        out, save_mean, save_invstd = torch.native_batch_norm(x, w, b, None, None, True, 0.0, eps)
        out = torch.relu(out)

        def aten():  # autograd's ReLU backward (from the saved output), then BatchNorm's backward
            dy = torch.ops.aten.threshold_backward(dout, out, 0)
            return list(torch.ops.aten.native_batch_norm_backward(dy, x, w, None, None, save_mean, save_invstd, True,
                                                                  eps, [True, True, True]))
        return (lambda: list(ops.batch_norm_act_bwd(dout, x, w, b, mean, rstd, True))), aten, \
            (lambda: list(py.batch_norm_act_bwd(dout, x, w, b, mean, rstd, True))), []
    if op == "linear_sub":
        y, a, weight, b = rand(rows, width), rand(rows, width), rand(width, width, scale=width ** -0.5), rand(width)
        return (lambda: [ops.linear_sub(y, a, weight, b)]), (lambda: [y - F.linear(a, weight, b)]), \
            (lambda: [py.linear_sub(y, a, weight, b)]), [y, a, weight, b]
    raise ValueError(f"unknown op {op!r}")


def _with_grad(fn, inputs):
    """fn's forward + backward of the sum of its outputs, grads returned (not accumulated)."""
    def call():
        outs = fn()
        loss = outs[0].sum()
        for out in outs[1:]:
            loss = loss + out.sum()
        return torch.autograd.grad(loss, inputs)
    return call


def per_call_us(fns, device, reps, inner, warmup):
    """Median us per call of each of `fns`: `reps` samples each (a sample: the mean time of `inner`
    back-to-back calls) after `warmup` calls each. The functions' samples are taken in turn, so a
    drift in the machine's speed during the measurement (memory bandwidth shared with other
    tenants, pages promoted to huge pages) reaches all of them alike, not the one measured last;
    each sample follows an untimed call of its own function, so it finds the caches as a run of
    that function alone leaves them, not as the previous function left them."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    synchronize(device)
    samples = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, samples):
            fn()
            synchronize(device)
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            synchronize(device)
            out.append((time.perf_counter() - start) / inner * 1e6)
    return [statistics.median(s) for s in samples]


def op_points(ops=OPS):
    """(op, case, dtype, shape, threads) of the op table."""
    points = []
    for op in ops:
        points.append((op, "tiny", torch.float32, TINY, TINY_THREADS))
        if "_bwd" not in op:  # the backward ops have no autograd formula
            points.append((op, "tiny_grad", torch.float32, TINY, TINY_THREADS))
        for dtype in (torch.float32, torch.bfloat16):
            points.append((op, "throughput", dtype, LARGE, LARGE_THREADS))
    return points


def measure_op(op, case, dtype, shape, threads, device, reps):
    grad = case == "tiny_grad"
    fused, aten, wrapper, inputs = _op_cases(op, shape, dtype, device)
    if grad:
        for t in inputs:
            t.requires_grad_()
        fused, aten, wrapper = (_with_grad(fn, inputs) for fn in (fused, aten, wrapper))
    tiny = case.startswith("tiny")
    # Tiny: many back-to-back calls per sample (host cost); throughput: one call per sample on CPU,
    # several on CUDA (a launch is long against the kernel there).
    inner = 50 if tiny else (20 if device.type == "cuda" else 1)
    warmup = 20 if tiny else 2
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = per_call_us([fused, aten, wrapper] if tiny else [fused, aten], device, reps, inner, warmup)
    finally:
        torch.set_num_threads(previous_threads)
    size = "x".join(map(str, (2, shape[1], 2, 2) if shape == TINY else (16, shape[1], 16, 16))) \
        if op.startswith("batch_norm") else f"{shape[0]}x{shape[1]}"
    return {"op": op, "case": case, "dtype": str(dtype).replace("torch.", ""), "size": size,
            "fused_us": round(times[0], 3), "aten_us": round(times[1], 3), "ratio": round(times[1] / times[0], 3),
            "wrapper_us": round(times[2], 3) if tiny else "", "threads": threads}


# --- command line -----------------------------------------------------------------------------------

def parse_args(argv=None, default_out=DEFAULT_OUT):
    parser = argparse.ArgumentParser(prog="python -m revkernels.bench.overhead", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to run on (default: cuda if available, else cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, the same shapes (~25 s on 2 CPU cores)")
    parser.add_argument("--configs", nargs="*", choices=list(CONFIGS), default=list(CONFIGS),
                        help="train-step configurations (default: all; none: skip the train steps)")
    parser.add_argument("--variants", nargs="+", metavar="VARIANT",
                        help=f"train-step variants (default: all: {', '.join(variants())})")
    parser.add_argument("--ops", nargs="*", metavar="OP", help=f"ops of the op table (default: all: {', '.join(OPS)}; "
                        "none: skip the table)")
    parser.add_argument("--compile-variants", nargs="*", metavar="VARIANT", choices=COMPILE_VARIANTS,
                        help=f"compile time of a 12-block ViT-S for these variants (default: all: "
                        f"{', '.join(COMPILE_VARIANTS)}; none with --quick)")
    parser.add_argument("--compile-child", choices=COMPILE_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=int, help="warm-up steps per variant, the first timed alone (default 3, 2 with --quick)")
    parser.add_argument("--rounds", type=int, help="timed rounds of one step per variant (default: host_bound 30, "
                        "compute_bound 10; 10 and 3 with --quick)")
    parser.add_argument("--op-reps", type=int, help="timing samples per op and implementation (default 15, 5 with --quick)")
    parser.add_argument("--out", default=default_out, help=f"folder for CSV and PNG (default: {default_out})")
    args = parser.parse_args(argv)
    check_out_folder(parser, args.out)
    check_device(parser, args.device)
    unknown = [v for v in args.variants or [] if v not in variants()]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(variants())})")
    unknown = [op for op in args.ops or [] if op not in OPS]
    if unknown:
        parser.error(f"--ops: unknown {', '.join(unknown)} (choose from {', '.join(OPS)})")
    for name in ("warmup", "rounds", "op_reps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def selected_variants(args):
    """The variants `args` asks for: --variants, else all (standard_compile only without --quick)."""
    if args.variants:
        return [v for v in variants() if v in args.variants]
    return [v for v in variants() if not (args.quick and v == "standard_compile")]


def selected_compile_variants(args):
    """The compile-time variants `args` asks for: --compile-variants, else all (none with --quick)."""
    if args.compile_variants is not None:
        return [v for v in COMPILE_VARIANTS if v in args.compile_variants]
    return [] if args.quick else list(COMPILE_VARIANTS)


def _fmt(value, spec):
    return format(value, spec) if isinstance(value, float) and math.isfinite(value) else "n/a"


def keep_freed_memory():
    """Tells glibc's malloc to keep freed memory for reuse (no trimming, no mmap per large block):
    otherwise whether a large tensor lands on fresh pages, whose first-touch faults can cost more
    than the kernel timed, depends on what ran before it (a 4096 x 768 fp32 output faulted 6112
    pages in one call and none in the next). Returns whether it applied (glibc only); the setting
    stays for the rest of the process."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    # 32 MiB: glibc's largest mmap threshold on 64-bit (above it, a block is always mmapped)
    return bool(mallopt(m_trim_threshold, 2**31 - 1)) and bool(mallopt(m_mmap_threshold, 32 * 2**20))


def run(args):
    """Measures, prints the tables, writes overhead_<device>.csv, overhead_ops_<device>.csv and
    overhead_<device>.png under args.out; returns the step rows followed by the op rows."""
    device = torch.device(args.device)
    tag = device.type
    reused = tag == "cpu" and keep_freed_memory()
    meta = provenance(args.device)
    names = selected_variants(args)
    compile_names = selected_compile_variants(args)
    ops = OPS if args.ops is None else [op for op in OPS if op in args.ops]
    warmup = args.warmup or (2 if args.quick else 3)
    rounds = {name: args.rounds or ((10 if args.quick else 30) if name == "host_bound" else (3 if args.quick else 10))
              for name in args.configs}
    op_reps = args.op_reps or (5 if args.quick else 15)
    print(f"host-overhead benchmark on {meta['device']} ({'bf16 autocast' if tag == 'cuda' else 'fp32'}), "
          f"torch {meta['torch']}, commit {meta['commit']}", flush=True)
    os.makedirs(args.out, exist_ok=True)

    if reused:
        print("glibc malloc keeps freed memory for reuse (see keep_freed_memory)", flush=True)
    error = check_plain_grads(CONFIGS["host_bound"], device)
    print(f"baseline check: reversible_plain grads vs revkernels' autograd engine (same weights, host_bound "
          f"shapes): max relative error {error:.1e} (limit {GRAD_CHECK_TOL:.0e})", flush=True)

    progress = tqdm(total=sum(len(names) + rounds[c] for c in args.configs) + len(op_points(ops)) + len(compile_names),
                    desc="overhead",
                    unit="step", file=sys.stderr, leave=False)
    step_rows = []
    for name in args.configs:
        step_rows += measure_config(name, CONFIGS[name], names, device, warmup, rounds[name], progress)
    op_rows = []
    for point in op_points(ops):
        progress.set_postfix_str(f"{point[0]} {point[1]} {str(point[2]).replace('torch.', '')}")
        op_rows.append(measure_op(*point, device, op_reps))
        progress.update()
    compile_rows = []
    for variant in compile_names:
        progress.set_postfix_str(f"compile time {variant} (empty inductor cache)")
        compile_rows.append({k: (round(v, 4) if isinstance(v, float) else v)
                             for k, v in measure_compile(variant, device).items()})
        progress.update()
    progress.close()

    _print_steps(step_rows)
    _print_ops(op_rows)
    _print_compile(compile_rows)
    written = []
    if step_rows:
        written.append(write_csv(os.path.join(args.out, f"overhead_{tag}.csv"), step_rows, meta))
        png = plot(os.path.join(args.out, f"overhead_{tag}.png"), step_rows, meta)
        if png:
            written.append(png)
    if op_rows:
        written.append(write_csv(os.path.join(args.out, f"overhead_ops_{tag}.csv"), op_rows, meta))
    if compile_rows:
        written.append(write_csv(os.path.join(args.out, f"overhead_compile_{tag}.csv"), compile_rows, meta))
    print("\nwrote " + ", ".join(written) if written else "\nnothing measured (no --configs, --ops or "
          "--compile-variants selected): nothing written", flush=True)
    return step_rows + op_rows + compile_rows


def _print_steps(rows):
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        cfg = mine[0]
        print(f"\n{name}: depth {cfg['depth']}, dim {cfg['dim']}, {cfg['heads']} heads, {cfg['tokens']} tokens, "
              f"batch {cfg['batch']}, {cfg['threads']} thread(s), {cfg['dtype']}; median of {cfg['steps']} steps "
              "(speed vs baseline: > 1 is faster)")
        print(f"{'variant':<34} {'step ms':>9} {'first ms':>9} {'compile s':>9} {'vs standard':>12} "
              f"{'vs plain':>9} {'vs ckpt':>8} {'vs std compiled':>16}")
        for r in mine:
            print(f"{r['variant']:<34} {_fmt(r['step_ms'], '9.2f'):>9} {_fmt(r['first_step_ms'], '9.1f'):>9} "
                  f"{_fmt(r['compile_s'], '9.2f') if r['compile_s'] != '' else '':>9} "
                  f"{_speed(r['vs_standard']):>12} {_speed(r['vs_reversible_plain']):>9} "
                  f"{_speed(r['vs_checkpoint']):>8} {_speed(r['vs_standard_compile']):>16}")


def _speed(value):
    """A speed ratio as "1.23x", or "n/a" where its baseline was not measured."""
    text = _fmt(value, ".2f")
    return text if text == "n/a" else text + "x"


def _print_ops(rows):
    if not rows:
        return
    print("\nfused ops against the ATen op or composition they replace (us per call, median; ratio = aten/fused, "
          "> 1: fused is faster)")
    print(f"{'op':<20} {'case':<11} {'dtype':<9} {'size':<14} {'fused us':>10} {'aten us':>10} {'ratio':>7} {'wrapper us':>11}")
    for r in rows:
        wrapper = f"{r['wrapper_us']:11.2f}" if r["wrapper_us"] != "" else ""
        print(f"{r['op']:<20} {r['case']:<11} {r['dtype']:<9} {r['size']:<14} {r['fused_us']:10.2f} "
              f"{r['aten_us']:10.2f} {r['ratio']:6.2f}x {wrapper}")


def _print_compile(rows):
    if not rows:
        return
    cfg = rows[0]
    print(f"\ncompile time, empty inductor cache: depth {cfg['depth']}, dim {cfg['dim']}, {cfg['heads']} heads, "
          f"{cfg['tokens']} tokens, batch {cfg['batch']}, {cfg['threads']} threads")
    print(f"{'variant':<34} {'compile s':>10} {'first ms':>10} {'step ms':>9}")
    for r in rows:
        print(f"{r['variant']:<34} {_fmt(r['compile_s'], '10.1f')} {_fmt(r['first_step_ms'], '10.0f')} "
              f"{_fmt(r['step_ms'], '9.1f')}")


def summary(rows):
    """The suite's headline lines from run()'s rows."""
    steps = [r for r in rows if "variant" in r and r["config"] != COMPILE_CONFIG_NAME]
    lines = []
    for name in dict.fromkeys(r["config"] for r in steps):
        mine = {r["variant"]: r for r in steps if r["config"] == name}
        cells = [f"{v} {_fmt(mine[v]['step_ms'], '.2f')} ms (speed vs reversible_plain "
                 f"{_fmt(mine[v]['vs_reversible_plain'], '.2f')}x, vs standard {_fmt(mine[v]['vs_standard'], '.2f')}x)"
                 for v in ("revkernels_sequential", "revkernels_generic_sequential") if v in mine]
        cells += [f"{v} {_fmt(mine[v]['step_ms'], '.2f')} ms (speed vs float streams "
                  f"{_fmt(mine[v]['vs_float_streams'], '.2f')}x)"
                  for v in ("revkernels_exact_sequential",) if v in mine]
        if cells:
            lines.append(f"{name}: " + "; ".join(cells))
    compile_rows = [r for r in rows if r.get("config") == COMPILE_CONFIG_NAME]
    if compile_rows:
        lines.append("ViT-S compile time (empty inductor cache): "
                     + ", ".join(f"{r['variant']} {_fmt(r['compile_s'], '.1f')} s" for r in compile_rows))
    tiny = [r for r in rows if r.get("case") == "tiny"]
    if tiny:
        geo = math.exp(statistics.fmean(math.log(r["ratio"]) for r in tiny))
        lines.append(f"fused ops at 8x64 (no grad), aten/fused per call: geometric mean {geo:.2f}x, "
                     + ", ".join(f"{r['op']} {r['ratio']:.2f}x" for r in tiny))
    return lines or ["no complete measurement"]


def plot(path, rows, meta):
    """Step time per variant, one bar chart per configuration (dashed: reversible_plain, dotted:
    standard); None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(7 * len(configs), 5), squeeze=False)
    for ax, name in zip(axes[0], configs):
        mine = [r for r in rows if r["config"] == name]
        values = [r["step_ms"] if isinstance(r["step_ms"], float) and math.isfinite(r["step_ms"]) else 0.0 for r in mine]
        colors = [COLORS["generic" if "generic" in r["variant"] else "revvit" if r["engine"] else "baseline"]
                  for r in mine]
        ax.bar(range(len(mine)), values, color=colors)
        for variant, style in (("standard", ":"), ("reversible_plain", "--")):
            base = next((v for r, v in zip(mine, values) if r["variant"] == variant and v > 0), None)
            if base is not None:
                ax.axhline(base, color="black", linestyle=style, linewidth=0.8, label=variant)
        for kind, label in (("baseline", "baselines"), ("revvit", "RevViTBlock"), ("generic", "generic ReversibleBlock")):
            ax.bar([0], [0], color=COLORS[kind], label=label)
        ax.set_ylim(0, max(values + [1e-3]) * 1.3)  # room for the legend above the bars
        ax.legend(fontsize=7, ncol=3, loc="upper center")
        ax.set_xticks(range(len(mine)), [r["variant"].replace("revkernels_", "rk_") for r in mine], rotation=60,
                      ha="right", fontsize=7)
        ax.set_ylabel("median train step (ms)")
        r = mine[0]
        ax.set_title(f"{name}: depth {r['depth']}, dim {r['dim']}, {r['tokens']} tokens, batch {r['batch']}, "
                     f"{r['threads']} thread(s)", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{meta['device']} | torch {meta['torch']} | commit {meta['commit']}", fontsize=9)
    return save_figure(fig, path)


def main(argv=None, default_out=DEFAULT_OUT):
    args = parse_args(argv, default_out)
    if args.compile_child:
        _compile_child(args.compile_child, torch.device(args.device))
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
