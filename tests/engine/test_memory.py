"""Saved memory is flat in depth, measured three ways besides saved_tensors_hooks
(tests/engine/test_sequential.py): what the engine's autograd node holds (saved tensors and every
tensor reachable from its context: per-block generator states, monitor samples), the bytes of every
live tensor the garbage collector sees, and the resident memory of a fresh process.

Between depth 4 and depth 16 a memory-saving engine may keep per block only its generator states
(two CPU generator states, ``torch.get_rng_state().nbytes`` each) and, when a reconstruction monitor
samples the step, two input samples of at most ``max_samples`` elements; nothing the size of an
activation.
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
from torch import nn

from revkernels.check import monitor_reconstruction
from tests.helpers import make_seq

ROOT = pathlib.Path(__file__).resolve().parents[2]
BATCH, WIDTH = 256, 32
ACTIVATION = BATCH * WIDTH * 4  # bytes of one fp32 stream


def _tensors_reachable(obj, seen=None, found=None):
    """Every tensor reachable from `obj` through containers, __dict__ and __slots__ (modules excluded:
    their parameters and buffers are the model's, not the step's)."""
    seen = set() if seen is None else seen
    found = {} if found is None else found
    if id(obj) in seen or isinstance(obj, (nn.Module, type, str, bytes, int, float, bool)) or obj is None:
        return found
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        return found
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    else:
        children = list(getattr(obj, "__dict__", {}).values())
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if hasattr(obj, slot):
                    children.append(getattr(obj, slot))
    for child in children:
        if callable(child) and not isinstance(child, torch.Tensor) and not hasattr(child, "__dict__"):
            continue
        _tensors_reachable(child, seen, found)
    return found


def _held_by_node(depth, monitor):
    torch.manual_seed(0)
    seq = make_seq(depth, WIDTH, dropout=0.1, drop_path=0.1)
    if monitor:
        monitor_reconstruction(seq, threshold=1e-3)
    x1 = torch.randn(BATCH, WIDTH, requires_grad=True)
    x2 = torch.randn(BATCH, WIDTH, requires_grad=True)
    y1, y2 = seq(x1, x2)
    node = y1.grad_fn
    saved = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in node.saved_tensors}
    params = {p.untyped_storage().data_ptr() for p in seq.parameters()}
    ctx = {ptr: n for ptr, n in _tensors_reachable(node).items() if ptr not in params and ptr not in saved}
    return saved, ctx, (y1, y2)


@pytest.mark.parametrize("monitor", [False, True])
def test_engine_node_holds_outputs_and_per_block_states_only(monitor):
    rng_bytes = torch.get_rng_state().nbytes
    sample_bytes = 2 * min(BATCH * WIDTH, 4096) * 4 if monitor else 0  # max_samples (default 4096) fp32 each
    held = {}
    for depth in (4, 16):
        saved, ctx, _ = _held_by_node(depth, monitor)
        assert sum(saved.values()) == 2 * ACTIVATION, f"depth {depth}: saved {sum(saved.values())} bytes"
        assert max(ctx.values(), default=0) < ACTIVATION, f"depth {depth}: the node holds an activation-sized tensor"
        held[depth] = sum(ctx.values())
    per_block = (held[16] - held[4]) / 12
    assert per_block <= 2 * rng_bytes + sample_bytes, \
        f"{per_block:.0f} bytes per block held by the engine's node (allowed {2 * rng_bytes + sample_bytes})"
    assert per_block >= 2 * rng_bytes  # the dropout replay needs its generator states


def _live_tensor_bytes():
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    storages = {}
    for t in tensors:
        try:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except RuntimeError:  # a fake/functional tensor left by an earlier compile: no memory of its own
            continue
    return sum(storages.values())


def test_live_tensor_bytes_after_forward_are_flat_in_depth():
    """Bytes of every live tensor (gc) after the forward, model and inputs excluded: the outputs plus
    per-block generator states; plain autograd's graph keeps activations per block (not counted by gc,
    which sees Python-held tensors only, so the check is on what Python code keeps)."""
    rng_bytes = torch.get_rng_state().nbytes
    grown = {}
    for depth in (4, 16):
        torch.manual_seed(0)
        seq = make_seq(depth, WIDTH, dropout=0.1)
        x1 = torch.randn(BATCH, WIDTH, requires_grad=True)
        x2 = torch.randn(BATCH, WIDTH, requires_grad=True)
        before = _live_tensor_bytes()
        y1, y2 = seq(x1, x2)
        grown[depth] = _live_tensor_bytes() - before
        del y1, y2
    assert grown[4] >= 2 * ACTIVATION
    assert (grown[16] - grown[4]) / 12 <= 2 * rng_bytes, grown


_RSS_CODE = """
import json, torch
from tests.helpers import make_seq
torch.set_num_threads(1)
def rss():
    import os
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
torch.manual_seed(0)
seq = make_seq({depth}, {width}, engine={engine!r})
x1 = torch.randn({batch}, {width}, requires_grad=True)
x2 = torch.randn({batch}, {width}, requires_grad=True)
with torch.no_grad():
    seq(x1, x2)  # first-call costs (lazy initialisation, allocator pools) out of the measurement
before = rss()
y1, y2 = seq(x1, x2)
print(json.dumps(rss() - before))
"""


def _rss_growth(engine, depth, batch=4096, width=64):
    code = _RSS_CODE.format(depth=depth, width=width, engine=engine, batch=batch)
    # A fixed mmap threshold: every buffer of 64 KiB or more is its own mapping, returned to the
    # system when freed, so the resident set follows the live large tensors (glibc's default
    # threshold grows after frees and keeps freed transients resident in the heap).
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_resident_memory_of_a_forward_is_flat_in_depth():
    """Resident memory a fresh process gains in a training forward (outputs and graph kept): the
    sequential engine at depth 16 within one activation of depth 4 (1 MiB: batch 4096 x 64 fp32);
    plain autograd stores activations in every block (several per block), which this measure sees."""
    activation = 4096 * 64 * 4
    seq4, seq16 = _rss_growth("sequential", 4), _rss_growth("sequential", 16)
    auto16 = _rss_growth("autograd", 16)
    assert seq16 - seq4 < activation, f"sequential: depth 4 +{seq4 / 2**20:.1f} MiB, depth 16 +{seq16 / 2**20:.1f} MiB"
    assert auto16 - seq16 > 16 * activation, f"autograd depth 16 +{auto16 / 2**20:.1f} MiB: the measure sees no activations"
