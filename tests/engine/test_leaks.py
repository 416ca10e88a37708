"""Long runs keep memory flat: no tensor, graph or host memory accumulates step after step.

SGD steps of a tiny stack (make_seq(3, 8), batch 4) per engine: the number of live tensors
(gc.get_objects() after gc.collect()) is the same after step 50 and after the last step, and the
resident set grows by less than one step's activations per step in between (computed: the bytes
plain autograd saves in one step of this stack, 4.8 KB, times the steps between the checkpoints: a
leak of one step's activations every step reaches the bound). Tighter is not measurable at this size:
malloc's fragmentation moves the resident set by up to ~600 KiB over 200 steps with a constant live
set (measured, 2026-12-01; 0-16 KiB in most runs); 250 steps in the default run (about 1.5 s
of CPU per engine), 500 in the slow one. The CPU runs happen in one fresh interpreter: in the
test process, tensors and caches left by other tests
would be freed or made at any time, and a large heap makes every step's garbage collection slow.
"""
import gc
import json
import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

from tests.helpers import make_seq

# On CPU "pareprop" and "graphs" run the sequential walker, but each through its own front end
# (pareprop's stream dispatch; graphs' signature cache and fallback warnings), which is what their CPU
# cases here check for leaks; their CUDA code is checked by the gpu test at the end.
ENGINES = ["autograd", "sequential", "pareprop", "graphs"]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def live_tensors():
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some lazy torch attributes warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train(seq, steps, checkpoints, device="cpu", measure=rss_bytes):
    opt = torch.optim.SGD(seq.parameters(), lr=1e-3)
    seen = {}
    for step in range(1, steps + 1):
        x = torch.randn(4, 8, device=device, requires_grad=True)
        y1, y2 = seq(x, x)
        (y1.square().mean() + y2.square().mean()).backward()
        opt.step()
        opt.zero_grad()
        if step == 25:
            live_tensors()  # the first gc.get_objects() list grows the heap once: before the window
        if step in checkpoints:
            gc.collect()
            resident = measure()  # garbage collected, before gc.get_objects() builds its list
            seen[step] = (live_tensors(), resident)
    return seen


def _measure_all(steps):
    """Run in a fresh interpreter: prints {case: {step: [live tensors, rss]}} as JSON."""
    from revkernels.check import monitor_reconstruction

    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    results = {}
    for engine in ENGINES:
        torch.manual_seed(0)
        results[engine] = _train(make_seq(3, 8, engine=engine), steps, (50, steps))
    # Generator states per block, and the reconstruction monitor's samples and history.
    seq = make_seq(3, 8, engine="sequential", dropout=0.2, drop_path=0.1)
    monitor_reconstruction(seq, threshold=1e-3, every=5)
    results["sequential+dropout+monitor"] = _train(seq, steps, (50, steps))
    results["step_bytes"] = one_step_activation_bytes()
    print(json.dumps(results))


def one_step_activation_bytes():
    """Bytes plain autograd saves for the backward in one step of the stack `_train` runs."""
    seq = make_seq(3, 8, engine="autograd")
    x = torch.randn(4, 8, requires_grad=True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        seq(x, x)
    params = {p.untyped_storage().data_ptr() for p in seq.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


CASES = ENGINES + ["sequential+dropout+monitor"]
needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")


def _run_fresh(steps):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = f"from tests.engine.test_leaks import _measure_all; _measure_all({steps})"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_flat(runs, case, steps):
    (tensors_50, rss_50), (tensors_end, rss_end) = runs[case]["50"], runs[case][str(steps)]
    assert tensors_end == tensors_50, f"live tensors {tensors_50} after step 50, {tensors_end} after {steps}"
    step_bytes = runs["step_bytes"]
    assert 1000 < step_bytes < 100_000  # ~4.8 KB: 3 blocks, width 8, batch 4
    bound = (steps - 50) * step_bytes
    assert rss_end - rss_50 < bound, \
        f"RSS grew {(rss_end - rss_50) / 1024:.0f} KiB between steps 50 and {steps} (bound {bound / 1024:.0f} KiB)"


@pytest.fixture(scope="module")
def runs_250():
    return _run_fresh(250)


@pytest.fixture(scope="module")
def runs_500():
    return _run_fresh(500)


@needs_proc
@pytest.mark.parametrize("case", CASES)
def test_250_steps_keep_memory_flat(runs_250, case):
    _assert_flat(runs_250, case, 250)


@needs_proc
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_500_steps_keep_memory_flat(runs_500, case):
    _assert_flat(runs_500, case, 500)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ENGINES)
def test_500_steps_keep_cuda_memory_flat(engine):
    seq = make_seq(3, 8, engine=engine).cuda()

    def allocated():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _train(seq, 20, (), device="cuda", measure=allocated)  # warm-up (graph capture, lazy init)
        seen = _train(seq, 500, (50, 500), device="cuda", measure=allocated)
    assert seen[500][1] == seen[50][1], seen
    assert seen[500][0] == seen[50][0], seen
