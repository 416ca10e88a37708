"""Context keywords (``seq(x1, x2, **context)``) on every engine, under ``torch.compile`` and in a
PETRA stage, against plain autograd through the same modules called with the same keywords.

The compiled engine's steps and the compiled graphs use the ``aot_eager`` backend (what inductor
gets, without its code generation; see tests/engine/test_compiled.py); every test here shares
its compiled steps (one set of options), so the steps compile once per signature for the file.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import revkernels as rk
from tests.helpers import CountingBackend, assert_close_rel, compiled_saved_bytes, grads_of, loss_of, rel_err, run_grads

WIDTH, BATCH, TOKENS, HEADS = 8, 3, 5, 2
AOT = {"backend": "aot_eager"}


@pytest.fixture(scope="module", autouse=True)
def dynamo_for_this_file():
    # The file's tests share their compiled graphs; other files start from a fresh Dynamo.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _perturbed_norm(width):
    norm = nn.LayerNorm(width)
    nn.init.normal_(norm.weight, 1.0, 0.3)
    nn.init.normal_(norm.bias, 0.0, 0.3)
    return norm


class MaskedAttention(nn.Module):
    """F: LayerNorm, FiLM by the conditioning vector, attention with a key padding mask, dropout."""

    def __init__(self):
        super().__init__()
        self.norm, self.film = _perturbed_norm(WIDTH), nn.Linear(WIDTH, WIDTH)
        self.qkv, self.drop = nn.Linear(WIDTH, 3 * WIDTH), nn.Dropout(0.2)

    def forward(self, x, attn_mask=None, cond=None, scale=1.0):
        h = self.norm(x) * (1 + self.film(cond)[:, None, :])
        q, k, v = self.qkv(h).reshape(BATCH, TOKENS, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None, None, :])
        return self.drop(scale * a.transpose(1, 2).reshape(BATCH, TOKENS, WIDTH))


class CondMlp(nn.Module):
    """G: LayerNorm, + conditioning vector, MLP, dropout; ignores the other keywords."""

    def __init__(self):
        super().__init__()
        self.norm = _perturbed_norm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH), nn.Dropout(0.2))

    def forward(self, x, cond=None, **context):
        return self.mlp(self.norm(x) + cond[:, None, :])


def _seq(depth, engine="sequential", compile_options=AOT):
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(MaskedAttention(), CondMlp()) for _ in range(depth)],
                                     engine=engine)
    seq.compile_options = compile_options  # (read by engine="compiled" only)
    return seq


def _context(cond_grad=True):
    mask = torch.rand(BATCH, TOKENS) > 0.3
    mask[:, 0] = True  # every query sees at least one key
    return {"attn_mask": mask, "cond": torch.randn(BATCH, WIDTH, requires_grad=cond_grad), "scale": 0.7}


def _plain(seq, x1, x2, context):
    for block in seq.blocks:
        x1 = x1 + block.f(x2, **context)
        x2 = x2 + block.g(x1, **context)
    return x1, x2


def _grads(fn, seq, x1, x2, context, w1, w2, seed):
    """Outputs, input grads, the cond grad and the parameter grads of one step of `fn`."""
    seq.zero_grad(set_to_none=True)
    cond = context["cond"].detach().requires_grad_()
    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    torch.manual_seed(seed)
    y1, y2 = fn(a1, a2, {**context, "cond": cond})
    loss_of(y1, y2, w1, w2).backward()
    return [y1.detach(), y2.detach(), a1.grad, a2.grad, cond.grad] + grads_of(seq.parameters())


def _assert_grads_equal_plain(seq, fn, tol=1e-5, context=None, seed=11):
    x1, x2 = torch.randn(BATCH, TOKENS, WIDTH), torch.randn(BATCH, TOKENS, WIDTH)
    w1, w2, context = torch.randn_like(x1), torch.randn_like(x2), context or _context()
    expected = _grads(lambda a, b, c: _plain(seq, a, b, c), seq, x1, x2, context, w1, w2, seed=seed)
    actual = _grads(fn, seq, x1, x2, context, w1, w2, seed=seed)
    assert expected[4].abs().sum() > 0
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close_rel(a, e, tol, f"output/grad {i}")


@pytest.mark.parametrize("engine", ["autograd", "sequential", "pareprop", "graphs", "compiled"])
@pytest.mark.parametrize("depth", [1, 2, 5])
def test_context_grads_equal_plain_autograd(engine, depth):
    seq = _seq(depth, engine)
    _assert_grads_equal_plain(seq, lambda a, b, c: seq(a, b, **c))


class ScaledMlp(nn.Module):
    """F and G taking one plain keyword: ``scale * tanh(linear(x))`` (scale 1 by default)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, scale=1.0):
        return scale * torch.tanh(self.linear(x))


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "graphs", "compiled"])
def test_context_of_plain_values_only_reaches_the_recompute(engine):
    """``seq(x1, x2, scale=0.3)``: no context tensor, yet the recompute calls F and G with the
    forward's keywords (not their defaults), so the grads are plain autograd's."""
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(ScaledMlp(), ScaledMlp()) for _ in range(2)],
                                     engine=engine)
    seq.compile_options = AOT
    x1, x2, w1, w2 = (torch.randn(BATCH, WIDTH) for _ in range(4))
    expected = run_grads(lambda a, b: _plain(seq, a, b, {"scale": 0.3}), seq, x1, x2, w1, w2)
    actual = run_grads(lambda a, b: seq(a, b, scale=0.3), seq, x1, x2, w1, w2)
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


def test_fullgraph_compile_takes_a_changing_scalar_as_a_0d_tensor_without_tracing_again():
    """docs/context.md's advice for a value that changes every step (a float is specialized)."""
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(ScaledMlp(), ScaledMlp()) for _ in range(2)])
    backend = CountingBackend()
    fn = torch.compile(lambda a, b, s: seq(a, b, scale=s), fullgraph=True, backend=backend)
    x1, x2, w1, w2 = (torch.randn(BATCH, WIDTH) for _ in range(4))
    for value in (0.3, 0.7, 1.9):
        scale = torch.tensor(value)
        expected = run_grads(lambda a, b: _plain(seq, a, b, {"scale": value}), seq, x1, x2, w1, w2)
        actual = run_grads(lambda a, b: fn(a, b, scale), seq, x1, x2, w1, w2)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close_rel(a, e, 1e-5, f"scale {value}: output/grad {i}")
    assert backend.graphs == 1


class TableScaled(nn.Module):
    """F and G taking a pair of tensors in one keyword: ``tanh(linear(x)) * pair[0] + pair[1]``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, pair):
        return torch.tanh(self.linear(x)) * pair[0] + pair[1]


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "graphs", "compiled"])
def test_tensors_requiring_grad_inside_a_context_container_raise(engine):
    """Only top-level context tensors are differentiated by the memory-saving engines: a pair that
    requires grad raises, naming the keyword (plain autograd's engine and a pair without grad run)."""
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(TableScaled(), TableScaled()) for _ in range(2)],
                                     engine=engine)
    seq.compile_options = AOT
    x1, x2 = torch.randn(BATCH, WIDTH, requires_grad=True), torch.randn(BATCH, WIDTH)
    pair = (torch.randn(WIDTH, requires_grad=True), torch.randn(WIDTH))
    with pytest.raises(TypeError, match="context 'pair' holds tensors that require grad inside a tuple"):
        seq(x1, x2, pair=pair)
    with pytest.raises(TypeError, match="context 'pair' holds tensors that require grad inside a list"):
        seq.reverse(x1.detach(), x2, x1.detach(), x2, pair=list(pair))
    loss_of(*seq(x1, x2, pair=tuple(t.detach() for t in pair)), 1.0, 1.0).backward()
    seq.engine = "autograd"
    loss_of(*seq(x1, x2, pair=pair), 1.0, 1.0).backward()
    assert pair[0].grad is not None


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "graphs", "compiled"])
@pytest.mark.parametrize("container", [tuple, list, lambda pair: dict(enumerate(pair))], ids=["tuple", "list", "dict"])
def test_tensors_inside_a_context_container_are_the_forwards(engine, container):
    """A container's tensors are saved by the run like its top-level ones: one changed in place
    between the forward and the backward raises autograd's error (as with plain autograd, which
    saved it), and an element the caller replaces is not seen (the rebuild used the changed values
    before: wrong grads, no error)."""
    seq = rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(TableScaled(), TableScaled()) for _ in range(2)],
                                     engine=engine)
    seq.compile_options = AOT
    x1, x2, w1, w2 = (torch.randn(BATCH, WIDTH) for _ in range(4))
    pair = [torch.randn(WIDTH), torch.randn(WIDTH)]
    expected = run_grads(lambda a, b: _plain(seq, a, b, {"pair": container(pair)}), seq, x1, x2, w1, w2)

    def replaced(a, b):
        held = container(list(pair))
        out = seq(a, b, pair=held)
        held[0] = torch.randn(WIDTH)  # the caller's own container, changed after the forward
        return out

    if container is not tuple:  # (a tuple's elements cannot be replaced)
        actual = run_grads(replaced, seq, x1, x2, w1, w2)
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close_rel(a, e, 1e-5, f"output/grad {i}")
    changed = [t.clone() for t in pair]
    y1, y2 = seq(x1.clone().requires_grad_(), x2, pair=container(changed))
    changed[0].mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_of(y1, y2, w1, w2).backward()


@pytest.mark.slow  # inductor code generation of four step graphs: ~45 s on 2 cores
def test_compiled_engine_with_inductor_and_context():
    # Compiled steps are within 1e-4 of eager (the mask and the float are inputs and guards, not
    # constants of a graph: the second call, with other values, reuses or recompiles correctly).
    seq = _seq(2, "compiled", compile_options={})
    _assert_grads_equal_plain(seq, lambda a, b, c: seq(a, b, **c), tol=1e-4)
    _assert_grads_equal_plain(seq, lambda a, b, c: seq(a, b, **c), tol=1e-4, seed=5)


def test_compiled_engine_compiles_once_per_signature_with_context():
    # The context's tensors are step inputs and its plain values part of the step's signature:
    # five blocks with dropout compile F's and G's forward and backward branch steps once; a new
    # value of `scale` compiles new steps and is used.
    backend = CountingBackend()
    seq = _seq(5, "compiled", compile_options={"backend": backend})
    for _ in range(2):
        _assert_grads_equal_plain(seq, lambda a, b, c: seq(a, b, **c))
        assert backend.graphs == 4
    _assert_grads_equal_plain(seq, lambda a, b, c: seq(a, b, **c), context={**_context(), "scale": 0.3})
    assert backend.graphs > 4
    seq.eval()  # no randomness to replay: one forward and one backward step for the whole block
    _assert_grads_equal_plain(seq, lambda a, b, c: seq(a, b, **c))


def _plain_half(seq, x1, x2, context):
    for block in seq.blocks:
        x1, x2 = x2, x1 + block.f(x2, **context)
    return x1, x2


@pytest.mark.parametrize("training", [True, False])
def test_compiled_engine_half_coupling_blocks_with_context(training):
    seq = rk.nn.ReversibleSequential(*[rk.nn.HalfCouplingBlock(MaskedAttention()) for _ in range(3)],
                                     engine="compiled").train(training)
    seq.compile_options = AOT
    x1, x2 = torch.randn(BATCH, TOKENS, WIDTH), torch.randn(BATCH, TOKENS, WIDTH)
    w1, w2, context = torch.randn_like(x1), torch.randn_like(x2), _context()
    expected = _grads(lambda a, b, c: _plain_half(seq, a, b, c), seq, x1, x2, context, w1, w2, seed=3)
    actual = _grads(lambda a, b, c: seq(a, b, **c), seq, x1, x2, context, w1, w2, seed=3)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_close_rel(a, e, 1e-5, f"output/grad {i}")


@pytest.mark.parametrize("engine,depth", [("sequential", 1), ("sequential", 5), ("compiled", 2)])
def test_fullgraph_compile_with_context_equals_plain_autograd(engine, depth):
    # The opaque op carries the context: tensors (cond's grad summed over blocks) and numbers,
    # here a float input of the compiled function (symbolic in the graph, so a new value is used).
    seq = _seq(depth, engine)
    fn = torch.compile(lambda a, b, c: seq(a, b, **c), fullgraph=True, backend="aot_eager")
    _assert_grads_equal_plain(seq, fn)
    _assert_grads_equal_plain(seq, fn, context={**_context(), "scale": 1.3}, seed=5)


def test_fullgraph_compile_saves_context_once_flat_in_depth():
    def saved_bytes(depth):
        seq = _seq(depth).eval()  # no dropout: no generator states saved
        return compiled_saved_bytes(seq, torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True), **_context())

    outputs = 2 * BATCH * TOKENS * WIDTH * 4
    assert saved_bytes(2) == saved_bytes(8) == outputs + BATCH * TOKENS + BATCH * WIDTH * 4  # y1, y2, mask, cond


def test_fullgraph_compile_context_errors_name_the_problem():
    class Shifted(nn.Module):
        def forward(self, x, shift=(), **context):
            return x * len(shift)

    seq = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(Shifted(), Shifted()))
    x = torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)  # (without grad the blocks' forward is traced)
    with pytest.raises(Exception, match=r"context values that are not tensors or numbers must be hashable, "
                                        r"got \{'shift': \[1, 2\]\}"):
        torch.compile(lambda a, b: seq(a, b, shift=[1, 2]), fullgraph=True, backend="aot_eager")(x, x)
    with pytest.raises(Exception, match=r"context's tensors must be keywords of their own, got tensors inside a "
                                        r"container for 'shift'"):
        torch.compile(lambda a, b: seq(a, b, shift=(x[0], x[1])), fullgraph=True, backend="aot_eager")(x, x)
    y1, _ = torch.compile(lambda a, b: seq(a, b, shift=(1, 2)), fullgraph=True, backend="aot_eager")(x, x)
    assert_close_rel(y1, 3 * x, 1e-6)


def test_context_tensors_are_saved_once_per_run():
    def saved_bytes(depth):
        seq = _seq(depth)
        x = torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)
        context = _context()
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            seq(x, x, **context)
        param_ptrs = {p.untyped_storage().data_ptr() for p in seq.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in param_ptrs)

    outputs = 2 * BATCH * TOKENS * WIDTH * 4
    assert saved_bytes(1) == saved_bytes(6) == outputs + BATCH * TOKENS + BATCH * WIDTH * 4  # y1, y2, mask, cond


def test_context_without_grad_and_rng_stream():
    # No context tensor requires grad: the run still differentiates the parameters; the global RNG
    # stream after a step is what plain autograd leaves.
    seq = _seq(2)
    x = torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)
    context = _context(cond_grad=False)
    torch.manual_seed(3)
    loss_of(*_plain(seq, x, x, context), 1.0, 1.0).backward()
    after_plain = torch.rand(4)
    expected = grads_of(seq.parameters())
    seq.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss_of(*seq(x, x, **context), 1.0, 1.0).backward()
    assert torch.equal(torch.rand(4), after_plain)
    for i, (a, e) in enumerate(zip(grads_of(seq.parameters()), expected)):
        assert_close_rel(a, e, 1e-5, f"param grad {i}")


def test_inverse_reverse_and_check_reversibility_with_context():
    seq = _seq(3).eval()  # no dropout: reverse and inverse draw no randomness to replay
    x1, x2 = torch.randn(BATCH, TOKENS, WIDTH), torch.randn(BATCH, TOKENS, WIDTH)
    w1, w2, context = torch.randn_like(x1), torch.randn_like(x2), _context()
    expected = _grads(lambda a, b, c: _plain(seq, a, b, c), seq, x1, x2, context, w1, w2, seed=0)
    y1, y2 = expected[0], expected[1]
    seq.zero_grad(set_to_none=True)
    result = seq.reverse(y1, y2, w1, 2 * y2 * w2, **context)
    r1, r2, dx1, dx2 = result
    for i, (a, e) in enumerate(zip([r1, r2, dx1, dx2, result.context_grads["cond"]] + grads_of(seq.parameters()),
                                   [x1, x2] + expected[2:])):
        assert_close_rel(a, e, 1e-5, f"reverse output {i}")
    assert set(result.context_grads) == {"cond"}
    i1, i2 = seq.inverse(y1, y2, **context)
    assert_close_rel(i1, x1, 1e-5, "inverse x1")
    assert_close_rel(i2, x2, 1e-5, "inverse x2")
    assert rk.check_reversibility(seq, x1, x2, **context).max_error < 1e-5
    # Without the context the rebuild is a different function: the check must see it.
    with pytest.raises(TypeError):
        rk.check_reversibility(seq, x1, x2)


def test_block_without_kwargs_is_named():
    plain = nn.Sequential(nn.Linear(WIDTH, WIDTH))
    seq = rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(MaskedAttention(), CondMlp()),
                                     rk.nn.ReversibleBlock(MaskedAttention(), plain))
    x = torch.randn(BATCH, TOKENS, WIDTH)
    context = _context()
    compiled = torch.compile(lambda a, b: seq(a, b, **context), fullgraph=True, backend="aot_eager")
    for call in (lambda: seq(x, x, **context), lambda: seq.inverse(x, x, **context),
                 lambda: seq.reverse(x, x, x, x, **context), lambda: rk.check_reversibility(seq, x, x, **context),
                 lambda: compiled(x, x)):
        # (under torch.compile the TypeError reaches the caller wrapped by Dynamo)
        with pytest.raises(Exception, match=r"blocks\[1\]\.g \(Sequential\) does not accept the context keyword"):
            call()
    with pytest.raises(TypeError, match=r"ReversibleBlock\.g \(Sequential\) does not accept"):
        seq.blocks[1](x, x, cond=torch.zeros(BATCH, WIDTH))
    # Blocks whose F and G take **kwargs work with any context; a run without context passes none.
    rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(CondMlp(), CondMlp()))(x, x, cond=torch.zeros(BATCH, WIDTH))
    rk.nn.ReversibleSequential(rk.nn.ReversibleBlock(plain, nn.Linear(WIDTH, WIDTH)))(x, x)


def test_petra_stage_passes_context_through():
    block = rk.nn.ReversibleBlock(MaskedAttention(), CondMlp()).eval()
    stage = rk.petra.partition([nn.Identity(), block, nn.Identity()])[1]
    x1, x2 = torch.randn(BATCH, TOKENS, WIDTH), torch.randn(BATCH, TOKENS, WIDTH)
    context = _context(cond_grad=False)
    y = stage.forward((x1, x2), **context)
    dy = (torch.randn_like(x1), torch.randn_like(x2))
    (r1, r2), (dx1, dx2) = stage.backward(y, dy, **context)
    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    z1, z2 = block(a1, a2, **context)
    torch.autograd.backward((z1, z2), dy)
    for a, e, name in ((r1, x1, "x1"), (r2, x2, "x2"), (dx1, a1.grad, "dx1"), (dx2, a2.grad, "dx2")):
        assert_close_rel(a, e, 1e-5, name)
    with pytest.raises(ValueError, match="context cond requires grad"):
        stage.backward(y, dy, **_context())


class BatchNormCond(nn.Module):
    """BatchNorm of the stream plus a conditioning vector, then a linear layer."""

    def __init__(self):
        super().__init__()
        self.bn, self.lin = nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, cond=None, **context):
        return self.lin(self.bn(x + cond))


def test_batchnorm_stats_updated_once_with_context():
    seqs = {engine: rk.nn.ReversibleSequential(*[rk.nn.ReversibleBlock(BatchNormCond(), BatchNormCond())
                                                 for _ in range(2)], engine=engine) for engine in ("autograd", "sequential")}
    seqs["sequential"].load_state_dict(seqs["autograd"].state_dict())
    x, w1, w2 = torch.randn(6, WIDTH), torch.randn(6, WIDTH), torch.randn(6, WIDTH)
    cond = torch.randn(6, WIDTH)
    results = {}
    for engine, seq in seqs.items():
        c = cond.clone().requires_grad_()
        loss_of(*seq(x, x, cond=c), w1, w2).backward()
        results[engine] = [c.grad] + grads_of(seq.parameters()) + [b.clone() for b in seq.buffers()]
    assert all(int(b) == 1 for n, b in seqs["sequential"].named_buffers() if n.endswith("num_batches_tracked"))
    for i, (a, e) in enumerate(zip(results["sequential"], results["autograd"])):
        assert_close_rel(a.double(), e.double(), 1e-5, f"cond grad/param grad/buffer {i}")


def test_autocast_with_context_follows_the_low_precision_rule():
    seq = _seq(2).eval()
    x1, x2 = torch.randn(BATCH, TOKENS, WIDTH), torch.randn(BATCH, TOKENS, WIDTH)
    w1, w2, context = torch.randn_like(x1), torch.randn_like(x2), _context()
    plain = (lambda a, b, c: _plain(seq, a, b, c))
    exact = _grads(plain, seq, x1, x2, context, w1, w2, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        same_dtype = _grads(plain, seq, x1, x2, context, w1, w2, seed=0)
        ours = _grads(lambda a, b, c: seq(a, b, **c), seq, x1, x2, context, w1, w2, seed=0)
    for i, (o, s, e) in enumerate(zip(ours, same_dtype, exact)):
        assert rel_err(o, e) <= 2 * rel_err(s, e) + 1e-6, f"output/grad {i}"


def test_the_registry_of_compiled_context_structures_is_bounded(monkeypatch):
    # one entry per distinct non-number context value, held for the process; now the most recent
    # MAX_CONTEXT_SPECS, and a handle dropped since raises naming the cause instead of a KeyError
    from revkernels.engine import opaque
    from revkernels.engine.structure import LRU

    monkeypatch.setattr(opaque, "_CONTEXT_HANDLES", LRU(4))
    monkeypatch.setattr(opaque, "_CONTEXT_SPECS", LRU(4))
    monkeypatch.setattr(opaque, "MAX_CONTEXT_SPECS", 4)
    handles = [opaque.context_handle(("mask",), (False,), (), (("mode", f"v{i}"),)) for i in range(6)]
    assert len(set(handles)) == 6 and len(opaque._CONTEXT_SPECS) == 4
    assert opaque.context_spec(handles[-1])[3] == (("mode", "v5"),)
    assert opaque.context_handle(("mask",), (False,), (), (("mode", "v5"),)) == handles[-1]
    with pytest.raises(RuntimeError, match="context structure .* no longer known"):
        opaque.context_spec(handles[0])
