"""README results from the committed benchmark CSVs: markdown tables, regenerated, never typed.

    python benchmarks/readme_tables.py            # rewrites README.md between the results markers
    python benchmarks/readme_tables.py --print    # prints the tables instead

Reads ``benchmarks/results/kernels_cuda.csv`` (bench_kernels.py) and ``train_cuda.csv``
(bench_train.py) where present; each table is headed by the commit, GPU, torch and triton versions
its CSV recorded. Ratios are computed here from the medians in the CSV, against baselines measured
in the same run. The host-overhead tables (bench_overhead.py: ``overhead_<device>.csv`` and
``overhead_ops_<device>.csv``, CPU then CUDA where present) go between their own markers, with the
issues' CPU step targets (revkernels/bench/targets.py, read by path: no torch needed) after the CPU
step table, followed by the host-time profiles of profile_overhead.py (``profile_<config>_<device>.csv``).
"""
import argparse
import csv
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
BEGIN, END = "<!-- results:begin (benchmarks/readme_tables.py) -->", "<!-- results:end -->"
OVERHEAD_BEGIN, OVERHEAD_END = "<!-- overhead-table:start -->", "<!-- overhead-table:end -->"
FORWARD_OPS = ("coupling_sub", "sub_layer_norm", "bias_gelu")
BACKWARD_OPS = ("layer_norm_bwd_add", "bias_gelu_bwd")
TARGET_PCT = {**{op: 85 for op in FORWARD_OPS}, **{op: 70 for op in BACKWARD_OPS}}


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
    return f"commit `{r['commit']}`, {r['device']}, torch {r['torch']}, triton {r['triton']}, {r['date']}"


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
             "| op | " + " | ".join(impls) + " | best fused, % of copy (target) | vs eager | vs torch.compile |",
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
        if op in TARGET_PCT:
            pct = _num(best["gb_per_s"]) / _num(best["copy_gb_per_s"]) * 100
            met = "met" if pct >= TARGET_PCT[op] else "missed"
            pct_cell = f"{pct:.0f}% ({best['impl']}; >= {TARGET_PCT[op]}%: {met})"
        else:
            pct_cell = "GEMM, no target"
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


def _bench_module(name):
    """revkernels/bench/<name>.py (targets, helptext), loaded by path: those need only the standard
    library, where importing the revkernels package would load torch."""
    path = os.path.join(ROOT, "revkernels", "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"revkernels_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def target_table(steps):
    """The issues' CPU step targets (`revkernels.bench.targets`) as this run met them, with the
    spread of each ratio over the run's rounds."""
    targets_module = _bench_module("targets")
    targets = targets_module.target_rows(steps)
    if not targets:
        return []
    lines = ["", "The issues' CPU step targets in this run (speed = baseline ms / variant ms, the ratio of the "
             "medians above; q1-q3: first and third quartile of the ratio over the run's rounds, each round "
             "timing every variant once):", "",
             "| configuration | variant | against | speed | q1-q3 | target | |", "|---|---|---|---|---|---|---|"]
    for t in targets:
        speed, spread = targets_module.format_ratio(t["speed"]), targets_module.format_spread(t["q1"], t["q3"])
        lines.append(f"| {t['config']} | `{t['variant']}` | {t['baseline']} | {speed} | {spread} | >= {t['target']} | "
                     f"{t['status']} |")
    return lines


def overhead_tables(steps, ops, compiles=(), targets=False):
    """Step time per variant and configuration with speed ratios against the baselines of the same
    run (and, with `targets`, the issues' CPU step targets), the compile times of a ViT-S, and each
    fused op against its ATen composition."""
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
        if targets:
            lines += target_table(steps)
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


PROFILE_CONFIGS = ("host_bound", "compute_bound")
PROFILE_COLUMNS = (("gemm_attention", "GEMM + attention"), ("compiled_graphs", "compiled graphs"),
                   ("dynamo_entry", "Dynamo entry"), ("autograd_engine", "autograd engine"),
                   ("python_functions", "Python Functions"), ("revkernels_ops", "fused ops"),
                   ("other_aten", "other ATen"), ("other", "other"), ("python_untraced", "Python, untraced"))


def profile_table(rows):
    """Host time per category of the profiled steps (benchmarks/profile_overhead.py), ms per step."""
    r = rows[0]
    lines = [f"Where a `{r['config']}` step's host time goes (profiled, {r['steps']} steps per variant; ms per step "
             f"by self CPU time, categories in `revkernels/bench/host_profile.py`; the profiler's own cost per "
             f"event is included, so compare shares; {_provenance(rows)}):", "",
             "| variant | " + " | ".join(title for _, title in PROFILE_COLUMNS) + " | step (profiled) |",
             "|---" * (len(PROFILE_COLUMNS) + 2) + "|"]
    for r in rows:
        cells = [f"{_num(r[f'{key}_ms']):.2f}" for key, _ in PROFILE_COLUMNS]
        lines.append(f"| `{r['variant']}` | " + " | ".join(cells) + f" | {_num(r['step_ms_profiled']):.2f} |")
    return lines


def overhead_section(results=RESULTS):
    """The text between the overhead markers: the tables of every device with results."""
    lines = []
    for device in ("cpu", "cuda"):
        paths = [os.path.join(results, f"{name}_{device}.csv")
                 for name in ("overhead", "overhead_ops", "overhead_compile")]
        if any(os.path.exists(path) for path in paths):
            steps, ops, compiles = (read_csv(path) if os.path.exists(path) else [] for path in paths)
            lines += overhead_tables(steps, ops, compiles, targets=device == "cpu") + [""]
        for config in PROFILE_CONFIGS:
            path = os.path.join(results, f"profile_{config}_{device}.csv")
            if os.path.exists(path):
                lines += ["", *profile_table(read_csv(path)), ""]
    if not lines:
        lines = ["No results committed yet: `python benchmarks/bench_overhead.py` writes "
                 "`benchmarks/results/overhead_cpu.csv` and `overhead_ops_cpu.csv`; then run "
                 "`python benchmarks/readme_tables.py`."]
    return "\n".join(lines).rstrip() + "\n"


def tables(results=RESULTS):
    lines = []
    kernels = os.path.join(results, "kernels_cuda.csv")
    train = os.path.join(results, "train_cuda.csv")
    if os.path.exists(kernels):
        lines += kernel_tables(read_csv(kernels)) + [""]
    if os.path.exists(train):
        lines += train_tables(read_csv(train)) + [""]
    return "\n".join(lines).rstrip() + "\n"


def rewrite(readme, text, begin=BEGIN, end=END):
    with open(readme) as f:
        content = f.read()
    if begin not in content or end not in content:
        raise SystemExit(f"{readme} has no results markers ({begin} ... {end})")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(readme, "w") as f:
        f.write(head + begin + "\n" + text + end + tail)


def main(argv=None):
    parser = argparse.ArgumentParser(description=_bench_module("helptext").description(__doc__))
    parser.add_argument("--print", action="store_true", help="print the tables instead of rewriting README.md")
    parser.add_argument("--results", default=RESULTS, help="folder of the committed CSVs (default: benchmarks/results)")
    parser.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    args = parser.parse_args(argv)
    if not os.path.isdir(args.results):  # (missing CSVs read as "no results": every table would go)
        parser.error(f"--results {args.results!r} is not a folder of benchmark results")
    text, overhead = tables(args.results), overhead_section(args.results)
    if args.print:
        print(text + "\n" + overhead)
    else:
        rewrite(args.readme, text)
        rewrite(args.readme, overhead, OVERHEAD_BEGIN, OVERHEAD_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
