"""The lean walker: structure computed once per module structure and rebuilt when it changes, RNG
state kept only for blocks that draw random numbers, and the fused block's fast paths (forward on
the parameters, hand-written backward) against plain autograd."""
import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import revkernels as rk
from revkernels.engine import structure
from revkernels.nn.revvit import RevViTBlock
from tests.helpers import assert_close_rel, loss_of, make_seq, perturb_parameters, plain_forward, residual_fn, run_grads

WIDTH = 8
pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # (the compiled engine's cases)


def _inputs(batch=4, width=WIDTH, shape=None):
    shape = shape or (batch, width)
    return [torch.randn(shape) for _ in range(4)]


def _assert_grads_equal_plain(seq, data, seed=None, tol=1e-5):
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=seed)
    actual = run_grads(seq, seq, *data, seed=seed)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a is None) == (e is None), f"output/grad {i}: presence differs"
        if e is not None:
            assert_close_rel(a, e, tol, f"output/grad {i}")


class _Counting:
    """Counts calls of nn.Module.named_parameters / named_modules while active."""

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in ("named_parameters", "named_modules", "modules", "parameters"):
            original = getattr(nn.Module, name)

            def counted(module, *args, _original=original, **kwargs):
                self.calls += 1
                return _original(module, *args, **kwargs)

            monkeypatch.setattr(nn.Module, name, counted)


@pytest.mark.parametrize("kind", ["generic", "fused"])
def test_a_step_walks_no_module_tree_once_the_structure_is_cached(kind, monkeypatch):
    if kind == "generic":
        seq = make_seq(3, WIDTH)
        data = _inputs()
    else:
        seq = rk.nn.ReversibleSequential(*[RevViTBlock(16, 2) for _ in range(3)])
        data = _inputs(shape=(2, 5, 16))
    params = list(seq.parameters())
    x1, x2, w1, w2 = data

    def step():
        a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        loss_of(*seq(a1, a2), w1, w2).backward()

    step()  # builds the caches
    counting = _Counting(monkeypatch)
    step()
    assert counting.calls == 0, f"{counting.calls} module-tree walks in a cached step"
    monkeypatch.undo()
    assert all(p.grad is not None for p in params)


def test_caches_rebuild_when_a_parameter_or_submodule_is_replaced():
    seq = make_seq(2, WIDTH)
    data = _inputs()
    _assert_grads_equal_plain(seq, data)  # caches built
    version = structure.structure_version()
    seq.blocks[0].f[1].weight = nn.Parameter(torch.randn(2 * WIDTH, WIDTH))  # a new parameter
    seq.blocks[1].g[3] = nn.Linear(2 * WIDTH, WIDTH)  # a new submodule
    assert structure.structure_version() > version
    _assert_grads_equal_plain(seq, data)
    new_weight = seq.blocks[0].f[1].weight
    run_grads(seq, seq, *data)
    assert new_weight.grad is not None and seq.blocks[1].g[3].weight.grad is not None


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_caches_rebuild_when_a_block_is_inserted_or_deleted_without_a_registration(engine):
    """ModuleList.insert and ``del`` write ``_modules`` directly (no registration hook fires): a
    block inserted after a step (progressive stacking: ``blocks.insert(i, deepcopy(blocks[i]))``)
    was run but never differentiated, its parameters' grads left None."""
    seq = make_seq(2, WIDTH, engine=engine)
    if engine == "compiled":
        seq.compile_options = {"backend": "eager"}
    perturb_parameters(seq)
    data = _inputs()
    _assert_grads_equal_plain(seq, data)  # caches built
    new = copy.deepcopy(seq.blocks[1])
    perturb_parameters(new)
    seq.blocks.insert(1, new)
    _assert_grads_equal_plain(seq, data)
    assert all(p.grad is not None for p in new.parameters())
    del seq.blocks[0]
    _assert_grads_equal_plain(seq, data)


def test_inverse_and_reverse_see_a_batchnorm_inserted_without_a_registration():
    """A BatchNorm inserted into F after a step: inverse, reverse and check_reversibility used the
    cached layer lists, which missed it, so they updated its running statistics."""
    seq = make_seq(2, WIDTH)
    norm = nn.BatchNorm1d(WIDTH)  # (made before the step: its registrations would drop the caches)
    x1, x2, w1, w2 = _inputs()
    loss_of(*seq(x1.requires_grad_(), x2), w1, w2).backward()  # caches built
    seq.blocks[1].f.insert(0, norm)
    y1, y2 = torch.randn_like(x1), torch.randn_like(x2)
    before = [t.clone() for t in norm.buffers()]
    for rebuild in (lambda: seq.inverse(y1, y2), lambda: seq.reverse(y1, y2, w1, w2),
                    lambda: rk.check_reversibility(seq, x1.detach(), x2)):
        rebuild()
        assert all(torch.equal(a, b) for a, b in zip(norm.buffers(), before))


def test_a_block_appended_between_the_forward_and_its_backward_raises():
    seq = make_seq(2, WIDTH)
    x1, x2, w1, w2 = _inputs()
    y1, y2 = seq(x1.requires_grad_(), x2)
    seq.blocks.append(copy.deepcopy(seq.blocks[0]))
    with pytest.raises(RuntimeError, match="gained or lost parameters"):
        loss_of(y1, y2, w1, w2).backward()


def test_caches_rebuild_when_a_dropout_is_inserted_into_f_without_a_registration():
    """nn.Sequential.insert inside F after a step: the block's cached stochastic layers missed the
    new dropout, so the recompute drew a fresh mask instead of replaying the forward's."""
    seq = make_seq(2, WIDTH)
    perturb_parameters(seq)
    data = _inputs()
    _assert_grads_equal_plain(seq, data, seed=0)  # caches built
    seq.blocks[0].f.insert(2, nn.Dropout(0.5))
    _assert_grads_equal_plain(seq, data, seed=1)
    del seq.blocks[0].f[2]
    seq.blocks[1].g.insert(1, nn.Dropout(0.5))
    _assert_grads_equal_plain(seq, data, seed=2)


def test_a_buffer_assigned_again_keeps_the_caches_and_a_new_one_rebuilds_them():
    """Spectral norm's power iteration assigns its vectors (buffers) in every training forward; no
    cache holds buffers, so that must not rebuild every cache each step. A buffer under a new name
    still counts as a structure change."""
    norm = nn.utils.parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH))
    version = structure.structure_version()
    norm(torch.randn(3, WIDTH))
    assert structure.structure_version() == version
    norm.register_buffer("extra", torch.zeros(1))
    assert structure.structure_version() > version


def _conversion_run(kind, device=None):
    with torch.device(device or "cpu"):
        if kind == "generic":
            return make_seq(2, WIDTH), (4, WIDTH)
        if kind == "compiled":
            seq = make_seq(2, WIDTH, engine="compiled")
            seq.compile_options = {"backend": "eager"}
            return seq, (4, WIDTH)
        return rk.nn.ReversibleSequential(*[RevViTBlock(WIDTH, 2, mlp_ratio=2.0) for _ in range(2)]), (2, 3, WIDTH)


@pytest.mark.parametrize("kind", ["generic", "fused", "compiled"])
def test_caches_rebuild_when_a_conversion_replaces_the_parameters(kind):
    """With torch.__future__.set_overwrite_module_params_on_conversion(True), Module._apply
    (``.double()``) writes new Parameters into the modules without a registration: a run that
    stepped before must differentiate the new ones (it gave them no grad at all)."""
    seq, shape = _conversion_run(kind)
    perturb_parameters(seq)
    _assert_grads_equal_plain(seq, _inputs(shape=shape))  # caches built
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        old = list(seq.parameters())
        seq.double()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert not any(p is q for p, q in zip(seq.parameters(), old))
    _assert_grads_equal_plain(seq, [t.double() for t in _inputs(shape=shape)])
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in seq.parameters())


@pytest.mark.parametrize("kind", ["generic", "fused"])
def test_a_run_stepped_on_the_meta_device_trains_after_to_empty(kind):
    """A dry run on the meta device (shapes, FLOP counts) before ``to_empty``: Module._apply cannot
    move a meta tensor in place, so the parameters are new objects afterwards."""
    seq, shape = _conversion_run(kind, device="meta")
    with torch.device("meta"):
        x = torch.randn(shape, requires_grad=True)
        loss_of(*seq(x, x), 1.0, 1.0).backward()
    seq.to_empty(device="cpu")
    for m in seq.modules():
        if m is not seq and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    perturb_parameters(seq)
    _assert_grads_equal_plain(seq, _inputs(shape=shape))


@pytest.mark.parametrize("kind", ["generic", "fused", "compiled"])
@pytest.mark.parametrize("which", ["all", "some"])
def test_functional_call_differentiates_the_tensors_passed_in(kind, which):
    """torch.func.functional_call swaps tensors into the modules for the forward and puts the
    modules' own back before the backward runs: the rebuild must use the swapped-in tensors, and
    they get the grads (with `which`="some", not the first of a block's: the cheap stale check)."""
    seq, shape = _conversion_run(kind)
    perturb_parameters(seq)
    data = _inputs(shape=shape)
    run_grads(seq, seq, *data)  # the caches hold the modules' own parameters
    names = [n for n, _ in seq.named_parameters()]
    chosen = set(names if which == "all" else names[1::3])
    swapped = {n: (p.detach() + 0.1 * torch.randn_like(p)).requires_grad_()
               for n, p in seq.named_parameters() if n in chosen}
    ref = copy.deepcopy(seq)
    with torch.no_grad():
        for n, t in swapped.items():
            ref.get_parameter(n).copy_(t)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
    for p in seq.parameters():
        p.grad = None
    x1, x2, w1, w2 = data
    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    loss_of(*torch.func.functional_call(seq, swapped, (a1, a2)), w1, w2).backward()
    for a, e, what in zip((a1.grad, a2.grad), expected[2:4], ("dx1", "dx2")):
        assert_close_rel(a, e, 1e-5, what)
    for (name, p), e in zip(seq.named_parameters(), expected[4:], strict=True):
        assert_close_rel(swapped[name].grad if name in chosen else p.grad, e, 1e-5, name)
        assert name not in chosen or p.grad is None
    _assert_grads_equal_plain(seq, data)  # and the modules' own parameters again afterwards


def _layers_eval(module):
    for m in module.modules():
        if isinstance(m, (torch.nn.Dropout, torch.nn.modules.batchnorm._BatchNorm)):
            m.eval()


def _rates(module):
    return [(m, m.p) for m in module.modules() if isinstance(m, (torch.nn.Dropout, rk.nn.DropPath))]


def _change_rates(module):
    """Every dropout and drop-path rate changed (one of them to 0: the layer draws nothing now)."""
    before = _rates(module)
    for i, (m, p) in enumerate(before):
        m.p = 0.0 if i == 1 else min(2 * p, 0.9)
    return before


# A change made between a forward and its backward: (change(module) -> undo state, undo(module, state))
SWITCHES = {
    "model.eval()": (lambda m: m.eval(), lambda m, _: m.train()),
    "layers' eval()": (_layers_eval, lambda m, _: m.train()),
    "dropout rates": (_change_rates, lambda m, before: [setattr(layer, "p", p) for layer, p in before]),
}


def _grads_after_a_switch(fn, module, switch, data, seed=4):
    """``[dx1, dx2, *param grads]`` of one step of `fn` with `switch` (a SWITCHES key) made between
    its forward and its backward; the module's modes and rates are checked to be the switched ones
    after the backward, then the switch is undone."""
    change, undo = SWITCHES[switch]
    x1, x2, w1, w2 = data
    for p in module.parameters():
        p.grad = None
    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    torch.manual_seed(seed)
    y1, y2 = fn(a1, a2)
    state = change(module)
    switched = [m.training for m in module.modules()], [p for _, p in _rates(module)]
    loss_of(y1, y2, w1, w2).backward()
    assert ([m.training for m in module.modules()], [p for _, p in _rates(module)]) == switched
    undo(module, state)
    return [a1.grad, a2.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_a_switch_between_forward_and_backward_recomputes_as_the_forward_ran(switch, engine):
    """The backward rebuilds each block, and each module in it, in the train/eval mode its forward
    ran in and with the dropout and drop-path rates it ran with (dropout replayed, BatchNorm on
    batch statistics), as autograd's recorded graph does: also where only the dropout and BatchNorm
    layers were switched (only the blocks' own modes were put back: grads 1.6 off), and where only
    the rates changed (the recompute drew other masks from the replayed generator state)."""
    seq = perturb_parameters(make_seq(3, WIDTH, dropout=0.3, drop_path=0.2, norm="batch", engine=engine))
    seq.compile_options = {"backend": "aot_eager"}
    ref = copy.deepcopy(seq)
    data = _inputs(batch=8)
    expected = _grads_after_a_switch(lambda a, b: plain_forward(ref, a, b), ref, switch, data)
    for i, (a, e) in enumerate(zip(_grads_after_a_switch(seq, seq, switch, data), expected, strict=True)):
        assert_close_rel(a, e, 1e-5, f"grad {i}")
    for (name, a), (_, e) in zip(seq.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, e), name
    assert all(m.training for m in seq.modules())


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_fused_block_rates_changed_between_forward_and_backward_recompute_as_the_forward_ran(engine):
    """The fused rebuild of `RevTransformerBlock` (RevViTBlock's, with residual dropout) reads the
    rates of its ResidualDropout and DropPath layers: changed after the forward, the backward still
    replays the forward's masks."""
    torch.manual_seed(0)
    seq = perturb_parameters(rk.nn.ReversibleSequential(
        *[rk.nn.RevTransformerBlock(WIDTH, 2, drop_path=0.2, dropout=0.3) for _ in range(2)], engine=engine))
    seq.compile_options = {"backend": "aot_eager"}
    ref = copy.deepcopy(seq)
    data = _inputs(shape=(4, 3, WIDTH))
    expected = _grads_after_a_switch(lambda a, b: plain_forward(ref, a, b), ref, "dropout rates", data)
    got = _grads_after_a_switch(seq, seq, "dropout rates", data)
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert_close_rel(a, e, 1e-5, f"grad {i}")


class _ReadOnlyRate(nn.Module):
    """Dropout whose rate is a read-only property (set through `rate`)."""

    draws_random = True

    def __init__(self, rate):
        super().__init__()
        self.rate = rate

    @property
    def p(self):
        return self.rate

    def forward(self, x):
        return F.dropout(x, self.rate, self.training)


def test_a_read_only_rate_is_left_alone():
    """A layer's `p` without a setter cannot be put back: the backward runs (with the rate as it is
    then: docs/support.md, Limits) and the layer keeps it."""
    seq = make_seq(2, WIDTH)
    seq.blocks[0].f.append(_ReadOnlyRate(0.3))
    x1, x2, w1, w2 = _inputs()
    y1, y2 = seq(x1.clone().requires_grad_(), x2.clone().requires_grad_())
    seq.blocks[0].f[-1].rate = 0.5
    loss_of(y1, y2, w1, w2).backward()
    assert seq.blocks[0].f[-1].p == 0.5


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_a_module_added_to_a_block_between_forward_and_backward_raises(engine):
    """The train/eval modes the forward saved no longer fit the blocks' modules (one flag per
    module): a clear error, not modes put back on the wrong modules."""
    seq = make_seq(2, WIDTH, dropout=0.3, engine=engine)
    seq.compile_options = {"backend": "aot_eager"}
    x1, x2, w1, w2 = _inputs()
    y1, y2 = seq(x1.clone().requires_grad_(), x2.clone().requires_grad_())
    seq.blocks[0].g.append(torch.nn.Identity())
    with pytest.raises(RuntimeError, match="added to or removed from a run's blocks"):
        loss_of(y1, y2, w1, w2).backward()


def test_a_parameter_that_requires_grad_only_after_the_forward_gets_no_grad():
    """As with autograd, whose graph recorded the forward: no grad, and the others unchanged."""
    seq = perturb_parameters(make_seq(2, WIDTH))
    ref = copy.deepcopy(seq)
    x1, x2, w1, w2 = _inputs()

    def step(fn, module):
        late = module.blocks[1].g[1].weight
        late.requires_grad_(False)
        for p in module.parameters():
            p.grad = None
        y1, y2 = fn(x1.clone().requires_grad_(), x2.clone().requires_grad_())
        late.requires_grad_(True)
        loss_of(y1, y2, w1, w2).backward()
        return [p.grad for p in module.parameters()]

    expected = step(lambda a, b: plain_forward(ref, a, b), ref)
    got = step(seq, seq)
    assert seq.blocks[1].g[1].weight.grad is None and ref.blocks[1].g[1].weight.grad is None
    for i, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert (a is None) == (e is None)
        if e is not None:
            assert_close_rel(a, e, 1e-5, f"grad {i}")


def test_parameters_swapped_without_a_registration_are_seen_in_fsdp_managed_modules():
    """FSDP2 writes ``module._parameters`` directly (no registration hook) and marks the modules it
    manages; the cached slots of such modules give the current parameters."""
    block = RevViTBlock(WIDTH, 2, mlp_ratio=2.0)
    slots = structure.param_slots(block)
    assert not slots.managed
    qkv = block.f.qkv
    swapped = nn.Parameter(torch.randn_like(qkv.weight))
    qkv._parameters["weight"] = swapped  # unmarked: the cache keeps what it saw
    assert structure.param_slots(block).by_name()["f.qkv.weight"] is not swapped
    for m in block.modules():
        m._is_fsdp_managed_module = True
    structure.invalidate()
    slots = structure.param_slots(block)
    assert slots.managed and slots.by_name()["f.qkv.weight"] is swapped
    qkv._parameters["weight"] = again = nn.Parameter(torch.randn_like(qkv.weight))
    assert structure.param_slots(block).by_name()["f.qkv.weight"] is again
    assert any(p is again for p in slots.params)  # refreshed in place: holders of `params` see it too
    x1, x2, w1, w2 = _inputs(shape=(2, 3, WIDTH))
    seq = rk.nn.ReversibleSequential(block)
    _assert_grads_equal_plain(seq, (x1, x2, w1, w2))  # the fused steps differentiate the current weight
    assert again.grad is not None


@pytest.mark.parametrize("engine", ["sequential", "compiled"])
def test_the_cache_keeps_no_module_alive(engine):
    """A model trained once and dropped is freed: no cached structure refers back to the module it
    is keyed on (F and G here own their parameters directly, so they are their own slots' owners)."""
    seq = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)),
                                     rk.nn.ReversibleBlock(nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, WIDTH)),
                                     engine=engine)
    x1, x2, w1, w2 = _inputs()
    if engine == "compiled":
        seq.compile_options = {"backend": "eager"}
    loss_of(*seq(x1.requires_grad_(), x2), w1, w2).backward()
    refs = [weakref.ref(m) for m in seq.modules()]
    del seq
    gc.collect()
    assert [r() for r in refs if r() is not None] == []
    bn = nn.BatchNorm1d(WIDTH)
    assert structure.running_stats_layers(bn) == [bn]  # a BatchNorm layer is its own layer, not its own cache's
    ref = weakref.ref(bn)
    del bn
    gc.collect()
    assert ref() is None


def test_requires_grad_changes_are_seen_without_a_structure_change():
    seq = make_seq(2, WIDTH)
    data = _inputs()
    run_grads(seq, seq, *data)
    frozen = seq.blocks[0].g[1].weight
    frozen.requires_grad_(False)
    grads = run_grads(seq, seq, *data)
    assert frozen.grad is None
    _assert_grads_equal_plain(seq, data)
    assert grads is not None


def test_deterministic_blocks_keep_no_rng_state(monkeypatch):
    seq = make_seq(3, WIDTH, dropout=0.5)
    seq.eval()  # dropout inactive: nothing to replay
    calls = []
    monkeypatch.setattr(torch, "get_rng_state", lambda *a: calls.append(1) or torch.default_generator.get_state())
    x1, x2, _, _ = _inputs()
    states = [block.forward_with_state(x1, x2)[2] for block in seq.blocks]
    assert states == [None] * 3 and not calls
    seq.train()
    assert all(block.draws_random() for block in seq.blocks)
    assert seq.blocks[0].forward_with_state(x1, x2)[2] is not None and calls


class _FunctionalDropout(nn.Module):
    """Draws randomness through F.dropout (invisible to module inspection) and declares it."""

    def __init__(self, width, p):
        super().__init__()
        self.linear, self.p = nn.Linear(width, width), p

    def draws_random(self):
        return self.training and self.p > 0

    def forward(self, x):
        return F.dropout(self.linear(x), self.p, self.training)


def test_a_block_that_declares_randomness_replays_it_exactly():
    blocks = [rk.nn.ReversibleBlock(_FunctionalDropout(WIDTH, 0.4), residual_fn(WIDTH)) for _ in range(3)]
    seq = rk.nn.ReversibleSequential(*blocks)
    data = _inputs(batch=16)
    seed = torch.randint(0, 2**31, ()).item()
    expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=seed)
    rng_after_reference = torch.rand(3)
    actual = run_grads(seq, seq, *data, seed=seed)
    rng_after_engine = torch.rand(3)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")
    assert torch.equal(rng_after_engine, rng_after_reference)


@pytest.mark.parametrize("options", [{}, {"drop_path": 0.3, "qkv_bias": False}])
def test_fused_block_with_random_parameters_equals_plain_autograd(options):
    seq = rk.nn.ReversibleSequential(*[RevViTBlock(16, 4, **options) for _ in range(3)])
    perturb_parameters(seq)
    _assert_grads_equal_plain(seq, _inputs(shape=(3, 6, 16)), seed=torch.randint(0, 2**31, ()).item())


def test_fused_block_with_frozen_parameters():
    seq = rk.nn.ReversibleSequential(*[RevViTBlock(16, 4) for _ in range(2)])
    perturb_parameters(seq)
    for p in (seq.blocks[0].f.qkv.weight, seq.blocks[1].g.fc1.bias, seq.blocks[1].f.norm.weight):
        p.requires_grad_(False)
    _assert_grads_equal_plain(seq, _inputs(shape=(2, 5, 16)))
    assert seq.blocks[0].f.qkv.weight.grad is None


def test_fused_forward_runs_the_modules_when_a_forward_hook_is_registered():
    seq = rk.nn.ReversibleSequential(*[RevViTBlock(16, 4, drop_path=0.2) for _ in range(2)])
    perturb_parameters(seq)
    seen = []
    handle = seq.blocks[1].g.fc1.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    data = _inputs(shape=(4, 5, 16))
    seed = torch.randint(0, 2**31, ()).item()
    _assert_grads_equal_plain(seq, data, seed=seed)
    assert seen  # the hook saw the engine's forward (and plain autograd's)
    handle.remove()
    _assert_grads_equal_plain(seq, data, seed=seed)


def test_lru_keeps_the_most_recently_used_entries():
    from revkernels.engine.structure import LRU

    cache = LRU(3)
    for k in "abc":
        cache[k] = k.upper()
    assert cache["a"] == "A"  # a used: b is now the oldest
    assert cache.get("c") == "C"
    cache["d"] = "D"
    assert list(cache) == ["a", "c", "d"] and cache.get("b") is None
    cache["a"] = "A2"
    cache["e"] = "E"
    assert list(cache) == ["d", "a", "e"] and len(cache) == 3


def test_the_engine_imports_nothing_from_nn():
    # the data path runs one way: nn -> engine -> ops; blocks declare what the engine needs
    import ast
    import pathlib

    engine = pathlib.Path(rk.engine.__file__).parent
    offenders = []
    for path in sorted(engine.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("revkernels.nn")]
    assert offenders == []


def test_blocks_declare_their_coupling():
    from revkernels.engine.structure import coupling_kind

    class OwnStep(rk.nn.ReversibleBlock):  # a forward step of its own, no coupling declared
        def forward_with_state(self, x1, x2, preserve_rng_state=True, context=None):
            return x1, x2, None

    class Declared(OwnStep):
        coupling = "full"

    class Plain(rk.nn.ReversibleBlock):  # inherits ReversibleBlock's step and its declaration
        pass

    lin = lambda: nn.Linear(4, 4)  # noqa: E731
    assert coupling_kind(rk.nn.ReversibleBlock(lin(), lin())) == "full"
    assert coupling_kind(rk.nn.HalfCouplingBlock(lin())) == "half"
    assert coupling_kind(rk.nn.RevViTBlock(8, 2)) == "full"
    assert coupling_kind(OwnStep(lin(), lin())) is None
    assert coupling_kind(Declared(lin(), lin())) == "full"
    assert coupling_kind(Plain(lin(), lin())) == "full"
