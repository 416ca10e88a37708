"""Results tables generated from the committed benchmark CSVs, never typed: the README's, the
documentation's (docs/*.md) and the provenance list of benchmarks/results/README.md.

    python benchmarks/readme_tables.py                 # rewrites every generated section
    python benchmarks/readme_tables.py --check         # exits 1 where a section is out of date
    python benchmarks/readme_tables.py --print memory  # prints one table

A generated section lies between ``<!-- table:NAME -->`` and ``<!-- table:end -->``; NAME is a key
of ``TABLES``. Each table reads the CSVs of ``benchmarks/results`` (``--results``) and is headed by
the commit, device and versions its CSV recorded; ratios are computed here from the CSV's medians,
against baselines measured in the same run. Standard library only: no torch needed.
"""
import argparse
import csv
import glob
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOCUMENTS = ("README.md", "docs/*.md", "benchmarks/results/README.md")  # where sections are looked for
BEGIN = "<!-- table:{} -->"
END = "<!-- table:end -->"
SECTION = re.compile(r"<!-- table:([a-z0-9-]+) -->\n.*?<!-- table:end -->", flags=re.S)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _num(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _ratio(a, b):
    a, b = _num(a), _num(b)
    return f"{a / b:.2f}x" if a == a and b == b and b else "n/a"


def _provenance(rows):
    r = rows[0]
    isa = f", C++ kernels {r['cpu_kernels']}" if r.get("cpu_kernels") and r["device"].startswith("CPU") else ""
    return f"commit `{r['commit']}`, {r['device']}, torch {r['torch']}, triton {r['triton']}{isa}, {r['date']}"


def kernel_tables(rows):
    """Per op at the largest size: GPU time and GB/s per implementation, % of copy bandwidth, ratios."""
    largest = max((int(r["rows"]) * int(r["width"]) for r in rows), default=0)
    at_largest = [r for r in rows if int(r["rows"]) * int(r["width"]) == largest]
    if not at_largest:
        return []
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fused = [i for i in impls if i not in ("eager", "compile")]
    sample = at_largest[0]
    timing = {"cudagraph": "GPU time by CUDA-graph replay", "events": "per-call time (host overhead included)"}
    timings = ", ".join(timing.get(t, t) for t in dict.fromkeys(r.get("timing", "events") for r in at_largest))
    lines = [f"Fused ops at {sample['rows']} x {sample['width']} {sample['dtype']} ({_provenance(rows)}; "
             f"{timings}; medians; copy bandwidth {_num(sample['copy_gb_per_s']):.0f} GB/s measured in the same "
             "run):", "",
             "| op | " + " | ".join(impls) + " | best fused, % of copy | vs eager | vs torch.compile |",
             "|---" * (len(impls) + 4) + "|"]
    ops = list(dict.fromkeys(r["op"] for r in at_largest))
    for op in ops:
        mine = {r["impl"]: r for r in at_largest if r["op"] == op}
        cells = []
        for impl in impls:
            r = mine.get(impl)
            if r is None:
                cells.append("")
                continue
            rate = f"{_num(r['gb_per_s']):.0f} GB/s" if r["gb_per_s"] else f"{_num(r['tflop_per_s']):.0f} TFLOP/s"
            cells.append(f"{_num(r['ms']) * 1e3:.0f} us, {rate}")
        best = min((mine[i] for i in fused if i in mine), key=lambda r: _num(r["ms"]))
        if _num(best["gb_per_s"]) == _num(best["gb_per_s"]):
            pct_cell = f"{_num(best['gb_per_s']) / _num(best['copy_gb_per_s']) * 100:.0f}% ({best['impl']})"
        else:
            pct_cell = f"GEMM ({best['impl']})"
        lines.append(f"| `{op}` | " + " | ".join(cells) + f" | {pct_cell} | {_ratio(mine['eager']['ms'], best['ms'])} | "
                     f"{_ratio(mine['compile']['ms'], best['ms']) if 'compile' in mine else 'n/a'} |")
    return lines


def _revnet_cell(row):
    transient = _num(row.get("transient_mib"))
    memory = f"{_num(row['peak_mib']):.0f}" + (f" / {transient:.0f}" if transient == transient else "")
    return f"{_num(row['images_per_s']):.0f} img/s, {memory} MiB"


def _compiled_lines(throughput):
    """A line per model and batch with `revkernels_compiled` against standard eager and
    standard_compile, and both compile times (first step - median), where the run measured them."""
    lines = []
    for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in throughput):
        mine = {r["variant"]: r for r in throughput if r["model"] == model and r["batch"] == batch}
        ours = mine.get("revkernels_compiled")
        if ours is None:
            continue
        seconds = {v: _num(mine[v].get("compile_s")) for v in ("revkernels_compiled", "standard_compile") if v in mine}
        compile_s = ", ".join(f"{v} {s:.1f} s" if s == s else f"{v} n/a" for v, s in seconds.items())
        eager, compiled = (mine.get(v, {}).get("ms") for v in ("standard", "standard_compile"))
        lines.append(f"- {model} batch {batch}: `revkernels_compiled` {_ratio(eager, ours['ms'])} standard eager, "
                     f"{_ratio(compiled, ours['ms'])} standard compiled; compile time (first step - median step): "
                     f"{compile_s}")
    return ["", "Compiled steps (speed, > 1 is faster):", ""] + lines if lines else []


def train_tables(rows):
    lines = []
    throughput = [r for r in rows if r["kind"] == "throughput"]
    if throughput:
        variants = list(dict.fromkeys(r["variant"] for r in throughput))
        lines += [f"Train step, ms (median; bf16 autocast, AdamW; {_provenance(rows)}). Last columns: "
                  "`revkernels_graphs` speed against each baseline (> 1 is faster):", "",
                  "| model | batch | " + " | ".join(variants) + " | graphs vs standard eager | vs standard graphed | "
                  "vs standard compiled | vs reversible plain |", "|---" * (len(variants) + 6) + "|"]
        for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in throughput):
            mine = {r["variant"]: r for r in throughput if r["model"] == model and r["batch"] == batch}
            ours = mine.get("revkernels_graphs", {}).get("ms")
            cells = [f"{_num(mine[v]['ms']):.1f}" if v in mine else "" for v in variants]
            ratios = [_ratio(mine.get(v, {}).get("ms"), ours) for v in
                      ("standard", "standard_graphs", "standard_compile", "reversible_plain")]
            lines.append(f"| {model} | {batch} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
        lines += _compiled_lines(throughput)
    revnet = [r for r in rows if r["kind"] == "revnet"]
    if revnet:
        engines = list(dict.fromkeys(r["variant"] for r in revnet))
        lines += ["", "RevNets (images/s; step peak [/ transient] memory in MiB; ratios against `autograd` in the "
                  "same run):", "",
                  "| model | batch | " + " | ".join(engines) + " | best engine speed vs autograd | "
                  "transient memory vs autograd |", "|---" * (len(engines) + 4) + "|"]
        for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in revnet):
            mine = {r["variant"]: r for r in revnet if r["model"] == model and r["batch"] == batch}
            cells = [_revnet_cell(mine[e]) if e in mine else "" for e in engines]
            others = [mine[e] for e in engines if e != "autograd" and e in mine and _num(mine[e]["ms"]) == _num(mine[e]["ms"])]
            base = mine.get("autograd")
            if base and others:
                best = min(others, key=lambda r: _num(r["ms"]))
                lean = min(others, key=lambda r: _num(r.get("transient_mib")))
                speed = f"{_ratio(base['ms'], best['ms'])} ({best['variant']})"
                ratio = _ratio(base.get("transient_mib"), lean.get("transient_mib"))
                memory = f"{ratio} less ({lean['variant']})" if ratio != "n/a" else "not measured"
            else:
                speed = memory = "n/a"
            lines.append(f"| {model} | {batch} | " + " | ".join(cells) + f" | {speed} | {memory} |")
    sweep = [r for r in rows if r["kind"] == "depth_sweep"]
    if sweep:
        variants = list(dict.fromkeys(r["variant"] for r in sweep))
        lines += ["", "Peak memory of a step (MiB) by depth, ViT-B width, batch 32:", "",
                  "| depth | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for depth in dict.fromkeys(r["depth"] for r in sweep):
            mine = {r["variant"]: r for r in sweep if r["depth"] == depth}
            lines.append(f"| {depth} | " + " | ".join(f"{_num(mine[v]['peak_mib']):.0f}" if v in mine else ""
                                                      for v in variants) + " |")
    return lines


def _config_line(rows):
    r = rows[0]
    return (f"depth {r['depth']}, dim {r['dim']}, {r['heads']} heads, {r['tokens']} tokens, batch {r['batch']}, "
            f"{r['threads']} thread{'s' if r['threads'] != '1' else ''}; median of {r['steps']} steps")


def overhead_tables(steps, ops, compiles=()):
    """Step time per variant and configuration with speed ratios against the baselines of the same
    run, the compile times of a ViT-S, and each fused op against its ATen composition."""
    lines = []
    if steps:
        configs = list(dict.fromkeys(r["config"] for r in steps))
        by = {(r["config"], r["variant"]): r for r in steps}
        variants = list(dict.fromkeys(r["variant"] for r in steps))
        lines += [f"Train step (forward + backward), ms, median after warm-up, {steps[0]['dtype']} "
                  f"({_provenance(steps)}); speed against baselines of the same run (> 1 is faster):", ""]
        lines += [f"- `{c}`: {_config_line([r for r in steps if r['config'] == c])}" for c in configs] + [""]
        bases = ["standard", "reversible_plain", "checkpoint"] + ["standard_compile"] * ("standard_compile" in variants)
        header, rule = "| variant |", "|---|"
        for c in configs:
            header += f" {c} ms | " + " | ".join(f"vs {b.replace('_compile', ' compiled')}" for b in bases) + " |"
            rule += "---|" * (1 + len(bases))
        lines += [header, rule]
        for v in variants:
            cells = []
            for c in configs:
                r = by.get((c, v))
                if r is None:
                    cells += [""] * (1 + len(bases))
                    continue
                ms = _num(r["step_ms"])
                cell = f"{ms:.2f}" if ms == ms else "failed"
                if r.get("compile_s"):
                    cell += f" (compile {_num(r['compile_s']):.1f} s)"
                cells += [cell] + [_ratio(by.get((c, b), {}).get("step_ms"), r["step_ms"])
                                   for b in bases]
            lines.append(f"| `{v}` | " + " | ".join(cells) + " |")
    if compiles:
        r = compiles[0]
        lines += (["", ""] if lines else []) + [
            f"Compile time of a {r['depth']}-block ViT-S (dim {r['dim']}, {r['heads']} heads, {r['tokens']} tokens, "
            f"batch {r['batch']}, {r['threads']} threads, {r['dtype']}), each variant in a fresh process with an "
            f"empty inductor cache: first step - median of the next steps ({_provenance(compiles)}):", "",
            "| variant | compile s | first step ms | step ms |", "|---|---|---|---|"]
        for r in compiles:
            lines.append(f"| `{r['variant']}` | {_num(r['compile_s']):.1f} | {_num(r['first_step_ms']):.0f} | "
                         f"{_num(r['step_ms']):.1f} |")
    if ops:
        columns = list(dict.fromkeys((r["case"], r["dtype"]) for r in ops))
        names = {"tiny": "no grad", "tiny_grad": "fwd + bwd of the sum", "throughput": "one call"}
        sizes = {col: next(r["size"] for r in ops if (r["case"], r["dtype"]) == col and not r["op"].startswith("batch_norm"))
                 for col in columns}
        lines += (["", ""] if lines else []) + [
            f"Fused ops (`torch.ops.revkernels.*`) against the ATen op or composition they replace: fused / ATen "
            f"time, median (ratio ATen/fused: > 1, the fused op is faster; {_provenance(ops)}). BatchNorm ops "
            "run on N x C x H x W with 4096 (8) values per channel for 4096 (8) rows. The last column is the "
            "Python entry point `revkernels.ops.<op>` (argument checks included):", "",
            "| op | " + " | ".join(f"{sizes[c]} {c[1]}, {names.get(c[0], c[0])}" for c in columns)
            + " | Python entry, no grad |", "|---" * (len(columns) + 2) + "|"]
        for op in dict.fromkeys(r["op"] for r in ops):
            mine = {(r["case"], r["dtype"]): r for r in ops if r["op"] == op}
            cells = []
            for col in columns:
                r = mine.get(col)
                if r is None:
                    cells.append("n/a")
                    continue
                fused, aten = _num(r["fused_us"]), _num(r["aten_us"])
                unit, scale = ("ms", 1e-3) if col[0] == "throughput" else ("us", 1.0)
                cells.append(f"{fused * scale:.3g} / {aten * scale:.3g} {unit} ({_ratio(aten, fused)})")
            tiny = mine.get(("tiny", "float32"))
            cells.append(f"{_num(tiny['wrapper_us']):.3g} us" if tiny and tiny.get("wrapper_us") else "")
            lines.append(f"| `{op}` | " + " | ".join(cells) + " |")
    return lines


def memory_table(rows):
    """The memory part (`train_step_<device>.csv`): per depth and engine, the step time, the
    activations saved for backward and the step's peak memory, with ratios against `autograd`."""
    r = rows[0]
    lines = [f"Train step of a stack of reversible MLP blocks, {r['rows']} rows x width {r['width']}, {r['dtype']} "
             f"({_provenance(rows)}; medians):", "",
             "| depth | engine | step ms | saved for backward, MiB | peak, MiB | time vs autograd | saved: autograd / engine "
             "| peak: autograd / engine |", "|---|---|---|---|---|---|---|---|"]
    for depth in dict.fromkeys(r["depth"] for r in rows):
        mine = {r["engine"]: r for r in rows if r["depth"] == depth}
        base = mine.get("autograd", {})
        for engine, r in mine.items():
            lines.append(f"| {depth} | `{engine}` | {_num(r['step_ms']):.0f} | {_num(r['saved_mib']):.1f} | "
                         f"{_num(r['peak_mib']):.0f} | {_ratio(r['step_ms'], base.get('step_ms'))} | "
                         f"{_ratio(base.get('saved_mib'), r['saved_mib'])} | {_ratio(base.get('peak_mib'), r['peak_mib'])} |")
    return lines


def gpu_train_table(rows):
    """The train part's transformer steps (`train_<device>.csv`), one row per variant: per model and
    batch the step time, the speed against standard eager training and the step's peak memory."""
    throughput = [r for r in rows if r["kind"] == "throughput"]
    if not throughput:
        return []
    shapes = list(dict.fromkeys((r["model"], r["batch"]) for r in throughput))
    by = {(r["model"], r["batch"], r["variant"]): r for r in throughput}
    r = throughput[0]
    lines = [f"Train step of {r['model']} ({r['depth']} blocks; bf16 autocast, AdamW; {_provenance(rows)}; medians). "
             "Speed: standard eager ms / variant ms, > 1 is faster:", "",
             "| variant | " + " | ".join(f"{m} batch {b}: ms | speed | peak MiB" for m, b in shapes) + " |",
             "|---" * (1 + 3 * len(shapes)) + "|"]
    for variant in dict.fromkeys(r["variant"] for r in throughput):
        cells = []
        for model, batch in shapes:
            mine, base = by.get((model, batch, variant)), by.get((model, batch, "standard"), {})
            if mine is None:
                cells += ["", "", ""]
                continue
            cells += [f"{_num(mine['ms']):.1f}", _ratio(base.get("ms"), mine["ms"]), f"{_num(mine['peak_mib']):.0f}"]
        lines.append(f"| `{variant}` | " + " | ".join(cells) + " |")
    return lines


DRIFT_MODES = {"fp32": "fp32", "autocast_bf16": "fp32 streams, bf16 autocast",
               "autocast_fp16": "fp32 streams, fp16 autocast", "bf16_streams": "bf16 streams and weights"}


def drift_table(rows):
    """`benchmarks/bench_drift.py` (`drift_<device>.csv`): the relative error of a block input rebuilt
    from the run's output, worst (median) over the seeds, per precision and depth."""
    r = rows[0]
    depths = list(dict.fromkeys(r["depth"] for r in rows))
    # (streams: "float", or "exact" for exact mode's fixed-point streams; older files have float only)
    by = {(r["mode"], r.get("streams", "float"), r["depth"]): r for r in rows}
    lines = [f"Relative max-abs error of a block input rebuilt from the run's output, `RevViTBlock(dim {r['dim']}, "
             f"heads {r['heads']})` stacks, {r['tokens']} tokens, batch {r['batch']}, worst (median) of {r['seeds']} "
             f"seeds ({_provenance(rows)}):", "",
             "| precision | streams | " + " | ".join(f"depth {d}" for d in depths) + " |",
             "|---" * (2 + len(depths)) + "|"]
    for mode, streams in dict.fromkeys((r["mode"], r.get("streams", "float")) for r in rows):
        cells = [f"{_num(by[mode, streams, d]['chained_max']):.1e} ({_num(by[mode, streams, d]['chained_median']):.1e})"
                 if (mode, streams, d) in by else "" for d in depths]
        label = "exact (int64)" if streams == "exact" else "float"
        lines.append(f"| {DRIFT_MODES.get(mode, mode)} | {label} | " + " | ".join(cells) + " |")
    return lines


def budget_table(rows):
    """`benchmarks/bench_budget.py` (`budget_<device>.csv`): step time against measured memory, the
    revkernels budgets and the baselines of the same run: the eager rows, then (``--compiled``)
    the compiled ones."""
    eager = [r for r in rows if r["group"] == "eager"]
    compiled = [r for r in rows if r["group"] == "compiled"]
    if not eager:
        return []
    lines = [f"Train step (forward + backward) of a `RevViTBlock` stack ({eager[0]['config']}), median ms, the rows "
             f"timed in rounds; saved: what the forward leaves alive for the backward, measured "
             f"({_provenance(rows)}):", ""]
    for group, title in ((eager, "method"), (compiled, "under torch.compile (saved: the allocator's count)")):
        if group:
            lines += [f"| {title} | plan | saved, MiB | step ms |", "|---|---|---|---|"]
            lines += [f"| {r['method']} | {r['plan'] or ''} | {_num(r['saved_mib']):.2f} | {_num(r['step_ms']):.1f} |"
                      for r in group]
            lines.append("")
    return lines[:-1]


TEXT_MODELS = {"autograd": "reversible, `autograd`", "sequential": "reversible, `sequential`",
               "standard": "non-reversible, same layers"}


def text_table(rows):
    """`benchmarks/bench_text.py` (`text_<device>.csv`): a byte-level causal LM per depth and model."""
    r = rows[0]
    lines = [f"Byte-level causal LM (dim {r['dim']}, {r['heads']} heads, {r['tokens']} tokens x batch {r['batch']}, "
             f"{r['steps']} AdamW steps, dropout {r['dropout']}; {_provenance(rows)}):", "",
             "| depth | model | tokens/s | saved for backward, MiB | held-out loss | max abs(loss - autograd's) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        diff = _num(r["max_abs_loss_diff_vs_autograd"])
        lines.append(f"| {r['depth']} | {TEXT_MODELS.get(r['model'], r['model'])} | {_num(r['tokens_per_s']):.0f} | "
                     f"{_num(r['saved_mib']):.2f} | {_num(r['val_loss']):.4f} | {'' if diff != diff else f'{diff:.1e}'} |")
    return lines


def petra_table(rows):
    """The petra part (`petra_<device>.csv`): the distributed runtime against single-process
    reversible backprop, with the partition's bound (reversible backprop's time over the largest
    stage group's tick)."""
    r = rows[0]
    lines = [f"{r['model']} ({r['stem']} stem), {r['image_size']}x{r['image_size']} images, batch {r['batch']}, "
             f"{r['balance']}-balanced stage groups ({_provenance(rows)}; medians of {r['steps']} steps):", "",
             "| variant | processes x threads | stage groups | ms per batch | speed vs reversible backprop, 1 thread | "
             "vs its best | bound |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = f"{_num(r['bound']):.2f}x" if r.get("bound") else ""
        lines.append(f"| `{r['variant']}` | {r['processes']} x {r['threads']} | {r['groups'] or 'all'} | "
                     f"{_num(r['step_ms']):.1f} | {_num(r['speedup_vs_revbackprop_1thread']):.2f}x | "
                     f"{_num(r['speedup_vs_revbackprop_best']):.2f}x | {bound} |")
    return lines


def petra_accuracy_table(rows):
    """`benchmarks/bench_petra_accuracy.py` (`petra_digits_<device>.csv`): test accuracy per method,
    mean +- standard deviation over the seeds, and the mean cosine of the stages' gradients to the
    end-to-end gradient."""
    r = rows[0]
    lines = [f"{r['model']} ({r['stem']} stem) on {r['dataset']} ({r['image_size']}x{r['image_size']}), {r['epochs']} "
             f"epochs, batch {r['batch_size']}, k = {r['accum']}, base lr {r['base_lr']}; "
             f"{len(set(r['seed'] for r in rows))} seeds ({_provenance(rows)}):", "",
             "| method | test accuracy, % | gradient cosine to end-to-end |", "|---|---|---|"]
    for method in dict.fromkeys(r["method"] for r in rows):
        acc = [100 * _num(r["test_acc"]) for r in rows if r["method"] == method]
        cos = [_num(r["mean_cosine"]) for r in rows if r["method"] == method]
        spread = statistics.stdev(acc) if len(acc) > 1 else 0.0
        lines.append(f"| `{method}` | {statistics.mean(acc):.2f} +- {spread:.2f} | {statistics.mean(cos):.3f} |")
    return lines


def attention_table(rows):
    """`benchmarks/bench_attention.py` (`attention_<device>.csv`): a compiled attention forward + VJP,
    SDPA's flash kernel against the math formula, by sequence length."""
    r = rows[0]
    lines = [f"Compiled attention forward + VJP, {r['heads']} heads x {r['head_dim']}, {r['dtype']}, {r['threads']} "
             f"threads ({_provenance(rows)}; medians):", "",
             "| tokens | batch | flash us | math us | flash / math | revkernels takes |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['batch']} | {_num(r['flash_us']):.0f} | {_num(r['math_us']):.0f} | "
                     f"{_num(r['flash_over_math']):.2f}x | {r['revkernels_takes']} |")
    return lines


def _read(results, name):
    path = os.path.join(results, name)
    return read_csv(path) if os.path.exists(path) else []


def _overhead(results, suffix):
    steps, ops, compiles = (_read(results, f"{name}_{suffix}.csv") for name in ("overhead", "overhead_ops", "overhead_compile"))
    return overhead_tables(steps, ops, compiles)


def overhead_cuda(results):
    """The overhead part on CUDA, one run per CUDA backend (`overhead[_ops]_cuda_<backend>.csv`)."""
    lines = []
    for path in sorted(glob.glob(os.path.join(results, "overhead_cuda_*.csv"))):
        backend = os.path.basename(path)[len("overhead_cuda_"):-len(".csv")]
        tables = _overhead(results, f"cuda_{backend}")
        if tables:
            lines += (["", ""] if lines else []) + [f"With `REVKERNELS_CUDA_BACKEND={backend.replace('cudacpp', 'cuda')}`:",
                                                    ""] + tables
    return lines


PARTS = (  # file name prefix -> what wrote it, most specific first
    ("train_step_", "the memory part: `python -m revkernels.bench --parts memory`"),
    ("kernels_", "the kernels part: `python -m revkernels.bench --parts kernels`"),
    ("train_", "the train part: `python -m revkernels.bench --parts train`"),
    ("overhead_", "the overhead part: `python -m revkernels.bench --parts overhead`"),
    ("petra_digits_", "`python benchmarks/bench_petra_accuracy.py`"),
    ("petra_", "the petra part: `python -m revkernels.bench --parts petra`"),
    ("drift_", "`python benchmarks/bench_drift.py`"),
    ("budget_", "`python benchmarks/bench_budget.py`"),
    ("text_", "`python benchmarks/bench_text.py`"),
    ("attention_", "`python benchmarks/bench_attention.py`"))


def provenance_table(results):
    """Each committed CSV: what wrote it, and the commit, device, versions and date on its rows."""
    lines = ["| file | written by | commit | device | torch | triton | C++ kernels | date |",
             "|---|---|---|---|---|---|---|---|"]
    for path in sorted(glob.glob(os.path.join(results, "*.csv"))):
        name = os.path.basename(path)
        rows = read_csv(path)
        if not rows:
            continue
        r = rows[0]
        writer = next((what for prefix, what in PARTS if name.startswith(prefix)), "")
        plot = " (plot: `.png` beside it)" if os.path.exists(path[:-4] + ".png") else ""
        lines.append(f"| `{name}`{plot} | {writer} | `{r.get('commit', '')}` | {r.get('device', '')} | "
                     f"{r.get('torch', '')} | {r.get('triton', '')} | {r.get('cpu_kernels', '') or 'n/a'} | "
                     f"{r.get('date', '')} |")
    return lines


def _from(name, make):
    """A table made by `make` from the rows of CSV `name`; none where it is not committed."""
    return lambda results: make(rows) if (rows := _read(results, name)) else []


TABLES = {
    "memory": _from("train_step_cpu.csv", memory_table),
    "gpu-train": _from("train_cuda.csv", gpu_train_table),
    "train-cuda": _from("train_cuda.csv", train_tables),
    "kernels-cuda": _from("kernels_cuda.csv", kernel_tables),
    "overhead-cpu": lambda results: _overhead(results, "cpu"),
    "overhead-cuda": overhead_cuda,
    "drift": _from("drift_cpu.csv", drift_table),
    "budget": _from("budget_cpu.csv", budget_table),
    "text": _from("text_cpu.csv", text_table),
    "petra": _from("petra_cpu.csv", petra_table),
    "petra-accuracy": _from("petra_digits_cpu.csv", petra_accuracy_table),
    "attention": _from("attention_cpu.csv", attention_table),
    "provenance": provenance_table,
}


def table(name, results=RESULTS):
    """The text of generated section `name`, from the CSVs under `results`."""
    lines = TABLES[name](results)
    if not lines:
        return f"No results committed for `{name}` yet.\n"
    return "\n".join(lines).rstrip() + "\n"


def render(content, results=RESULTS, source="document"):
    """`content` with every generated section rewritten; an unknown NAME raises naming it."""
    def replace(match):
        name = match.group(1)
        if name not in TABLES:
            raise SystemExit(f"{source}: unknown generated table {name!r} (known: {', '.join(TABLES)})")
        return f"{BEGIN.format(name)}\n{table(name, results)}{END}"
    return SECTION.sub(replace, content)


def documents(root=ROOT):
    """The files that may hold generated sections."""
    return sorted(path for pattern in DOCUMENTS for path in glob.glob(os.path.join(root, pattern)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n", 1)[0].split()))
    parser.add_argument("--results", default=RESULTS, help="folder of the committed CSVs (default: benchmarks/results)")
    parser.add_argument("--root", default=ROOT, help="checkout whose README.md, docs/*.md and "
                        "benchmarks/results/README.md are rewritten (default: this one)")
    parser.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 naming each file whose "
                        "generated sections differ from what the CSVs give")
    parser.add_argument("--print", choices=sorted(TABLES), metavar="NAME", help="print one table: " + ", ".join(TABLES))
    args = parser.parse_args(argv)
    if not os.path.isdir(args.results):  # (missing CSVs would read as "no results": every table would go)
        parser.error(f"--results {args.results!r} is not a folder of benchmark results")
    if args.print:
        print(table(args.print, args.results), end="")
        return 0
    stale = []
    for path in documents(args.root):
        with open(path) as f:
            content = f.read()
        new = render(content, args.results, os.path.relpath(path, args.root))
        if new == content:
            continue
        stale.append(os.path.relpath(path, args.root))
        if not args.check:
            with open(path, "w") as f:
                f.write(new)
    if args.check and stale:
        print("out of date (run python benchmarks/readme_tables.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
