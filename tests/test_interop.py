"""Interop with the rest of PyTorch: activation checkpointing, tensor and module hooks,
state_dict across engines. What each engine does with module hooks is documented in
docs/support.md ("Module hooks"); these tests pin it down."""
import copy
import io
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from revkernels.nn.reversible import ReversibleSequential
from revkernels.nn.revvit import RevViTBlock
from tests.helpers import CPU_ENGINES, assert_close_rel, loss_of, make_seq, perturb_parameters, plain_forward

# pareprop and graphs run the sequential code on CPU (tests/helpers.py): listing them here would
# count it three times. Their CUDA code is tested under the `gpu` mark.
ENGINES = CPU_ENGINES
MEMORY_SAVING = [e for e in ENGINES if e != "autograd"]


@pytest.fixture(autouse=True)
def quiet_graphs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # graphs engine on CPU, eager fallback
        yield


def _data(shape=(4, 8)):
    return [torch.randn(*shape) for _ in range(4)]


def _leaves(x1, x2):
    return x1.clone().requires_grad_(), x2.clone().requires_grad_()


class Model(nn.Module):
    """stem (non-reversible) -> reversible run -> head (non-reversible)."""

    def __init__(self, engine, checkpointed, reentrant=False):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.run = make_seq(2, 8, engine=engine)
        self.head = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
        self.checkpointed, self.reentrant = checkpointed, reentrant

    def forward(self, x1, x2, plain=False):
        stage = (lambda m, *a: checkpoint(m, *a, use_reentrant=self.reentrant)) if self.checkpointed \
            else (lambda m, *a: m(*a))
        h = stage(self.stem, x1)
        y1, y2 = plain_forward(self.run, h, x2) if plain else self.run(h, x2)
        return stage(self.head, y1), y2


@pytest.mark.parametrize("engine,reentrant", [(e, False) for e in ENGINES] + [("sequential", True)])
def test_checkpointed_stages_next_to_a_reversible_run(engine, reentrant):
    model = Model(engine, checkpointed=True, reentrant=reentrant)
    x1, x2, w1, w2 = _data()
    results = []
    for plain in (False, True):
        model.zero_grad()
        a1, a2 = _leaves(x1, x2)
        loss_of(*model(a1, a2, plain=plain), w1, w2).backward()
        results.append([a1.grad, a2.grad] + [p.grad.clone() for p in model.parameters()])
    for i, (got, expected) in enumerate(zip(*results)):
        assert_close_rel(got, expected, 1e-5, f"grad {i}")


def test_checkpoint_around_a_reversible_run():
    # Pointless for memory, but legal: the recompute re-runs the engine's forward.
    seq = make_seq(2, 8)
    x1, x2, w1, w2 = _data()
    a1, a2 = _leaves(x1, x2)
    loss_of(*checkpoint(seq, a1, a2, use_reentrant=False), w1, w2).backward()
    got = [a1.grad, a2.grad] + [p.grad.clone() for p in seq.parameters()]
    seq.zero_grad()
    b1, b2 = _leaves(x1, x2)
    loss_of(*plain_forward(seq, b1, b2), w1, w2).backward()
    for g, e in zip(got, [b1.grad, b2.grad] + [p.grad for p in seq.parameters()]):
        assert_close_rel(g, e, 1e-5)


@pytest.mark.parametrize("engine", ENGINES)
def test_tensor_hooks_fire_once_with_the_full_gradient(engine):
    seq = make_seq(3, 8, engine=engine)
    x1, x2, w1, w2 = _data()
    b1, b2 = _leaves(x1, x2)
    loss_of(*plain_forward(seq, b1, b2), w1, w2).backward()
    param = seq.blocks[1].g[1].weight
    expected_param, expected_input = param.grad.clone(), b1.grad
    seq.zero_grad()
    calls = {"param": [], "input": []}
    param.register_hook(lambda g: calls["param"].append(g.clone()))
    a1, a2 = _leaves(x1, x2)
    a1.register_hook(lambda g: calls["input"].append(g.clone()))
    loss_of(*seq(a1, a2), w1, w2).backward()
    assert len(calls["param"]) == 1 and len(calls["input"]) == 1, {k: len(v) for k, v in calls.items()}
    assert_close_rel(calls["param"][0], expected_param, 1e-5, "param hook")
    assert_close_rel(calls["input"][0], expected_input, 1e-5, "input hook")


def _hook_log(module, name, log):
    module.register_full_backward_hook(lambda m, gi, go: log.append((name, gi, go)))


@pytest.mark.parametrize("engine", ENGINES)
def test_full_backward_hook_on_the_run_fires_once(engine):
    seq = make_seq(2, 8, engine=engine)
    log = []
    _hook_log(seq, "seq", log)
    x1, x2, w1, w2 = _data()
    a1, a2 = _leaves(x1, x2)
    y1, y2 = seq(a1, a2)
    y1.retain_grad()
    y2.retain_grad()
    loss_of(y1, y2, w1, w2).backward()
    assert [entry[0] for entry in log] == ["seq"]
    _, grad_input, grad_output = log[0]
    assert_close_rel(grad_input[0], a1.grad, 0, "grad_input[0]")
    assert_close_rel(grad_input[1], a2.grad, 0, "grad_input[1]")
    assert_close_rel(grad_output[0], y1.grad, 0, "grad_output[0]")
    assert_close_rel(grad_output[1], y2.grad, 0, "grad_output[1]")


def _submodule_hooks(seq, x1, x2, w1, w2, run=None):
    log, forward_calls = [], []
    block = seq.blocks[1]
    _hook_log(block, "block", log)
    _hook_log(block.f, "f", log)
    block.register_forward_hook(lambda m, i, o: forward_calls.append(("block", torch.is_grad_enabled())))
    block.f.register_forward_hook(lambda m, i, o: forward_calls.append(("f", torch.is_grad_enabled())))
    a1, a2 = _leaves(x1, x2)
    loss_of(*(run or seq)(a1, a2), w1, w2).backward()
    return log, forward_calls, [a1.grad, a2.grad] + [p.grad for p in seq.parameters()]


# "compiled": the hooked block runs the sequential engine's eager steps, the other one compiled
# steps (aot_eager: what inductor gets, without its code generation); "torch.compile": a
# sequential run as the opaque op of a fullgraph-compiled function (its backward kernel records
# autograd graphs for the hooked block)
@pytest.mark.parametrize("engine", MEMORY_SAVING + ["compiled", "torch.compile"])
def test_submodule_hooks_run_in_the_recompute(engine):
    """Generic blocks under a memory-saving engine: F's full backward hook fires once, during the
    backward's recompute, with the grads of plain autograd; F's forward hook fires twice (forward
    without grad, recompute with grad). The block's own forward and backward hooks never fire
    (the engine calls its forward_with_state/recompute/grads, not the module). All grads are
    plain autograd's."""
    x1, x2, w1, w2 = _data()
    seq = perturb_parameters(make_seq(2, 8, engine="sequential" if engine == "torch.compile" else engine))
    seq.compile_options = {"backend": "aot_eager"}
    reference = copy.deepcopy(seq)
    reference.engine = "autograd"
    ref_log, ref_calls, ref_grads = _submodule_hooks(reference, x1, x2, w1, w2)
    assert [e[0] for e in ref_log] == ["f", "block"] and ref_calls == [("f", True), ("block", True)]
    torch._dynamo.reset()
    run = torch.compile(seq, fullgraph=True, backend="aot_eager") if engine == "torch.compile" else None
    log, calls, grads = _submodule_hooks(seq, x1, x2, w1, w2, run)
    assert [e[0] for e in log] == ["f"]
    assert calls == [("f", False), ("f", True)]
    for got, expected in zip(log[0][1] + log[0][2], ref_log[0][1] + ref_log[0][2]):
        assert_close_rel(got, expected, 1e-5, "F's hook grads")
    for got, expected in zip(grads, ref_grads, strict=True):
        assert_close_rel(got, expected, 1e-5, "grads")


@pytest.mark.parametrize("engine", MEMORY_SAVING + ["compiled", "torch.compile"])
@pytest.mark.parametrize("grad", ["no_grad", "nothing_requires_grad"])
def test_a_blocks_own_hooks_never_fire_without_a_graph_either(engine, grad):
    """A forward that differentiates nothing called each block as a module, so the block's own
    hooks fired there and nowhere else: a hook changing the output made the run give other outputs
    with grad than without."""
    x1, x2, _, _ = _data()
    seq = perturb_parameters(make_seq(2, 8, engine="sequential" if engine == "torch.compile" else engine))
    seq.compile_options = {"backend": "aot_eager"}
    calls = []
    seq.blocks[1].register_forward_hook(lambda m, i, o: (calls.append("block"), (o[0] + 1, o[1]))[1])
    seq.blocks[1].register_forward_pre_hook(lambda m, i: calls.append("block pre"))
    seq.blocks[1].f.register_forward_hook(lambda m, i, o: calls.append("f"))
    run = torch.compile(seq, fullgraph=True, backend="aot_eager") if engine == "torch.compile" else seq
    with_graph = run(x1.clone().requires_grad_(), x2)
    assert calls == ["f"]
    if grad == "no_grad":
        with torch.no_grad():
            without = run(x1, x2)
    else:
        seq.requires_grad_(False)
        without = run(x1, x2)
    assert calls == ["f", "f"]
    for got, expected in zip(without, with_graph):
        assert_close_rel(got, expected.detach(), 0, "output without a graph")


@pytest.mark.parametrize("engine", MEMORY_SAVING + ["compiled"])
def test_a_hooked_revvit_block_runs_its_modules_in_the_recompute(engine):
    """A RevViTBlock with hooks below it runs its modules in the recompute too, as a generic block:
    F's forward hook fires twice, its full backward hook once with plain autograd's grads, and a
    hook that changes a submodule's output (fc1's, times 1.5) is in the rebuild as in the forward
    (the fused recompute computed F and G from their weights without it: grads 0.28 off)."""
    x = torch.randn(2, 3, 8)
    w1, w2 = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    seq = perturb_parameters(ReversibleSequential(*[RevViTBlock(8, 2) for _ in range(2)], engine=engine))
    seq.compile_options = {"backend": "aot_eager"}
    for block in seq.blocks:
        block.g.fc1.register_forward_hook(lambda m, i, o: o * 1.5)
    reference = copy.deepcopy(seq)
    reference.engine = "autograd"
    ref_log, ref_calls, ref_grads = _submodule_hooks(reference, x, x, w1, w2)
    torch._dynamo.reset()
    log, calls, grads = _submodule_hooks(seq, x, x, w1, w2)
    assert [e[0] for e in ref_log] == ["f", "block"] and ref_calls == [("f", True), ("block", True)]
    assert [e[0] for e in log] == ["f"] and calls == [("f", False), ("f", True)]
    for got, expected in zip(log[0][1] + log[0][2], ref_log[0][1] + ref_log[0][2]):
        assert_close_rel(got, expected, 1e-5, "F's hook grads")
    for got, expected in zip(grads, ref_grads, strict=True):
        assert_close_rel(got, expected, 1e-5, "grads")


def test_state_dict_round_trip_between_engines():
    seq = make_seq(3, 8, engine="sequential", norm="batch")
    x1, x2, w1, w2 = _data()
    for _ in range(2):  # move BatchNorm's running statistics
        loss_of(*seq(*_leaves(x1, x2)), w1, w2).backward()
    buffer = io.BytesIO()
    torch.save(seq.state_dict(), buffer)
    buffer.seek(0)
    other = make_seq(3, 8, engine="autograd", norm="batch")
    other.load_state_dict(torch.load(buffer))
    seq.eval()
    other.eval()
    with torch.no_grad():
        for a, b in zip(seq(x1, x2), other(x1, x2)):
            assert torch.equal(a, b)
    assert set(seq.state_dict()) == set(other.state_dict())


def _amp_grads(seq, x1, x2, w1, w2, device, dtype, scaler=None):
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    opt.zero_grad()
    a1, a2 = _leaves(x1, x2)
    with torch.autocast(device, dtype=dtype):
        y1, y2 = seq(a1, a2)
        loss = loss_of(y1, y2, w1, w2)
    assert y1.dtype == y2.dtype == torch.float32  # fp32 streams stay fp32 under autocast
    if scaler is None:
        loss.backward()
        return [a1.grad] + [p.grad.clone() for p in seq.parameters()]
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    grads = [a1.grad / scaler.get_scale()] + [p.grad.clone() for p in seq.parameters()]
    scaler.step(opt)  # finite grads: the step is taken and the scale kept
    scaler.update()
    return grads


@pytest.mark.parametrize("engine", ENGINES)
def test_grad_scaler_with_autocast(engine):
    # Scaling by a power of two is exact in bf16/fp32 (no overflow here): the unscaled grads
    # equal those of the unscaled backward.
    seq = make_seq(2, 8, engine=engine)
    data = _data()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    expected = _amp_grads(copy.deepcopy(seq), *data, "cpu", torch.bfloat16)
    got = _amp_grads(seq, *data, "cpu", torch.bfloat16, scaler)
    assert scaler.get_scale() == 2.0 ** 12  # no inf found, no growth yet
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_close_rel(g, e, 1e-6, f"grad {i}")


@pytest.mark.parametrize("engine", ENGINES)
def test_autocast_keeps_fp32_streams(engine):
    # F and G compute in bf16, the residual streams (and so the rebuild) stay in fp32.
    seq = perturb_parameters(ReversibleSequential(*[RevViTBlock(16, 2) for _ in range(2)], engine=engine))
    seen = []
    seq.blocks[0].g.fc1.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    x = torch.randn(2, 5, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = seq(x, x)
    assert y1.dtype == y2.dtype == torch.float32 and seen[0] == torch.bfloat16
    (y1.sum() + y2.sum()).backward()
    assert x.grad.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ENGINES)
def test_grad_scaler_fp16_cuda(engine):
    seq = make_seq(2, 8, engine=engine).cuda()
    data = [t.cuda() for t in _data()]
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12)
    expected = _amp_grads(copy.deepcopy(seq), *data, "cuda", torch.float16)
    got = _amp_grads(seq, *data, "cuda", torch.float16, scaler)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_close_rel(g, e, 1e-3, f"grad {i}")


class RecomputedStem(nn.Module):
    """stem kept by `run_recomputed` (as RevNet's stems and downsampling are) -> reversible run."""

    def __init__(self, run):
        super().__init__()
        self.stem, self.run = nn.Sequential(nn.Linear(8, 8), nn.GELU()), run

    def forward(self, x1, x2, plain=False):
        from revkernels.engine.recompute import run_recomputed

        h = self.stem(x1) if plain else run_recomputed(self.stem, x1)
        return plain_forward(self.run, h, x2) if plain else self.run(h, x2)


@pytest.mark.parametrize("kind", ["generic", "revvit"])
@pytest.mark.parametrize("engine", ["sequential", "compiled", "torch.compile"])
def test_a_step_under_the_flop_counter_gives_plain_autograds_grads(engine, kind):
    # FlopCounterMode's module tracker hangs multi-grad hooks on module inputs, which
    # torch.autograd.grad refused on the recompute's leaf inputs: every backward raised
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    run = make_seq(2, 8) if kind == "generic" else ReversibleSequential(RevViTBlock(8, 2), RevViTBlock(8, 2))
    model = perturb_parameters(RecomputedStem(run))
    run.engine = "sequential" if engine == "torch.compile" else engine
    run.compile_options = {"backend": "aot_eager"}
    call = torch.compile(model, backend="aot_eager") if engine == "torch.compile" else model
    x1, x2, w1, w2 = _data((2, 3, 8))
    results = []
    for plain in (False, True):
        a1, a2 = _leaves(x1, x2)
        model.zero_grad()
        with FlopCounterMode(display=False) as counter:
            loss_of(*(model(a1, a2, plain=True) if plain else call(a1, a2)), w1, w2).backward()
        assert counter.get_total_flops() > 0
        results.append([a1.grad, a2.grad] + [p.grad.clone() for p in model.parameters()])
    for got, want in zip(*results, strict=True):
        assert_close_rel(got, want)
