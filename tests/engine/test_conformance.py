"""The conformance table: every invariant of the design (docs/design.md "Invariants", docs/engines.md
"What the memory-saving engines guarantee") x every engine x every block kind.

Engines: "autograd" (the reference engine, checked too), "sequential", "pareprop", "graphs"
(both run the sequential schedule eagerly on CPU), "compiled" (aot_eager steps; its rows check that
the blocks ran compiled steps, not the eager ones it falls back to), "auto" (the default) and "torch.compile" (the run under ``torch.compile(fullgraph=True)``: the opaque op
``revkernels::reversible_run``, engine "sequential" inside). Block kinds: a generic
`ReversibleBlock(F, G)` of MLP branches, a `HalfCouplingBlock(F)`, a `RevViTBlock`, a causal
`RevTransformerBlock` with residual dropout and a padding mask (``attn_mask`` context keyword) and
a RevNet stage's reversible block (`ReversibleStage(BasicResidual)`: conv + fused BatchNorm).
Exact mode (``exact=True``: fixed-point streams) runs the invariants as a column of its own
(``exact``), its reference the fixed-point network written out with plain autograd
(`tests.helpers.fixed_point_forward`); its bit-exact rebuild is tested in tests/nn/test_exact.py.
A memory budget (``memory_budget=0.5``: plans mixing rebuilt, kept, selective and, under
torch.compile, checkpointed blocks) is a column of its own too, over the invariants of one step.

Every expected value comes from an independent reference: plain autograd through the same modules,
written out here (``y1 = x1 + F(x2); y2 = x2 + G(y1)``, or the half coupling with its swap), on a
deep copy of the run taken before anything ran, with the same seed where the blocks draw random
numbers. Parameters are moved off their initial values (`perturb_parameters`). fp32 results are
compared at a relative error of 1e-5; the RevNet stage runs in float64, where a rebuilt ReLU input
cannot land on the other side of the kink (in fp32 that happens by chance, see
`tests.helpers.relu_kink_crossings`).

The same table runs on CUDA under the `gpu` marker (the ``device`` parameter): there "graphs"
really captures, and "auto" picks it where the run can be captured. Where graphs cannot capture
(randomness to replay, context keywords) it runs eagerly with its documented warning, which the
table does not treat as a failure.
"""
import copy
import dataclasses
import warnings

import pytest
import torch
from torch import nn
from torch._dynamo.backends.registry import lookup_backend

import revkernels as rk
from revkernels.engine import budget
from revkernels.models.revnet import BasicResidual, ReversibleStage
from tests.helpers import assert_close_rel, fixed_point_forward, loss_of, perturb_parameters, residual_fn

WIDTH, HEADS, TOKENS, BATCH = 16, 2, 5, 3
CHANNELS, SIDE = 8, 4  # the RevNet stage's feature maps: (BATCH, CHANNELS, SIDE, SIDE)

ENGINES = ["autograd", "sequential", "pareprop", "graphs", "compiled", "auto", "torch.compile"]
KINDS = ["generic", "half", "revvit", "revtransformer", "revnet"]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]
EXACT = [False, True]  # float streams, exact mode's fixed-point streams


@pytest.fixture(scope="module", autouse=True)
def _own_dynamo_caches_and_one_thread():
    # The compiled engine shares its steps between runs with equal options and block signatures:
    # within this module they compile once per kind. Graphs compiled by other modules' tests must
    # not count towards a structure's recompile limit, nor ours towards theirs.
    # One intra-op thread: the toy sizes gain nothing from two, and on a busy 2-core machine two
    # threads wait on each other in every parallel region (the file took 4-7x longer). Every
    # comparison here is within the process, so the reduction order is the reference's too.
    threads = torch.get_num_threads()
    torch._dynamo.reset()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch._dynamo.reset()


# --- block kinds -------------------------------------------------------------------------------


class Noise(nn.Module):
    """Linear + noise drawn with torch.randn_like, which no module type reveals: it declares
    `draws_random` itself."""

    def __init__(self, width):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

    def draws_random(self):
        return self.training

    def forward(self, x):
        h = self.linear(self.norm(x))
        return h + 0.1 * torch.randn_like(h)


class Attention(nn.Module):
    """LayerNorm -> nn.MultiheadAttention (attention dropout) over (batch, tokens, width)."""

    def __init__(self, width, dropout):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, HEADS, dropout=dropout, batch_first=True)

    def forward(self, x):
        h = self.norm(x)
        return self.attn(h, h, h, need_weights=False)[0]


class Conditioned(nn.Module):
    """An MLP branch conditioned on the context: ``lin(LN(x) * (1 + scale(cond))) * keep``."""

    def __init__(self, width):
        super().__init__()
        self.norm, self.lin, self.scale = nn.LayerNorm(width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x, cond=None, keep=None):
        return self.lin(self.norm(x) * (1 + self.scale(cond))) * keep


class Case:
    """A run of blocks (parameters perturbed) with its streams' shape and dtype, its context and its
    coupling (`half`: the half coupling with a swap; else the full one)."""

    def __init__(self, blocks, shape, dtype=torch.float32, context=None, half=False, device="cpu", exact=False, budget=0):
        self.seq = perturb_parameters(rk.nn.ReversibleSequential(*blocks, exact=exact, memory_budget=budget))
        self.seq.to(device=device, dtype=dtype)
        self.shape, self.dtype, self.half, self.device, self.exact = shape, dtype, half, device, exact
        self.context = {k: v.detach().to(device).requires_grad_(v.requires_grad) for k, v in (context or {}).items()}

    def randn(self, requires_grad=False):
        return torch.randn(*self.shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad)

    def data(self):
        """x1, x2, w1, w2 (the loss weights)."""
        return [self.randn() for _ in range(4)]


def _padding_mask():
    # (batch, tokens), True attends; every row keeps its first tokens (causal rows stay non-empty)
    keep = torch.ones(BATCH, TOKENS, dtype=torch.bool)
    keep[1, 3:] = False
    keep[2, 4:] = False
    return keep


def make_case(kind, depth, device="cpu", random=None, exact=False, budget=0):
    """A run of `depth` blocks of `kind`: one of KINDS (the RevTransformerBlock's residual dropout
    and drop-path are part of its kind; `random=False` turns them off), a random source of
    RANDOM_SOURCES, a BatchNorm kind of BN_KINDS or a context kind of CONTEXT_KINDS; in exact mode
    with `exact`, with a memory budget `budget`. Its ``key`` names the run's structure."""
    w, tokens, rows = WIDTH, (BATCH, TOKENS, WIDTH), (BATCH * TOKENS, WIDTH)
    full, half = rk.nn.ReversibleBlock, rk.nn.HalfCouplingBlock
    rate = 0.0 if random is False else 0.2
    masked = {"context": {"attn_mask": _padding_mask()}}
    # a context tensor that requires grad (cond) and one that does not (keep)
    conditioned = {"context": {"cond": torch.randn(BATCH, 1, w, requires_grad=True),
                               "keep": (torch.rand(BATCH, TOKENS, 1) > 0.2).float()}}
    kinds = {  # kind: (a block, shape, Case keywords)
        "generic": (lambda: full(residual_fn(w), residual_fn(w)), tokens, {}),
        "half": (lambda: half(residual_fn(w)), tokens, {"half": True}),
        "revvit": (lambda: rk.nn.RevViTBlock(w, HEADS), tokens, {}),
        "revtransformer": (lambda: rk.nn.RevTransformerBlock(w, HEADS, causal=True, dropout=rate, drop_path=rate),
                           tokens, masked),
        "revnet": (lambda: ReversibleStage(BasicResidual(CHANNELS)), (BATCH, CHANNELS, SIDE, SIDE),
                   {"half": True, "dtype": torch.float64}),
        # random sources
        "dropout": (lambda: full(residual_fn(w, dropout=0.2), residual_fn(w, dropout=0.2)), tokens, {}),
        "mha_dropout": (lambda: full(Attention(w, 0.2), residual_fn(w)), tokens, {}),
        "declared": (lambda: full(Noise(w), residual_fn(w)), tokens, {}),
        "drop_path": (lambda: full(residual_fn(w, drop_path=0.4), residual_fn(w, drop_path=0.4)), tokens, {}),
        "half_dropout": (lambda: half(residual_fn(w, dropout=0.2)), tokens, {"half": True}),
        "revvit_drop_path": (lambda: rk.nn.RevViTBlock(w, HEADS, drop_path=0.4), tokens, {}),
        # BatchNorm kinds (running statistics), on rows of WIDTH features
        "generic_bn": (lambda: full(residual_fn(w, norm="batch"), residual_fn(w, norm="batch")), rows, {}),
        "half_bn": (lambda: half(residual_fn(w, norm="batch")), rows, {"half": True}),
        # context kinds
        "generic_context": (lambda: full(Conditioned(w), Conditioned(w)), tokens, conditioned),
        "half_context": (lambda: half(Conditioned(w)), tokens, {"half": True, **conditioned}),
    }
    block, shape, keywords = kinds[kind]
    case = Case([block() for _ in range(depth)], shape, device=device, exact=exact, budget=budget, **keywords)
    case.key = (kind, depth, device, random, exact, budget)
    return case


RANDOM_SOURCES = ["dropout", "mha_dropout", "declared", "drop_path", "half_dropout", "revvit_drop_path",
                  "revtransformer"]
BN_KINDS = ["revnet", "generic_bn", "half_bn"]
CONTEXT_KINDS = ["generic_context", "half_context"]


# --- running a step ------------------------------------------------------------------------------

class CountingAotEager:
    """The ``aot_eager`` backend, counting the calls of the graphs it compiles: the "compiled"
    engine's rows check that every block ran compiled steps (not the eager steps it falls back to)."""

    calls = 0

    def __call__(self, gm, example_inputs):
        compiled = lookup_backend("aot_eager")(gm, example_inputs)

        def run(*args):
            CountingAotEager.calls += 1
            return compiled(*args)

        run._boxed_call = getattr(compiled, "_boxed_call", False)
        return run


COMPILE_OPTIONS = {"backend": CountingAotEager()}
_COMPILED = {}


def compiled_call(case):
    """``torch.compile(fullgraph=True, backend="aot_eager")`` of ``seq(a, b, **context)``, one per run
    structure (`Case.key`), each with a code object of its own (Dynamo keeps its cache, recompile
    count and automatic-dynamic state per code object): runs of one structure share the traced
    graph, as new instances of a compiled model do (docs/compile.md), and no structure's graph
    counts towards another's recompile limit."""
    if case.key not in _COMPILED:
        def call(seq, a, b, context):
            return seq(a, b, **context)

        call.__code__ = call.__code__.replace(co_name=f"conformance_call_{len(_COMPILED)}")
        _COMPILED[case.key] = torch.compile(call, fullgraph=True, backend="aot_eager")
    return _COMPILED[case.key]


def engine_forward(engine, case, seq, x1, x2, context):
    """The run's forward under `engine` (a name of ENGINES)."""
    if engine == "torch.compile":
        seq.engine = "sequential"
        return compiled_call(case)(seq, x1, x2, context)
    seq.engine = engine
    if engine == "compiled":
        seq.compile_options = COMPILE_OPTIONS
    y1, y2 = seq(x1, x2, **context)
    if engine == "auto":
        assert seq.engine_in_use == expected_auto_pick(seq, x1, context)
    return y1, y2


def expected_auto_pick(seq, x1, context):
    """docs/engines.md "engine='auto'": graphs for CUDA inputs and a run that can be captured (no block
    draws random numbers, no context keywords), sequential otherwise."""
    if x1.is_cuda and not context and not any(block.draws_random() for block in seq.blocks):
        return "graphs"
    return "sequential"


def plain_forward(case, seq, x1, x2, context):
    """The run written out with ordinary autograd through the blocks' modules (in exact mode, the
    fixed-point network: `fixed_point_forward`)."""
    if case.exact:
        return fixed_point_forward(seq.blocks, x1, x2, context)
    for block in seq.blocks:
        if case.half:
            x1, x2 = x2, x1 + block.f(x2, **context)
        else:
            x1 = x1 + block.f(x2, **context)
            x2 = x2 + block.g(x1, **context)
    return x1, x2


def forward(engine, case, seq, x1, x2, context):
    if engine == "plain":
        return plain_forward(case, seq, x1, x2, context)
    with warnings.catch_warnings():
        # (graphs on CUDA: its documented fall-back warnings where it cannot capture)
        warnings.filterwarnings("ignore", message="revkernels: engine='graphs' runs this call eagerly")
        # (exact mode: the compiled engine runs the exact steps eagerly, as it warns once)
        warnings.filterwarnings("ignore", message="revkernels: the compiled engine runs exact mode's steps eagerly")
        return engine_forward(engine, case, seq, x1, x2, context)


def leaves_of(context):
    return {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in context.items()}


def step(engine, case, seq, data, seed=0):
    """One training step of `seq` under `engine` ("plain": the reference) on fresh leaf copies of the
    streams and the context: returns ``{name: tensor}`` of the outputs, the streams' and context's
    grads, every parameter's grad and the next numbers of the global generator."""
    x1, x2, w1, w2 = data
    for p in seq.parameters():
        p.grad = None
    a1, a2 = x1.detach().clone().requires_grad_(), x2.detach().clone().requires_grad_()
    context = leaves_of(case.context)
    torch.manual_seed(seed)
    compiled_calls = CountingAotEager.calls
    y1, y2 = forward(engine, case, seq, a1, a2, context)
    loss_of(y1, y2, w1, w2).backward()
    if engine == "compiled" and not case.exact:  # a forward and a backward step per rebuilt block (or per branch)
        compiled_calls = CountingAotEager.calls - compiled_calls
        rebuilt = seq.memory_plan(x1, x2, **context).first_kept if seq.memory_budget else len(seq.blocks)
        assert compiled_calls >= 2 * rebuilt, f"{compiled_calls} compiled step calls: eager steps ran"
    out = {"y1": y1.detach().clone(), "y2": y2.detach().clone(), "dx1": a1.grad, "dx2": a2.grad,
           "rng after": torch.cat([torch.rand(8), torch.rand(8, device=case.device).cpu()])}  # (CPU, device)
    out.update({f"grad {k}": v.grad for k, v in context.items() if v.requires_grad})
    out.update({f"grad {n}": None if p.grad is None else p.grad.clone() for n, p in seq.named_parameters()})
    return out


def assert_same(got, want, tol=1e-5):
    assert list(got) == list(want)
    for name in want:
        if want[name] is None:
            assert got[name] is None, f"{name}: {got[name]} where plain autograd gives None"
        else:
            assert got[name] is not None, f"{name}: None where plain autograd gives a tensor"
            assert_close_rel(got[name], want[name], tol, name)


def assert_plain_autograds(engine, case, seed=0):
    """One step under `engine` and one of plain autograd on a copy taken before it: the outputs and
    every grad agree. Returns the reference copy, after its step."""
    reference = copy.deepcopy(case.seq)
    data = case.data()
    got = step(engine, case, case.seq, data, seed)
    want = step("plain", case, reference, data, seed)
    del got["rng after"], want["rng after"]  # (test_global_rng_stream_after_a_step_is_plain_autograds)
    assert_same(got, want)
    if case.exact:  # the fixed-point network's outputs bit for bit: the same grid, the same integer sums
        assert torch.equal(got["y1"], want["y1"]) and torch.equal(got["y2"], want["y2"])
    return reference


# --- the invariants ----------------------------------------------------------------------------


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("depth", [1, 2, 3, 7])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_grads_equal_plain_autograd(engine, kind, depth, device, exact):
    assert_plain_autograds(engine, make_case(kind, depth, device, exact=exact))


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("source", RANDOM_SOURCES)
@pytest.mark.parametrize("engine", ENGINES)
def test_randomness_is_replayed(engine, source, device, exact):
    # nn.Dropout, nn.MultiheadAttention's attention dropout, randn_like noise of a module declaring
    # draws_random, DropPath, and the fused blocks' drop-path and residual dropout: the rebuild
    # replays the forward's draws, so the grads are plain autograd's with the same seed.
    assert_plain_autograds(engine, make_case(source, 3, device, exact=exact))


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", RANDOM_SOURCES + ["generic", "revnet"])  # (and two that draw nothing)
@pytest.mark.parametrize("engine", ENGINES)
def test_global_rng_stream_after_a_step_is_plain_autograds(engine, kind, device, exact):
    case = make_case(kind, 3, device, exact=exact)
    data = case.data()
    reference = copy.deepcopy(case.seq)
    got = step(engine, case, case.seq, data, seed=1)["rng after"]
    want = step("plain", case, reference, data, seed=1)["rng after"]
    assert torch.equal(got, want), "the step left the global generator elsewhere than plain autograd does"


def running_stats(seq):
    return {name: b.clone() for name, b in seq.named_buffers()
            if name.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")}


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", BN_KINDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_batch_norm_statistics_are_updated_once_per_step(engine, kind, device, exact):
    case = make_case(kind, 3, device, exact=exact)
    before = running_stats(case.seq)
    reference = assert_plain_autograds(engine, case)
    after, expected = running_stats(case.seq), running_stats(reference)
    assert before and list(after) == list(expected)
    for name in expected:
        assert not torch.equal(expected[name], before[name]), name  # (the reference's step moved them)
        if expected[name].is_floating_point():
            assert_close_rel(after[name], expected[name], 1e-5, name)
        else:
            assert torch.equal(after[name], expected[name]), f"{name}: {after[name]} != {expected[name]}"


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_parameter_hooks_fire_once_per_backward_with_the_full_grad(engine, kind, device, exact):
    case = make_case(kind, 2, device, exact=exact)
    data = case.data()
    want = step("plain", case, copy.deepcopy(case.seq), data)
    fired = {name: [] for name, p in case.seq.named_parameters()}
    for name, p in case.seq.named_parameters():
        p.register_hook(lambda g, name=name: fired[name].append(g.detach().clone()))
    for _ in range(2):  # (on CUDA the graphs engine captures in the first step and replays in the second)
        step(engine, case, case.seq, data)
    for name, grads in fired.items():
        assert len(grads) == 2, f"{name}: the hook fired {len(grads)} times in two backward calls"
        for g in grads:
            assert_close_rel(g, want[f"grad {name}"], 1e-5, f"{name}: the grad its hook saw")


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", CONTEXT_KINDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_context_grads_are_summed_over_blocks(engine, kind, device, exact):
    case = make_case(kind, 3, device, exact=exact)
    assert case.context["cond"].requires_grad
    assert_plain_autograds(engine, case)  # (the grads compared include cond's)


def _fingerprint(t):
    return t.detach().clone(), t._version, t.data_ptr(), t.untyped_storage().nbytes(), t.shape, t.stride()


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS + ["generic_context"])
@pytest.mark.parametrize("engine", ENGINES)
def test_caller_tensors_are_untouched(engine, kind, device, exact):
    # One leaf feeds both streams; the output grads and the context tensors (the transformer's mask,
    # a conditioning tensor that requires grad) are the caller's too.
    case = make_case(kind, 2, device, exact=exact)
    x, dy1, dy2 = case.randn(requires_grad=True), case.randn(), case.randn()
    reference = copy.deepcopy(case.seq)
    caller = {"x": x, "dy1": dy1, "dy2": dy2, **case.context}
    before = {name: _fingerprint(t) for name, t in caller.items()}
    torch.manual_seed(0)
    y1, y2 = forward(engine, case, case.seq, x, x, case.context)
    torch.autograd.backward((y1, y2), (dy1, dy2))
    for name, t in caller.items():
        value, version, ptr, nbytes, shape, stride = before[name]
        assert t._version == version, f"{name} was modified in place"
        assert (t.data_ptr(), t.untyped_storage().nbytes(), t.shape, t.stride()) == (ptr, nbytes, shape, stride), \
            f"{name}'s storage was freed, resized or replaced"
        assert torch.equal(t, value), f"{name}'s values changed"
    a = x.detach().clone().requires_grad_()
    torch.manual_seed(0)
    z1, z2 = plain_forward(case, reference, a, a, case.context)
    torch.autograd.backward((z1, z2), (dy1, dy2))
    assert_close_rel(x.grad, a.grad, 1e-5, "dx")


def saved_bytes(engine, case, seq):
    """Bytes autograd saves for the backward of one step of `seq` under `engine`, leaving out the
    parameters, the run's handle (an input of the opaque ops) and the generator states the opaque op
    keeps for blocks that draw random numbers (docs/compile.md: a few KB per such block)."""
    skip = {id(p) for p in seq.parameters()} | {id(seq._opaque_handle)}
    state_bytes = torch.get_rng_state().numel() + (torch.cuda.get_rng_state().numel() if case.device == "cuda" else 0)
    total = [0]

    def pack(t):
        generator_states = t.dtype == torch.uint8 and t.dim() == 2 and t.shape[1] == state_bytes
        if id(t) not in skip and not (engine == "torch.compile" and generator_states):
            total[0] += t.numel() * t.element_size()
        return t

    x1, x2, w1, w2 = case.data()
    x1.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y1, y2 = forward(engine, case, seq, x1, x2, case.context)
    loss_of(y1, y2, w1, w2).backward()
    return total[0]


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_saved_bytes_are_flat_in_depth(engine, kind, device, exact):
    shallow, deep = make_case(kind, 2, device, exact=exact), make_case(kind, 6, device, exact=exact)
    small, large = saved_bytes(engine, shallow, shallow.seq), saved_bytes(engine, deep, deep.seq)
    if engine == "autograd":
        assert large > small > 0  # (the reference stores every activation: the measure sees them)
    else:
        assert large == small > 0, f"depth 2 saves {small} bytes, depth 6 {large}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("engine", ENGINES)
def test_inverse_and_reverse_return_the_inputs_and_plain_autograds_grads(engine, kind, device):
    # reverse draws fresh randomness (its documented behaviour): the transformer without dropout
    case = make_case(kind, 3, device, random=False)
    x1, x2, dy1, dy2 = case.data()
    y1, y2 = (y.detach() for y in forward(engine, case, case.seq, x1, x2, case.context))
    reference = copy.deepcopy(case.seq)
    for p in case.seq.parameters():
        p.grad = None
    r1, r2 = case.seq.inverse(y1, y2, **case.context)
    assert_close_rel(r1, x1, 1e-5, "inverse x1")
    assert_close_rel(r2, x2, 1e-5, "inverse x2")
    result = case.seq.reverse(y1, y2, dy1, dy2, **case.context)
    a1, a2 = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    z1, z2 = plain_forward(case, reference, a1, a2, case.context)
    torch.autograd.backward((z1, z2), (dy1, dy2))
    for got, want, name in zip(result, (x1, x2, a1.grad, a2.grad), ("x1", "x2", "dx1", "dx2")):
        assert_close_rel(got, want, 1e-5, f"reverse {name}")
    for (name, p), q in zip(case.seq.named_parameters(), reference.parameters(), strict=True):
        assert_close_rel(p.grad, q.grad, 1e-5, f"reverse grad {name}")


@pytest.fixture
def fixed_block_times(monkeypatch):
    """The memory plan's measured bytes with fixed times (a forward 1 ms, a selective recompute
    0.2 ms, a checkpoint's 0.6 ms, no dispatch overhead), so each kind's plan is the same every run."""
    measured = budget.activation_bytes

    def measure(*args):
        return [dataclasses.replace(c, forward_ms=1.0, recompute_ms=0.2, ops=0,
                                    checkpoint_ms=None if c.checkpoint_ms is None else 0.6) for c in measured(*args)]

    monkeypatch.setattr(budget, "activation_bytes", measure)


def hook_grads(seq):
    """{parameter name: [the grads its tensor hook saw]}, hooks registered on every parameter."""
    fired = {name: [] for name, _ in seq.named_parameters()}
    for name, p in seq.named_parameters():
        p.register_hook(lambda g, name=name: fired[name].append(g.detach().clone()))
    return fired


@pytest.mark.parametrize("exact", EXACT)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS + ["dropout", "mha_dropout", "declared", "revvit_drop_path", "generic_bn",
                                          "generic_context"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_memory_budget_keeps_every_invariant(engine, kind, device, exact, fixed_block_times):
    # Half of plain autograd's bytes: a plan mixing rebuilt blocks (the engine's node) with blocks
    # kept whole, selectively and, in a torch.compile trace, checkpointed. One step gives plain
    # autograd's outputs and grads with the same seed (randomness replayed), leaves the global
    # generator where plain autograd does, updates BatchNorm's statistics once and fires each
    # parameter hook once with the full grad.
    case = make_case(kind, 4, device, exact=exact, budget=0.5)
    data = case.data()
    plan = case.seq.memory_plan(*data[:2], **case.context)
    traced = plan if plan.under_compile is None else plan.under_compile
    assert len(set(plan.options)) > 1 and len(set(traced.options)) > 1, (plan.options, traced.options)
    reference = copy.deepcopy(case.seq)
    before = running_stats(case.seq)
    fired = hook_grads(case.seq)
    got = step(engine, case, case.seq, data, seed=1)
    want = step("plain", case, reference, data, seed=1)
    assert torch.equal(got.pop("rng after"), want.pop("rng after")), "the global generator moved elsewhere"
    assert_same(got, want)
    for name, grads in fired.items():
        assert len(grads) == 1, f"{name}: the hook fired {len(grads)} times in one backward"
        assert_close_rel(grads[0], want[f"grad {name}"], 1e-5, f"{name}: the grad its hook saw")
    after, expected = running_stats(case.seq), running_stats(reference)
    assert list(after) == list(expected)
    for name in expected:
        assert not torch.equal(expected[name], before[name]), name
        assert_close_rel(after[name].double(), expected[name].double(), 1e-5, name)
