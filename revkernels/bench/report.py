"""Writing benchmark results: CSV with the run's provenance beside every figure, and PNG plots; the
device synchronisation every timed region starts and ends with, the timed calls themselves and the
memory a forward keeps for its backward."""
import csv
import ctypes
import ctypes.util
import datetime
import functools
import gc
import os
import platform
import subprocess
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

DEFAULT_OUT = "revkernels-bench"  # results folder of `python -m revkernels.bench` and its parts, under the cwd


def check_device(parser, device, flag="--device"):
    """`device` as a torch.device; an argparse error (exit status 2) naming `flag` for a string
    that is no device, a device the benchmarks do not run on (meta, mps, xpu, ...: meta tensors
    compute nothing, and their timings would be written as results) or a CUDA device without CUDA."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parser.error(f"{flag} {device!r}: not a device (cpu, cuda, cuda:1, ...)")
    if parsed.type not in ("cpu", "cuda"):
        parser.error(f"{flag} {device}: the benchmarks run on cpu or cuda, got a {parsed.type} device")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"{flag} {device}: CUDA is not available")
    return parsed


def check_out_folder(parser, path, flag="--out"):
    """An argparse error naming `flag` when `path` exists and is not a folder (found before any
    measuring, not when the results are written)."""
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path}: exists and is not a folder")


def synchronize(device):
    """Waits for `device`'s queued work (CUDA); nothing to wait for on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(step, device, calls):
    """The time of each of `calls` calls of `step` (ms), each timed alone between synchronisations
    of `device`."""
    times = []
    for _ in range(calls):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def parse_checked(parser, argv, counts=()):
    """``parser.parse_args(argv)``, with an argparse error for an ``--out`` that exists and is not a
    folder and for each option named in `counts` (attributes, ``--name`` on the command line) below 1."""
    args = parser.parse_args(argv)
    if getattr(args, "out", None) is not None:
        check_out_folder(parser, args.out)
    for name in counts:
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


class _Storages(TorchDispatchMode):
    # every storage an op outputs: {data_ptr: (weak reference, bytes)}
    def __init__(self, into):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                _note(self.into, t)
        return out


def _note(into, t):
    storage = t.untyped_storage()
    if storage.nbytes() and storage.device.type != "meta":
        into[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())


def retained_bytes(forward, exclude=()):
    """``(forward(), bytes)``: what the call leaves alive for the backward, each storage once (those of
    `exclude`, the parameters, aside): the storages autograd saves during it (a saved-tensor hook)
    and those its ops create (a dispatch mode), alive when it returns. That counts what a checkpoint
    keeps beside autograd (its inputs, selective checkpointing's cache, which no saved-tensor hook
    sees) and the returned outputs."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        _note(seen, t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Storages(seen):
        out = forward()
    gc.collect()
    return out, sum(size for ptr, (ref, size) in seen.items() if ptr not in skip and ref() is not None)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        raise RuntimeError("revkernels: allocated_bytes on CPU needs glibc's mallinfo2 (glibc >= 2.33)")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


def _in_use(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd  # heap chunks in use + mmap'd chunks (large tensors)


def allocated_bytes(forward, device):
    """``(forward(), bytes)``: how much more memory is in use on `device` after the call than before
    it, the result alive: the allocator's count (CUDA: ``memory_allocated``; CPU: glibc's heap in
    use), so it sees compiled code that a dispatch mode or a saved-tensor hook does not (Dynamo runs
    no compiled frame under a Python dispatch mode). On CPU it includes the Python and autograd
    objects the call leaves (some KB), which `retained_bytes` does not count."""
    device = torch.device(device)
    before = _in_use(device)
    out = forward()
    return out, _in_use(device) - before


def _git_commit(bench_dir=os.path.dirname(os.path.abspath(__file__))):
    """revkernels' commit where it runs from its own checkout (the folder holding the package is
    the top of a git work tree), else "unknown": a copy installed inside another project's
    repository (a .venv in the user's checkout) must not report that project's commit."""
    root = os.path.dirname(os.path.dirname(bench_dir))
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=bench_dir, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if len(out) != 2 or os.path.realpath(out[0]) != os.path.realpath(root):
        return "unknown"
    return out[1]


def provenance(device):
    """Commit, device, versions: written next to every figure. REVKERNELS_COMMIT names the commit
    where the tree has no git metadata (a snapshot copied to a benchmark machine)."""
    commit = os.environ.get("REVKERNELS_COMMIT") or _git_commit()
    if torch.device(device).type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    import revkernels

    return {
        "commit": commit,
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton_version,
        "revkernels": revkernels.__version__,
        "c_extension": revkernels.HAS_C_EXTENSION,
        "cpu_kernels": revkernels.CPU_KERNEL_BUILD or "none",
        "date": datetime.date.today().isoformat(),
    }


def write_csv(path, rows, meta):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fields = list(dict.fromkeys([*rows[0], *meta]))  # a field in both once (the meta's value)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **meta})
    return path


def write_results(csv_path, rows, meta, plot=None):
    """Writes `rows` with `meta` to `csv_path` and, where `plot` (a function of a PNG path returning
    it, or None without matplotlib) is given, the figure beside it (same name, ``.png``); prints
    what it wrote and returns (csv path, png path or None)."""
    write_csv(csv_path, rows, meta)
    png = plot(os.path.splitext(csv_path)[0] + ".png") if plot is not None else None
    print(f"wrote {csv_path}" + (f" and {png}" if png else ""), flush=True)
    return csv_path, png


def plotted(figsize):
    """A decorator for a function that draws a figure, ``draw(fig, ax, *args)``: it becomes
    ``draw(path, *args)``, which makes the figure (`figsize` inches), draws it and writes it to
    `path` (PNG), and returns the path, or None when matplotlib is not installed."""
    def wrap(draw):
        @functools.wraps(draw)
        def write(path, *args, **kwargs):
            plt = pyplot()
            if plt is None:
                return None
            fig, ax = plt.subplots(figsize=figsize)
            draw(fig, ax, *args, **kwargs)
            return save_figure(fig, path)
        return write
    return wrap


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path):
    """Writes `fig` to `path` (PNG) and closes it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def plot_train_step(path, rows, meta):
    """Step time and memory against depth, one line per engine. Returns the path, or None without
    matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    engines = sorted({r["engine"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for engine in engines:
        mine = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["depth"])
        depths = [r["depth"] for r in mine]
        axes[0].plot(depths, [r["step_ms"] for r in mine], marker="o", label=engine)
        axes[1].plot(depths, [r["saved_mib"] for r in mine], marker="o", label=engine)
        axes[2].plot(depths, [r["peak_mib"] for r in mine], marker="o", label=engine)
    for ax, title in zip(axes, ["median train step (ms)", "activations saved for backward (MiB)", "peak memory of a step (MiB)"]):
        ax.set_xlabel("depth (reversible blocks)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{meta['device']} | torch {meta['torch']} | commit {meta['commit']}", fontsize=9)
    return save_figure(fig, path)
