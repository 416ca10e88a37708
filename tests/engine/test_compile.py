"""torch.compile over reversible runs.

Under compile a `ReversibleSequential` with a memory-saving engine is one opaque op of the graph
(`revkernels.engine.opaque`): every engine name compiles with ``fullgraph=True``, gives the
gradients of eager autograd and saves only the run's outputs (tests/engine/test_compiled.py
checks the bytes). Most tests use the ``aot_eager`` backend (Dynamo and AOTAutograd trace exactly
what inductor gets, without its code generation, which takes tens of seconds on a 2-core
machine); one test runs inductor itself (``mode="reduce-overhead"``).
"""
import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from revkernels.engine import budget, opaque
from revkernels.engine.state import NO_CONTEXT
from revkernels.nn.reversible import HalfCouplingBlock, ReversibleBlock, ReversibleSequential
from revkernels.nn.revvit import RevViTBlock
from tests.helpers import (TrackingLinear, assert_close_rel, compiled_saved_bytes, grads_of, loss_of, make_seq, perturb_parameters,
                           plain_forward, record_relu_input_signs, relu_kink_crossings, residual_fn, run_grads)

# Under torch.compile every memory-saving engine is the same opaque op running the sequential
# schedule on CPU, so "sequential" stands for pareprop and graphs too (compiled steps: test_compiled.py).
ENGINES = ["autograd", "sequential"]
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _data(*shape, device="cpu"):
    return [torch.randn(*shape, device=device) for _ in range(4)]


def _compiled_vs_eager(seq, data, tol=1e-5, **compile_kwargs):
    eager = _autograd_copy(seq)
    compiled = torch.compile(lambda a, b: seq(a, b), fullgraph=True, **compile_kwargs)
    # Copies right away: CUDA-graph outputs (mode="reduce-overhead" on a GPU) are overwritten by
    # the next replay.
    got = [None if t is None else t.clone() for t in run_grads(compiled, seq, *data)]
    torch.compiler.cudagraph_mark_step_begin()
    # the second call replays the compiled graph
    again = [None if t is None else t.clone() for t in run_grads(compiled, seq, *data)]
    expected = run_grads(eager, eager, *data)
    names = ["y1", "y2", "dx1", "dx2"] + [f"grad {n}" for n, _ in seq.named_parameters()]
    for a, b, c, name in zip(got, again, expected, names):
        assert_close_rel(a, c, tol, name)
        assert_close_rel(b, c, tol, name + " (second call)")


def _autograd_copy(seq):
    eager = copy.deepcopy(seq)
    eager.engine = "autograd"
    return eager


@pytest.mark.parametrize("engine", ENGINES)
def test_fullgraph_compile_every_engine_matches_eager_autograd(engine):
    seq = make_seq(2, 8, engine=engine)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _compiled_vs_eager(seq, _data(4, 8), backend="aot_eager")


class _OwnForward(ReversibleBlock):
    """A subclass with a forward of its own: the engines step it by its eager recompute/grads,
    which under torch.compile run inside the opaque op's kernels."""

    def forward_with_state(self, x1, x2, preserve_rng_state=True, context=NO_CONTEXT):
        return super().forward_with_state(x1, x2, preserve_rng_state, context)


def test_fullgraph_compile_block_with_a_forward_of_its_own():
    seq = perturb_parameters(ReversibleSequential(*[_OwnForward(residual_fn(8), residual_fn(8)) for _ in range(2)]))
    _compiled_vs_eager(seq, _data(4, 8), backend="aot_eager")


class _AddTable(nn.Module):
    """``0.5 x + table`` with a table of the stream's shape: the table's grad is an output grad itself."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return 0.5 * x + self.table


@pytest.mark.parametrize("half", [False, True])
def test_fullgraph_compile_parameter_grad_that_is_an_output_grad(half):
    """The backward op's outputs may alias neither its inputs nor each other: the tables' grads are
    dy1/dy2 or dx1 themselves (and a half block passes dy2 back as dx1)."""
    blocks = ([HalfCouplingBlock(_AddTable()) for _ in range(2)] if half
              else [ReversibleBlock(_AddTable(), _AddTable())])
    _compiled_vs_eager(ReversibleSequential(*blocks), _data(4, 8), backend="aot_eager")


def _real_and_fake_layouts(op, args):
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args))
    return [(t.shape, t.stride()) for t in tree_leaves(real)], [(t.shape, t.stride()) for t in tree_leaves(fake)], real


@pytest.mark.parametrize("exact", [False, True])
def test_opaque_ops_give_the_layouts_of_their_fake_kernels_and_alias_nothing(exact):
    """Inductor compiles against the fake kernels' strides: a half block over a transposed x1 (and a
    transposed dy1) must return what the fakes say (streams and grads laid out like the inputs and
    parameters they belong to; exact mode's int64 streams too), with no output sharing memory with
    an input or another output."""
    seq = ReversibleSequential(HalfCouplingBlock(_AddTable()), exact=exact)
    x1, x2 = torch.randn(8, 4).t(), torch.randn(4, 8)
    params = list(seq.parameters())
    handle, context = seq._opaque_handle, opaque.context_handle((), (), (), ())
    real, fake, (y1, y2, rng, fixed) = _real_and_fake_layouts(torch.ops.revkernels.reversible_run.default,
                                                              (handle, x1, x2, params, context, [], [], None, 0, exact))
    assert real == fake and len(fixed) == (2 if exact else 0)
    outputs = [t.untyped_storage().data_ptr() for t in (y1, y2, *fixed)]
    assert len(set(outputs)) == len(outputs) and not set(outputs) & {x1.untyped_storage().data_ptr(),
                                                                      x2.untyped_storage().data_ptr()}
    dy1, dy2 = torch.randn(8, 4).t(), torch.randn(4, 8)
    real, fake, grads = _real_and_fake_layouts(torch.ops.revkernels.reversible_run_backward.default,
                                               (handle, y1, y2, dy1, dy2, rng, params, context, [], [], None, fixed))
    assert real == fake
    storages = [t.untyped_storage().data_ptr() for t in tree_leaves(grads)]
    assert len(set(storages)) == len(storages)
    assert not set(storages) & {t.untyped_storage().data_ptr() for t in (y1, y2, dy1, dy2, *params, *fixed)}


def test_fullgraph_compile_of_a_deep_copy_runs_the_copys_blocks():
    """A copy (an EMA or teacher model) carries its original's attributes: compiled, it must run its
    own blocks, also after the original is gone."""
    data = _data(4, 8)

    def copy_of_a_compiled_run():
        original = make_seq(2, 8, engine="sequential")
        torch.compile(lambda a, b: original(a, b), fullgraph=True, backend="aot_eager")(*data[:2])
        return perturb_parameters(copy.deepcopy(original))

    _compiled_vs_eager(copy_of_a_compiled_run(), data, backend="aot_eager")


class _Model(nn.Module):
    """What a user compiles: a module holding a run."""

    def __init__(self, seq):
        super().__init__()
        self.seq = seq

    def forward(self, x1, x2):
        return self.seq(x1, x2)


def test_fullgraph_compile_of_many_instances_traces_once_and_runs_each_ones_blocks():
    """A new instance of a compiled model (a sweep, a notebook cell run again, a deep copy) reuses
    the traced graph: the run's handle is an input of the graph, not a constant guarded on the
    run's identity. Past Dynamo's recompile limit (8) a constant handle made fullgraph raise."""
    graphs = []

    def counting_aot_eager(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    data = _data(4, 8)
    models = [_Model(perturb_parameters(make_seq(2, 8, engine="sequential"))) for _ in range(10)]
    models.append(copy.deepcopy(models[3]))
    perturb_parameters(models[-1])
    for model in models:
        ref = copy.deepcopy(model.seq)
        got = run_grads(torch.compile(model, fullgraph=True, backend=counting_aot_eager), model, *data)
        expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
        for a, b in zip(got, expected, strict=True):
            assert_close_rel(a, b, 1e-5)
    assert len(graphs) == 1


def test_fullgraph_compile_follows_train_and_eval_of_dropout():
    """Which blocks draw random numbers sets the shape of the generator states the forward op
    returns (two rows per full block with active dropout): switching dropout on and off traces
    again, with the fake kernel's rows right, and each mode gives eager's grads."""
    rows = []

    def aot_eager_noting_rows(gm, example_inputs):
        [node] = [n for n in gm.graph.nodes if n.target is torch.ops.revkernels.reversible_run.default]
        rows.append(node.meta["example_value"][2].shape[0])
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    seq = make_seq(2, 8, engine="sequential", dropout=0.5)
    ref = copy.deepcopy(seq)
    fn = torch.compile(lambda a, b: seq(a, b), fullgraph=True, backend=aot_eager_noting_rows)
    data = _data(4, 8)
    for training in (True, False, True):
        seq.train(training)
        ref.train(training)
        got = run_grads(fn, seq, *data, seed=3)
        expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=3)
        for a, b in zip(got, expected, strict=True):
            assert_close_rel(a, b, 1e-5)
    assert rows == [4, 0]  # the third call is the first graph's


def test_trace_time_constants_are_marked_as_torchs_decorator_marks_them():
    """opaque marks its trace-time functions itself, so that importing revkernels does not import
    Dynamo (about 2 s): the mark must be the one torch.compiler.assume_constant_result sets."""
    def marked_by_torch():
        pass

    torch.compiler.assume_constant_result(marked_by_torch)
    for fn in (opaque.context_handle, opaque._raise_nested_tensors, budget._planned_options):
        assert {k: v for k, v in vars(fn).items() if not k.startswith("__")} == vars(marked_by_torch), fn


def test_importing_revkernels_does_not_import_dynamo_or_triton():
    code = ("import sys, revkernels, revkernels.petra.train, revkernels.bench.train; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'triton') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["[]"]


def test_fullgraph_compile_revvit_blocks():
    # RevViTBlock's fused custom ops run only in its recompute; its forward traces as plain ops.
    seq = perturb_parameters(ReversibleSequential(*[RevViTBlock(32, 4) for _ in range(2)], engine="sequential"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _compiled_vs_eager(seq, _data(2, 5, 32), backend="aot_eager")


def test_fullgraph_compile_revnet_with_recomputed_stages():
    # The reversible runs are opaque ops; the stem and downsampling stages go through
    # run_recomputed, checkpointed under compile.
    import revkernels as rk

    base = rk.models.revnet18(num_classes=10, stem="cifar", engine="sequential")
    # 16x16: at 8x8 the last stage's BatchNorms see two values per channel, and the grads flowing
    # through them are rounding noise (the opaque op's torch.func backward and eager autograd
    # differ there by 3e-2 relative). A draw whose rebuild moved a ReLU input across zero (about 1
    # in 400 here) is drawn again (relu_kink_crossings).
    for _ in range(3):
        model = copy.deepcopy(base)
        records = record_relu_input_signs(model)
        x = torch.randn(2, 3, 16, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch.compile(model, fullgraph=True, backend="aot_eager")(x).square().sum().backward()
        if relu_kink_crossings(records) == 0:
            break
    else:
        pytest.fail("three draws in a row put a ReLU input within rounding error of zero")
    reference = rk.models.revnet18(num_classes=10, stem="cifar", engine="autograd")
    reference.load_state_dict(base.state_dict())
    reference(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert_close_rel(p.grad, q.grad, 1e-5, name)
    for (name, b), r in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, r), name  # BatchNorm statistics counted once, as in eager autograd


def test_compile_does_not_warn():
    seq = make_seq(1, 8, engine="sequential")
    fn = torch.compile(lambda a, b: seq(a, b), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (4, 4, 6):  # a new shape recompiles
            fn(torch.randn(batch, 8, requires_grad=True), torch.randn(batch, 8))[0].sum().backward()
    assert not [w for w in caught if "revkernels" in str(w.message)]


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_compile_dropout_batchnorm_and_autocast(engine):
    # The opaque run draws its random numbers eagerly (the compiled engine's steps with
    # fallback_random): with the same seed, outputs, grads, BatchNorm running statistics (updated
    # once) and the RNG stream afterwards are those of eager plain autograd.
    seq = make_seq(2, 8, engine=engine, dropout=0.5, drop_path=0.3, norm="batch")
    seq.compile_options = {"backend": "aot_eager"}
    ref = copy.deepcopy(seq)
    data = _data(4, 8)
    fn = torch.compile(lambda a, b: seq(a, b), fullgraph=True, backend="aot_eager")
    got = run_grads(fn, seq, *data, seed=5)
    rng_after = torch.rand(4)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=5)
    assert torch.equal(rng_after, torch.rand(4))
    for a, b in zip(got, expected):
        assert_close_rel(a, b, 1e-5)
    for a, b in zip(seq.buffers(), ref.buffers()):
        assert torch.equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # streams stay fp32, F/G in bf16
        y1, y2 = fn(torch.randn(4, 8, requires_grad=True), torch.randn(4, 8))
    assert y1.dtype == y2.dtype == torch.float32
    (y1.sum() + y2.sum()).backward()


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_compile_blocks_changing_their_buffers(engine):
    # The forward kernel keeps the buffers its blocks changed (an EMA, a counter) with their old
    # values for the backward kernel's recompute, keyed by the memory of the run's output (the
    # compiled function returns the loss alone, so the output tensor objects die before the
    # backward; the memory lives on in the graph). Two steps give plain autograd's grads and
    # buffers (before, the recompute saw the changed buffers, and the pure steps of the backward
    # raised on the change in place); the entries expire with the graph.
    def build():
        torch.manual_seed(0)
        seq = ReversibleSequential(*[ReversibleBlock(TrackingLinear(8), TrackingLinear(8)) for _ in range(2)],
                                   engine=engine)
        seq.compile_options = {"backend": "aot_eager"}
        return perturb_parameters(seq)

    seq, ref = build(), build()
    x1, x2, w1, w2 = _data(4, 8)
    fn = torch.compile(lambda a, b: loss_of(*seq(a, b), w1, w2), fullgraph=True, backend="aot_eager")
    for _ in range(2):  # (grads accumulate over the steps in both)
        a1, a2, b1, b2 = (t.clone().requires_grad_() for t in (x1, x2, x1, x2))
        fn(a1, a2).backward()
        loss_of(*plain_forward(ref, b1, b2), w1, w2).backward()
        for got, expected in zip([a1.grad, a2.grad, *grads_of(seq.parameters())],
                                 [b1.grad, b2.grad, *grads_of(ref.parameters())], strict=True):
            assert_close_rel(got, expected, 1e-5)
        for (name, a), (_, b) in zip(seq.named_buffers(), ref.named_buffers(), strict=True):
            assert torch.equal(a, b), name
    # (this run's entries: other tests of the process may hold graphs of their own runs)
    ours = [weak for weak, (handle, _) in opaque._FORWARDS.items() if handle == int(seq._opaque_handle)]
    assert ours and all(weak.expired() for weak in ours)


class _Checkpointed(nn.Module):
    # (not test_compiled.py's: the structures whose steps failed are remembered by module types,
    # and a shared class would make each file's first-warning checks depend on the other's order)
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=False)


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_compile_blocks_that_checkpoint_inside_f(engine):
    # The backward kernel's pure steps (torch.func.vjp) take no saved-tensor hooks: such blocks run
    # the eager autograd steps there, with a warning, and give plain autograd's grads.
    def build():
        torch.manual_seed(0)
        seq = ReversibleSequential(*[ReversibleBlock(_Checkpointed(), residual_fn(8)) for _ in range(2)],
                                   engine=engine)
        seq.compile_options = {"backend": "aot_eager"}
        return perturb_parameters(seq)

    seq, ref = build(), build()
    data = _data(4, 8)
    fn = torch.compile(lambda a, b: seq(a, b), fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_grads(fn, seq, *data)
    assert any("run the sequential engine's eager steps" in str(w.message) for w in caught)
    for a, b in zip(got, run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)):
        assert_close_rel(a, b, 1e-5)


def _traced_ops(fn, *args):
    """The call_function targets of the graph Dynamo traces for ``fn(*args)`` (and its output)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}, out


@pytest.mark.parametrize("mode", ["no_grad", "frozen"])
def test_compile_of_a_call_that_differentiates_nothing_traces_the_blocks(mode):
    # Without grad (inference) the run is not an opaque op: the blocks' forward is in the graph,
    # for the compiler to optimize; with grad it is the op.
    seq = perturb_parameters(ReversibleSequential(*[RevViTBlock(16, 2) for _ in range(2)]))
    x = torch.randn(2, 5, 16)
    expected = plain_forward(seq, x, x)
    if mode == "frozen":
        seq.requires_grad_(False)
        ops, out = _traced_ops(lambda a, b: seq(a, b), x, x)
    else:
        with torch.no_grad():
            ops, out = _traced_ops(lambda a, b: seq(a, b), x, x)
    assert not any("reversible_run" in op for op in ops) and any("layer_norm" in op for op in ops), ops
    for a, e in zip(out, expected):
        assert_close_rel(a, e, 1e-6)
    seq.requires_grad_(True)
    ops, _ = _traced_ops(lambda a, b: seq(a, b), x, x)
    assert any("reversible_run" in op for op in ops), ops


def test_export_holds_the_blocks_ops_and_runs_without_revkernels(tmp_path):
    # An exported program must not call the opaque op (its kernel looks the run up in this
    # process): it holds the blocks' ops, and a process that never imports revkernels runs it.
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = ReversibleSequential(*[RevViTBlock(16, 2) for _ in range(2)])

        def forward(self, x):
            y1, y2 = self.seq(x, x)
            return y1 + y2

    model = perturb_parameters(Model()).eval()
    x = torch.randn(2, 5, 16)
    program = torch.export.export(model, (x,))
    assert not [n for n in program.graph.nodes if "revkernels" in str(n.target)]
    torch.export.save(program, tmp_path / "model.pt2")
    torch.save({"x": x, "y": model(x)}, tmp_path / "io.pt")
    code = ("import sys, torch; io = torch.load(sys.argv[2]); y = torch.export.load(sys.argv[1]).module()(io['x']); "
            "assert 'revkernels' not in sys.modules; assert torch.allclose(y, io['y'], atol=1e-6), (y - io['y']).abs().max()")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.pt2"), str(tmp_path / "io.pt")], check=True)


def test_a_dynamo_that_reads_is_exporting_as_true_still_calls_the_opaque_op(monkeypatch):
    # torch 2.11's Dynamo folds torch.compiler.is_exporting() to True under every trace: a stand-in
    # that Dynamo traces through (not the function it knows) reads True under every trace too. The
    # run reads torch.export's own flag: still one opaque op, saving the outputs alone at any depth.
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling())
    x = torch.randn(4, 8, requires_grad=True)
    saved = [compiled_saved_bytes(make_seq(depth, 8), x) for depth in (2, 6)]
    assert saved == [2 * x.numel() * x.element_size()] * 2, saved


def test_reduce_overhead_inductor_runs_on_cpu():
    # mode="reduce-overhead" adds CUDA graphs, which do not apply on CPU: it runs as inductor.
    seq = make_seq(1, 8, engine="sequential")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _compiled_vs_eager(seq, _data(4, 8), mode="reduce-overhead")


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["autograd", "sequential"])
def test_inductor_revvit_matches_eager(engine):
    seq = perturb_parameters(ReversibleSequential(*[RevViTBlock(32, 4) for _ in range(2)], engine=engine))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _compiled_vs_eager(seq, _data(2, 5, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["sequential", "graphs"])
def test_reduce_overhead_cuda_graphs(engine):
    seq = ReversibleSequential(*[RevViTBlock(32, 4) for _ in range(2)], engine=engine).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _compiled_vs_eager(seq, _data(2, 5, 32, device="cuda"), tol=1e-4, mode="reduce-overhead")


def _eval(seq):
    seq.eval()
    return seq.train


def _freeze(seq):
    weight = seq.blocks[1].g[0].weight
    weight.requires_grad_(False)
    return lambda: weight.requires_grad_(True)


def _unfreeze(seq):  # (frozen before the forward)
    weight = seq.blocks[0].f[0].weight
    weight.requires_grad_(True)
    return lambda: weight.requires_grad_(False)


def _rates(seq):
    layers = [m for m in seq.modules() if isinstance(m, torch.nn.Dropout)]
    for m in layers:
        m.p = 0.6
    return lambda: [setattr(m, "p", 0.3) for m in layers]


@pytest.mark.parametrize("change", [_eval, _freeze, _unfreeze, _rates], ids=["eval", "freeze", "unfreeze", "rates"])
@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_compile_differentiates_the_run_as_its_forward_ran(engine, change):
    # model.eval(), freezing or unfreezing a parameter, or dropout rates changed between a forward
    # and its backward: the opaque op's backward read the modes and requires_grad of the backward's
    # time (dropout and BatchNorm recomputed in eval mode: grads 0.6-0.8 off; a zip-length
    # ValueError), where the eager engines and autograd use the forward's
    def build():
        torch.manual_seed(0)
        seq = perturb_parameters(make_seq(3, 8, engine=engine, dropout=0.3, norm="batch"))
        seq.compile_options = {"backend": "aot_eager"}
        seq.blocks[0].f[0].weight.requires_grad_(False)
        return seq

    seq, ref = build(), build()
    ref.engine = "autograd"
    x1, x2, w1, w2 = _data(8, 8)
    fn = torch.compile(lambda a, b: seq(a, b), fullgraph=True, backend="aot_eager")

    def step(forward, module, change):
        for p in module.parameters():
            p.grad = None
        a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        torch.manual_seed(4)
        y1, y2 = forward(a1, a2)
        undo = change(module)
        loss_of(y1, y2, w1, w2).backward()
        undo()
        return [a1.grad, a2.grad] + [p.grad for p in module.parameters()]

    expected = step(ref, ref, change)
    for i, (got, want) in enumerate(zip(step(fn, seq, change), expected, strict=True)):
        assert (got is None) == (want is None), f"grad {i}"
        if want is not None:
            assert_close_rel(got, want, 1e-5, f"grad {i}")
    assert all(m.training for m in seq.modules())
