"""revkernels.engine.budget: under a memory budget each block is rebuilt, kept selectively (torch's
selective checkpoint: matrix-product outputs kept, the rest recomputed) or kept, and under
torch.compile also checkpointed (its inputs kept); the run never keeps more than it was given beyond
its outputs, and its gradients are plain autograd's at every budget.

The plans here come from the measured bytes with fixed times (`fixed_times`), so that they are the
same on every machine; `test_the_measurement_times_and_counts_each_block` checks the real timing."""
import copy
import dataclasses
import gc
import pickle

import pytest
import torch
from torch import nn

import revkernels as rk
from revkernels.bench.report import retained_bytes
from revkernels.engine import budget as budget_module
from revkernels.engine.budget import BlockCost, plan
from tests.helpers import (CountingBackend, assert_close_rel, loss_of, make_seq, perturb_parameters, plain_forward,
                           run_grads)

BUDGETS = [0, 0.1, 0.25, 0.5, 0.75, 1.0, 40_000]
MEASURE = budget_module.activation_bytes  # (the real measurement: `fixed_times` replaces it)


@pytest.fixture(autouse=True)
def fixed_times(monkeypatch):
    """Measured bytes, fixed times: a block's forward 1 ms, its selective recompute 0.2 ms, the
    recompute from its inputs 0.6 ms, no dispatch overhead. With make_seq's blocks (selective keeps
    ~2/3 of their bytes) the budgets of `BUDGETS` then give plans with every option."""
    def measure(*args):
        return [dataclasses.replace(c, forward_ms=1.0, recompute_ms=0.2, ops=0, checkpoint_ms=0.6) for c in MEASURE(*args)]

    monkeypatch.setattr(budget_module, "activation_bytes", measure)


def _seq(engine="sequential", depth=6, width=24, **kwargs):
    seq = perturb_parameters(make_seq(depth, width, engine=engine, **kwargs))
    if engine == "compiled":
        seq.compile_options = {"backend": "aot_eager"}
    return seq


def _twins(engine="sequential", **kwargs):
    # (a run and its plain-autograd reference, same parameters and buffers)
    torch.manual_seed(0)
    seq = _seq(engine, **kwargs)
    ref = _seq("autograd", **kwargs)
    ref.load_state_dict(seq.state_dict())
    return seq, ref


def _planned(budget, **kwargs):
    """(run, plain-autograd twin, batch (x1, x2, w1, w2), plan) with `budget`, the plan made before
    any trace (a trace follows it) and Dynamo reset (another test's graphs of
    ReversibleSequential.forward are not this one's to count)."""
    seq, ref = _twins(**kwargs)
    seq.memory_budget = budget
    data = [torch.randn(5, 24) for _ in range(4)]
    made = seq.memory_plan(*data[:2])
    torch._dynamo.reset()
    return seq, ref, data, made


def _all_selective_bytes(seq, x):
    return sum(c.selective_bytes for c in seq.memory_plan(x, x).costs)


# (pareprop and auto run the sequential engine's code on CPU: one budget each)
@pytest.mark.parametrize("engine,budget", [(e, b) for e in ("sequential", "compiled") for b in BUDGETS]
                         + [("pareprop", 0.5), ("auto", 0.5)])
def test_grads_equal_plain_autograd_at_every_budget(engine, budget):
    seq, ref = _twins(engine, dropout=0.2, drop_path=0.1)
    seq.memory_budget = budget
    data = [torch.randn(5, 24) for _ in range(4)]
    got = run_grads(seq, seq, *data, seed=3)
    rng_after = torch.rand(3)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=3)
    assert torch.equal(rng_after, torch.rand(3))  # the plan's measurement drew nothing of the stream
    for a, e in zip(got, expected, strict=True):
        assert_close_rel(a, e)


def test_the_budgets_give_every_option_and_mixes():
    seq = _seq(dropout=0.2, drop_path=0.1)
    x = torch.randn(5, 24)
    plans = {}
    for budget in BUDGETS:
        seq.memory_budget = budget
        plans[budget] = seq.memory_plan(x, x).options
    assert set(plans[0]) == {"rebuild"} and set(plans[1.0]) == {"keep"}
    assert {"rebuild", "selective"} <= set(plans[0.25]) and {"selective", "keep"} <= set(plans[0.75])
    for options in plans.values():  # the rebuilt blocks are a prefix
        k = sum(o == "rebuild" for o in options)
        assert "rebuild" not in options[k:]


@pytest.mark.parametrize("dropout", [0.5])
def test_dropout_masks_are_autograds_when_every_block_is_selective(dropout):
    seq, ref = _twins(dropout=dropout, drop_path=0.2)
    x = torch.randn(5, 24)
    seq.memory_budget = _all_selective_bytes(seq, x)
    assert set(seq.memory_plan(x, x).options) == {"selective"}
    data = [torch.randn(5, 24) for _ in range(4)]
    got = run_grads(seq, seq, *data, seed=5)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=5)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])  # the forward's masks
    for a, e in zip(got[2:], expected[2:], strict=True):  # the recompute's: the same
        assert_close_rel(a, e)


@pytest.mark.parametrize("budget", [0, 0.3, 0.6, 0.8, 1.0, "selective"])
def test_batch_norm_statistics_are_updated_once(budget):
    seq, ref = _twins(norm="batch")
    x = torch.randn(6, 24)
    seq.memory_budget = _all_selective_bytes(seq, x) if budget == "selective" else budget
    options = seq.memory_plan(x, x).options
    data = [torch.randn(6, 24) for _ in range(4)]
    for step in range(2):
        got = run_grads(seq, seq, *data)
        expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
        for a, e in zip(got, expected, strict=True):
            assert_close_rel(a, e)
    for (name, a), (_, b) in zip(seq.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-7), name
        if name.endswith("num_batches_tracked"):
            assert a.item() == 2, (name, options)


class _Counted(nn.Module):
    """tanh(linear(x) * (1 + calls / 10))^2, then calls += 1 (a buffer the forward changes in place)."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        out = torch.tanh(self.linear(x) * (1 + self.calls / 10)).square()
        with torch.no_grad():
            self.calls += 1
        return out


def test_a_selective_recompute_sees_and_leaves_the_buffers_as_the_forward_did():
    torch.manual_seed(0)
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(_Counted(8), _Counted(8)) for _ in range(2)])
    ref = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(_Counted(8), _Counted(8)) for _ in range(2)],
                                     engine="autograd")
    ref.load_state_dict(seq.state_dict())
    x = torch.randn(3, 8)
    seq.memory_budget = _all_selective_bytes(seq, x)
    assert set(seq.memory_plan(x, x).options) == {"selective"}
    data = [torch.randn(3, 8) for _ in range(4)]
    for _ in range(2):
        for a, e in zip(run_grads(seq, seq, *data), run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data),
                        strict=True):
            assert_close_rel(a, e)
    assert all(b.item() == 2 for b in seq.buffers())


@pytest.mark.parametrize("budget", BUDGETS)
def test_saved_bytes_stay_within_the_budget_beyond_the_outputs(budget):
    torch.manual_seed(0)
    seq = _seq(depth=8, width=32)
    seq.memory_budget = budget
    x = torch.randn(16, 32, requires_grad=True)
    made = seq.memory_plan(x, x)
    outputs = 2 * x.numel() * x.element_size()
    loss_of(*seq(x, x), 1.0, 1.0).backward()  # (a first step: what the engines create once and cache)
    (y1, y2), saved = retained_bytes(lambda: seq(x, x), [*seq.parameters(), *seq.buffers()])
    loss_of(y1, y2, 1.0, 1.0).backward()
    assert made.kept_bytes <= made.budget_bytes
    assert saved <= made.kept_bytes + outputs  # what it keeps, it planned (selective blocks' cache included)
    if budget == 1.0:
        autograd = _seq("autograd", depth=8, width=32)
        assert set(made.options) == {"keep"} and saved == retained_bytes(lambda: autograd(x, x), [
            *autograd.parameters(), *autograd.buffers()])[1]
    if budget == 0:
        assert set(made.options) == {"rebuild"} and saved <= outputs


def test_the_plan_keeps_selectively_where_only_that_fits():
    seq = _seq()
    x = torch.randn(5, 24)
    last = seq.memory_plan(x, x).costs[-1]
    assert last.selective_bytes < last.keep_bytes
    seq.memory_budget = last.selective_bytes  # the last block's selective bytes: keep does not fit
    assert seq.memory_plan(x, x).options == ("rebuild",) * 5 + ("selective",)
    seq.memory_budget = last.keep_bytes + last.input_bytes  # (and the node's outputs): keep fits
    assert seq.memory_plan(x, x).options == ("rebuild",) * 5 + ("keep",)


def _costs(n, keep=100, selective=60, inputs=10, forward_ms=1.0, recompute_ms=0.2, ops=0, checkpoint_ms=None):
    return [BlockCost(keep, selective, inputs, forward_ms, recompute_ms, ops, checkpoint_ms) for _ in range(n)]


def test_the_greedy_plan():
    # selective first, from the last block (0.8 ms saved for 60 bytes beats 1 ms for 100 and the
    # node's outputs, 10), then keep, latest block first (0.2 ms for 40 bytes)
    assert plan(120, _costs(4)).options == ("rebuild",) * 2 + ("selective",) * 2
    made = plan(239, _costs(4))  # (block 0's selective does not fit: block 3 keeps instead)
    assert made.options == ("rebuild", "selective", "selective", "keep") and made.kept_bytes == 220
    assert plan(240, _costs(4)).options == ("selective",) * 4
    made = plan(280, _costs(4))
    assert made.options == ("selective",) * 3 + ("keep",) and made.kept_bytes == 280
    assert made.recompute_ms == pytest.approx(0.6)
    # keep only (no selective option): the node's outputs count beside the first kept block
    only_keep = _costs(4, selective=None)
    assert plan(109, only_keep).options == ("rebuild",) * 4
    made = plan(210, only_keep)
    assert made.options == ("rebuild",) * 2 + ("keep",) * 2 and made.kept_bytes == 210
    assert plan(400, only_keep).kept_bytes == 400  # all kept: no node
    # selective costing more than a rebuild (its dispatch: 2 x 50 ops x 0.01 ms): never taken
    assert plan(240, _costs(4, ops=50), overhead_ms=0.01).options == ("rebuild",) * 2 + ("keep",) * 2
    torch.manual_seed(0)
    mixed = [BlockCost(int(k), int(s) if s < k else None, 10, f, r, 0) for k, s, f, r in zip(
        torch.randint(50, 150, (6,)), torch.randint(20, 180, (6,)), torch.rand(6) + 0.5, torch.rand(6) * 0.5)]
    for budget in range(0, 800, 7):  # within the budget, counted right; the rebuilt blocks a prefix
        for costs in (_costs(4), only_keep, mixed):
            made = plan(budget, costs)
            k = made.options.count("rebuild")
            assert made.options[:k] == ("rebuild",) * k
            node = costs[k].input_bytes if 0 < k < len(costs) and made.options[k] == "keep" else 0
            assert made.kept_bytes == sum(c.bytes_of(o) for c, o in zip(costs, made.options)) + node <= budget


def test_the_plan_for_torch_compile_checkpoints_first():
    # checkpoint saves 0.4 ms for the 10 input bytes (0.04 ms a byte) before selective (0.8 ms for
    # 60) or keep (1 ms for 100 and the node's outputs); then a checkpointed block moves on to
    # selective (0.4 ms for 50 more bytes) before keep (0.6 ms for 90 more)
    costs = _costs(4, checkpoint_ms=0.6)
    assert plan(30, costs, traced=True).options == ("rebuild",) + ("checkpoint",) * 3
    made = plan(89, costs, traced=True)
    assert made.options == ("checkpoint",) * 4 and made.kept_bytes == 40
    assert made.recompute_ms == pytest.approx(2.4)
    made = plan(90, costs, traced=True)
    assert made.options == ("checkpoint",) * 3 + ("selective",) and made.kept_bytes == 90
    assert plan(400, costs, traced=True).options == ("keep",) * 4
    assert "checkpoint" not in plan(90, costs).options  # (eager: a checkpoint recomputes the whole forward)
    assert plan(30, _costs(4), traced=True).options == ("rebuild",) * 4  # (not offered: no checkpoint_ms)
    for budget in range(0, 800, 7):  # within the budget; the rebuilt blocks a prefix
        made = plan(budget, costs, traced=True)
        k = made.options.count("rebuild")
        assert made.options[:k] == ("rebuild",) * k
        node = costs[k].input_bytes if 0 < k < len(costs) and made.options[k] == "keep" else 0
        assert made.kept_bytes == sum(c.bytes_of(o) for c, o in zip(costs, made.options)) + node <= budget


def test_needed_ms_walks_back_from_what_autograd_saved():
    # (op, ms, storages read, storages written); the block's input is storage 0, it saves 2 and 5
    calls = [("a", 1.0, {0}, {1}), ("b", 2.0, {1}, {2}), ("c", 4.0, {2}, {3}),  # 3: freed, its address reused
             ("d", 8.0, {0}, {3}), ("e", 16.0, {3}, {5}), ("f", 32.0, {5}, {6}), ("g", 64.0, {0, 5}, {5})]
    calls = [(op, ms, frozenset(r), frozenset(w)) for op, ms, r, w in calls]
    # g (writes 5 in place: reads 5) <- e (writes 5) <- d (writes 3: c's 3 is another, earlier tensor);
    # b (writes 2) <- a; f's output is not saved
    assert budget_module.needed_ms(calls, {2, 5}, {0}) == 64 + 16 + 8 + 2 + 1
    assert budget_module.needed_ms(calls, {0}, {0}) == 0  # (only the input saved: nothing to recompute)


class _Clock:
    """A `time` stand-in whose clock advances `step` seconds a call: each op timed (two calls) takes
    `step` s."""

    def __init__(self, step):
        self.now, self.step = 0.0, step

    def perf_counter(self):
        self.now += self.step
        return self.now


def test_the_measurement_counts_each_ops_least_time_and_what_a_checkpoint_recomputes(monkeypatch):
    # F = Linear-Tanh-Linear, G alike: a recompute from the block's inputs needs every op of F (G's
    # first Linear saves y1 = x1 + F(x2)) and G's first Linear and Tanh; not G's last Linear (its input, Tanh's output, is saved) nor
    # the add making y2, nor the weights' transposes (they write parameter storages), nor
    # promote_types (no tensor)
    torch.manual_seed(0)
    block = rk.nn.ReversibleBlock(*(nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24)) for _ in range(2)))
    ops = []

    class Names(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(5, 24)
    with Names():
        block(x, x)
    ops = [op for op in ops if op != "detach"]  # (autograd's of Tanh's saved output: none under a saved-tensor hook)
    computing = [op for op in ops if op not in ("t", "promote_types")]
    assert computing == ["addmm", "tanh", "addmm", "add"] * 2
    needed = len(ops) - ops.count("t") - ops.count("promote_types") - 2
    clock = _Clock(5.0)  # (each block's first pass: 5 s an op; its later passes 1 s)
    reset, again = budget_module._Probe.reset, budget_module._Probe.again

    def paced(step, method):
        def call(probe):
            clock.step = step
            method(probe)
        return call

    monkeypatch.setattr(budget_module, "time", clock)
    monkeypatch.setattr(budget_module._Probe, "reset", paced(5.0, reset))
    monkeypatch.setattr(budget_module._Probe, "again", paced(1.0, again))
    cost = MEASURE(nn.ModuleList([block]), x, x, {})[0]
    assert cost.ops == len(ops) and cost.forward_ms == pytest.approx(len(ops) * 1e3)
    assert cost.recompute_ms == pytest.approx((len(ops) - 4) * 1e3)  # (all but the four addmm)
    assert cost.checkpoint_ms == pytest.approx(needed * 1e3)


def test_the_measurement_times_and_counts_each_block():
    torch.manual_seed(0)
    seq = _seq(depth=2)
    x = torch.randn(5, 24)
    for cost in MEASURE(seq.blocks, x, x, {}):
        assert 0 < cost.recompute_ms < cost.forward_ms and 0 < cost.checkpoint_ms < cost.forward_ms and cost.ops > 0
        assert cost.input_bytes <= cost.selective_bytes < cost.keep_bytes
    normed = rk.nn.ReversibleBlock(nn.utils.parametrizations.spectral_norm(nn.Linear(24, 24)), nn.Linear(24, 24))
    normed_cost = MEASURE(nn.ModuleList([normed]), x, x, {})[0]
    assert normed_cost.selective_bytes is None and normed_cost.checkpoint_ms is None  # (no second power iteration)


def _backward_ops(seq, x):
    ops = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func)
            return func(*args, **(kwargs or {}))

    y1, y2 = seq(x, x)
    with Count():
        loss_of(y1, y2, 1.0, 1.0).backward()
    return ops


def test_a_selective_backward_recomputes_no_matrix_product():
    seq = _seq(depth=3)
    x = torch.randn(5, 24, requires_grad=True)
    seq.memory_budget = 1.0
    kept = _backward_ops(seq, x)
    seq.memory_budget = _all_selective_bytes(seq, x)
    assert set(seq.memory_plan(x, x).options) == {"selective"}
    selective = _backward_ops(seq, x)
    for op in budget_module.SAVED_OPS:
        assert selective.count(op) == kept.count(op), op
    layer_norm = torch.ops.aten.native_layer_norm.default
    assert kept.count(layer_norm) == 0 and selective.count(layer_norm) == 6  # (F's and G's, recomputed)


def test_the_plan_is_measured_once_per_signature(monkeypatch):
    calls = []
    measure = budget_module.activation_bytes

    def counted(*args):
        calls.append(1)
        return measure(*args)

    monkeypatch.setattr(budget_module, "activation_bytes", counted)
    seq = _seq()
    seq.memory_budget = 0.5
    for batch in (4, 4, 4, 6, 4):
        x = torch.randn(batch, 24, requires_grad=True)
        seq(x, x)[0].sum().backward()
    assert len(calls) == 2  # batch 4, then batch 6
    seq.memory_budget = 0.75  # another budget: the same measurement
    seq(x, x)[0].sum().backward()
    assert len(calls) == 2
    seq.eval()  # training flags are part of the signature
    seq(x, x)[0].sum().backward()
    assert len(calls) == 3


def test_memory_plan_reads_as_a_table():
    seq = _seq(depth=3)
    x = torch.randn(4, 24)
    seq.memory_budget = sum(c.selective_bytes for c in seq.memory_plan(x, x).costs[1:])
    text = str(seq.memory_plan(x, x))
    assert "0 keep, 2 selective, 1 rebuild: skips 2 of 3 rebuilds" in text
    assert "the backward recomputes ~1.40 ms (~3.00 ms rebuilding every block)" in text
    rows = text.splitlines()[2:5]
    assert [row.split()[1] for row in rows] == ["rebuild", "selective", "selective"]
    assert all("keep " in row and "selective " in row and "rebuild ~1.00 ms" in row and "checkpoint ~0.60 ms" in row
               for row in rows)
    # under torch.compile: every block checkpointed first (0.4 ms for its inputs), then the last
    # block kept (0.6 ms more for fewer bytes per ms than selective's 0.4 ms)
    assert text.splitlines()[5].startswith("  under torch.compile: C C K (Rebuild, Checkpoint: keeps its inputs")
    assert "1 keep, 0 selective, 2 checkpoint, 0 rebuild: skips 3 of 3 rebuilds; the backward recomputes ~1.20 ms" \
        in text.splitlines()[5]


@pytest.mark.parametrize("bad,error", [(-0.5, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                       (-1, ValueError), ("half", ValueError), (True, TypeError), ([0.5], TypeError)])
def test_bad_budgets_raise_naming_the_argument(bad, error):
    with pytest.raises(error, match="memory_budget"):
        rk.nn.ReversibleSequential(*make_seq(1, 4).blocks, memory_budget=bad)


def test_auto_reads_the_free_memory_of_a_cuda_device(monkeypatch):
    seq = _seq()
    seq.memory_budget = "auto"
    with pytest.raises(ValueError, match="memory_budget='auto' reads the free memory of a CUDA device"):
        seq(torch.randn(2, 24, requires_grad=True), torch.randn(2, 24))
    params = [nn.Parameter(torch.ones(1000)) for _ in range(2)]  # 8000 bytes
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10**6, 10**6))
    # free - grads not held yet (8000) - 2 x parameters (16000) - 10% of the device
    assert budget_module.auto_budget_bytes(params, torch.device("cuda", 0)) == 10**6 - 8000 - 16000 - 10**5


def _check_grads_and_statistics(run, seq, ref, data):
    """`run` (of `seq`) gives plain autograd's grads on `ref`, and BatchNorm's statistics updated once."""
    got = run_grads(run, seq, *data)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
    for a, e in zip(got, expected, strict=True):
        assert_close_rel(a, e)
    for mine, theirs in zip(seq.buffers(), ref.buffers(), strict=True):
        assert_close_rel(mine, theirs)


@pytest.mark.parametrize("budget", [0.1, 0.25, 0.5, 1.0])
def test_under_torch_compile_the_trace_runs_the_plan_made_before_it(budget):
    # (a trace cannot measure: it follows the plan memory_plan made; the rebuilt blocks are one
    # opaque op, the kept ones traced into the graph, the selective ones checkpointed in it)
    seq, ref, data, made = _planned(budget, norm="batch")
    backend = CountingBackend("aot_eager")
    compiled = torch.compile(seq, backend=backend, fullgraph=True)
    _check_grads_and_statistics(compiled, seq, ref, data)
    traced = made.under_compile.options
    assert backend.count("revkernels.reversible_run.default") == (1 if "rebuild" in traced else 0)
    assert backend.count("tag_activation_checkpoint") == traced.count("selective") + traced.count("checkpoint")
    run_grads(compiled, seq, *data)
    assert backend.graphs == 1  # (the trace made no module: the next call runs the same graph)


@pytest.mark.parametrize("budget", [0.1, 0.25])
def test_under_torch_compile_checkpointed_blocks_with_dropout_give_autograds_grads(budget):
    # (the compiled graph keeps what its random ops drew: its recompute redraws nothing, replayed
    # or not; what this checks is the checkpoint's grads with dropout and drop-path)
    seq, ref, data, made = _planned(budget, dropout=0.2, drop_path=0.1)
    assert "checkpoint" in made.under_compile.options
    got = run_grads(torch.compile(seq, backend="aot_eager", fullgraph=True), seq, *data, seed=3)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=3)
    for a, e in zip(got, expected, strict=True):
        assert_close_rel(a, e)


def test_under_torch_compile_the_rebuilt_blocks_take_the_runs_settings_at_the_trace():
    # (the rebuilt blocks' run took the run's engine when the plan was made: an engine or its
    # compile options set after memory_plan were not the ones the trace ran)
    seq, ref, data, made = _planned(0.1)
    assert made.under_compile.options[0] == "rebuild"
    steps = CountingBackend("aot_eager")
    seq.engine, seq.compile_options = "compiled", {"backend": steps}
    _check_grads_and_statistics(torch.compile(seq, backend="aot_eager", fullgraph=True), seq, ref, data)
    assert steps.graphs > 0  # (the rebuilt blocks ran the compiled engine's steps)


def test_under_torch_compile_a_second_batch_size_follows_its_own_plan():
    # (the second shape made Dynamo's sizes dynamic: the plan's key, symbolic, failed to become a
    # trace-time constant, and fullgraph=True raised; a last, smaller batch of an epoch)
    seq, ref, data, _ = _planned(0.25)
    smaller = [t[:3] for t in data]
    seq.memory_plan(*smaller[:2])
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    for batch in (data, smaller, data):
        _check_grads_and_statistics(compiled, seq, ref, batch)


def test_under_torch_compile_a_run_with_a_context_mask_follows_its_plan():
    # (the plan's key sorted the context's (name, tensor) pairs, which a trace cannot sort:
    # fullgraph=True raised)
    torch.manual_seed(0)
    seq = rk.nn.ReversibleSequential(*[rk.nn.RevTransformerBlock(32, 4) for _ in range(4)], memory_budget=0.3)
    perturb_parameters(seq)
    ref = rk.nn.ReversibleSequential(*[rk.nn.RevTransformerBlock(32, 4) for _ in range(4)], engine="autograd")
    ref.load_state_dict(seq.state_dict())
    x = torch.randn(2, 9, 32)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    assert seq.memory_plan(x, x, attn_mask=mask).under_compile.options[-1] != "rebuild"
    torch._dynamo.reset()
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    data = [x, x, torch.randn_like(x), torch.randn_like(x)]
    got = run_grads(lambda a, b: compiled(a, b, attn_mask=mask), seq, *data)
    expected = run_grads(lambda a, b: ref(a, b, attn_mask=mask), ref, *data)
    for a, e in zip(got, expected, strict=True):
        assert_close_rel(a, e)


def test_a_run_with_a_plan_copies_and_pickles_as_a_run_of_its_own():
    # (copy.deepcopy and pickle of a run with a plan raised TypeError: its plan cache, an LRU, could
    # not be rebuilt; and a copy kept its original's plan number, whose trace ran the original's blocks)
    seq, ref, data, _ = _planned(0.1)
    loaded = pickle.loads(pickle.dumps(seq))
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(loaded(*data[:2]), seq(*data[:2]), strict=True))
    twin = copy.deepcopy(seq)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(1.5)
    ref.load_state_dict(twin.state_dict())
    torch._dynamo.reset()  # a copy compiled before a plan of its own: none (not its original's), a warning
    with pytest.warns(UserWarning, match="without a plan made for these inputs"):
        _check_grads_and_statistics(torch.compile(twin, backend="aot_eager", fullgraph=True), twin, ref, data)
    assert twin.memory_plan(*data[:2]).under_compile.options[0] == "rebuild"
    torch._dynamo.reset()
    _check_grads_and_statistics(torch.compile(twin, backend="aot_eager", fullgraph=True), twin, ref, data)


def test_a_plan_made_later_for_other_inputs_does_not_retrace_a_graph():
    # (a plan lookup traced into the graph guarded on the plan cache's size: every compiled graph of
    # the run traced again when a plan was made for another batch size)
    seq, ref, data, _ = _planned(0.5)
    backend = CountingBackend("aot_eager")
    compiled = torch.compile(seq, backend=backend, fullgraph=True)
    run_grads(compiled, seq, *data)
    other = torch.randn(7, 24)
    seq.memory_plan(other, other)  # a plan for batch 7
    _check_grads_and_statistics(compiled, seq, ref, data)
    assert backend.graphs == 1


def test_a_run_without_a_plan_does_not_take_another_runs_traced_plan():
    # (a plan looked up at trace time by the run's id was a constant of a graph that Dynamo gave to
    # any run of the same structure: the second run ran the first one's plan)
    data = [torch.randn(5, 24) for _ in range(4)]
    planned, _ = _twins()
    planned.memory_budget = 0.5
    planned.memory_plan(*data[:2])
    torch._dynamo.reset()
    run_grads(torch.compile(planned, backend=CountingBackend("aot_eager"), fullgraph=True), planned, *data)
    other, ref = _twins()
    other.memory_budget = 0.5
    backend = CountingBackend("aot_eager")
    with pytest.warns(UserWarning, match="without a plan made for these inputs"):
        _check_grads_and_statistics(torch.compile(other, backend=backend, fullgraph=True), other, ref, data)
    tensor_ops = [op for op in backend.ops if not op.startswith("<built-in function")]  # (not size arithmetic)
    assert tensor_ops.count("revkernels.reversible_run.default") == 1 and len(tensor_ops) <= 4, backend.ops


def test_the_budgets_under_torch_compile_give_every_option():
    seq = _seq(norm="batch")
    x = torch.randn(5, 24)
    options = set()
    for budget in (0.05, 0.25, 0.5, 1.0):
        seq.memory_budget = budget
        options.update(seq.memory_plan(x, x).under_compile.options)
    assert options == {"rebuild", "checkpoint", "selective", "keep"}


def test_under_torch_compile_without_a_plan_the_run_rebuilds_every_block_and_warns():
    seq, ref = _twins()
    seq.memory_budget = 0.5
    data = [torch.randn(5, 24) for _ in range(4)]
    backend = CountingBackend("aot_eager")
    compiled = torch.compile(seq, backend=backend, fullgraph=True)
    with pytest.warns(UserWarning, match=r"rebuilds every block whatever its memory_budget without a plan made for "
                                         r"these inputs before the trace \(call seq.memory_plan"):
        got = run_grads(compiled, seq, *data)
    tensor_ops = [op for op in backend.ops if not op.startswith("<built-in function")]  # (not size arithmetic)
    assert tensor_ops.count("revkernels.reversible_run.default") == 1 and len(tensor_ops) <= 4, backend.ops
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
    for a, e in zip(got, expected, strict=True):
        assert_close_rel(a, e)


@pytest.mark.parametrize("exact", [False, True])
def test_a_step_within_the_budget_keeps_the_structure_caches(exact):
    # A slice of the blocks' ModuleList made a new ModuleList each step: a structure change that
    # dropped every structure cache (the run then rebuilt them all, ~1 ms a forward for 6 blocks)
    from revkernels.engine.structure import structure_version

    seq = _seq()
    seq.exact = exact
    x = torch.randn(5, 24, requires_grad=True)
    for budget in (0.5, 1.0):
        seq.memory_budget = budget
        for _ in range(2):  # (the first makes the run of the rebuilt blocks: registrations, then a check)
            seq(x, x)[0].sum().backward()
        version = structure_version()
        for _ in range(2):
            seq(x, x)[0].sum().backward()
        assert structure_version() == version, budget


@pytest.mark.parametrize("budget", [0.5, 1.0])
def test_the_compiled_engine_compiles_its_kept_blocks(budget):
    # (kept blocks ran eagerly under the compiled engine: its compiled forward step now runs them,
    # differentiated by autograd; blocks that draw random numbers stay eager: see kept_forward)
    seq, ref = _twins("compiled", norm="batch")
    backend = CountingBackend("aot_eager")
    seq.compile_options = {"backend": backend}
    seq.memory_budget = budget
    data = [torch.randn(5, 24) for _ in range(4)]
    made = seq.memory_plan(*data[:2])
    _check_grads_and_statistics(seq, seq, ref, data)
    kept = made.options.count("keep")
    assert kept >= 1
    # a call per kept block, and one per rebuilt block in the forward and in the backward
    assert backend.calls == kept + 2 * made.first_kept, (backend.calls, made.options)


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_a_kept_blocks_own_forward_hooks_fire_once(engine):
    # (the compiled engine's kept blocks skipped hooks on the block itself)
    seq = _seq(engine)
    seq.memory_budget = 1.0
    calls = []
    seq.blocks[-1].register_forward_hook(lambda module, args, out: calls.append(1))
    x = torch.randn(5, 24, requires_grad=True)
    seq.memory_plan(x, x)
    seq(x, x)[0].sum().backward()
    assert calls == [1]


def _graph_tensors():
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def test_a_measurement_leaves_nothing_of_its_forward_alive():
    # Tanh saves its own output: a saved-tensor hook handing it back to autograd made a cycle gc
    # cannot collect, and every plan (one per new input signature) leaked its measured graph and
    # activations, each holding a reference to every parameter
    torch.manual_seed(0)
    seq = _seq(depth=3, act=nn.Tanh)
    seq.memory_budget = 0.5
    before = _graph_tensors()
    for rows in (5, 6):
        x = torch.randn(rows, 24)
        seq.memory_plan(x, x)
    assert _graph_tensors() == before
    for p in seq.parameters():  # (no reference left: module conversion by swapping, as torch.__future__ offers, works)
        torch.utils.swap_tensors(p, nn.Parameter(p.detach().clone()))


@pytest.mark.parametrize("change", ["replace", "insert"])
def test_a_block_replaced_or_inserted_after_a_step_is_run(change):
    # (the rebuilt prefix's run was cached by its length: it kept running the old blocks)
    torch.manual_seed(0)
    seq = _seq(depth=4)
    seq.memory_budget = 0.5
    data = [torch.randn(5, 24) for _ in range(4)]
    assert 0 < seq.memory_plan(*data[:2]).first_kept < 4
    run_grads(seq, seq, *data)  # (one step: the rebuilt prefix's run is made)
    new = _seq(depth=1).blocks[0]
    if change == "replace":
        seq.blocks[0] = new
    else:
        seq.blocks.insert(0, new)
    assert 0 < seq.memory_plan(*data[:2]).first_kept
    ref = rk.nn.ReversibleSequential(*copy.deepcopy(list(seq.blocks)), engine="autograd")
    got = run_grads(seq, seq, *data)
    expected = run_grads(ref, ref, *data)
    assert len(got) == len(expected) == 4 + len(list(seq.parameters()))
    for a, e in zip(got, expected, strict=True):
        assert_close_rel(a, e)
