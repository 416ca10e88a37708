"""The compiled engine and the opaque op under torch.compile, against plain autograd.

- the pure steps run eagerly give plain autograd's grads (fp32, 1e-5) for generic blocks with
  dropout, drop-path and BatchNorm and for RevViTBlocks with drop-path, replay randomness and leave
  the RNG stream and BatchNorm statistics as plain autograd does;
- engine="compiled" with the ``aot_eager`` backend (what inductor gets, without its code
  generation, which takes tens of seconds per graph on a 2-core machine) does the same for generic
  blocks, a tiny RevNet-18 (HalfCouplingBlocks) and bf16 autocast (the low-precision rule); with
  inductor it is within 1e-4 of the eager steps, dropout included;
- on a GPU (marked gpu), inductor's CUDA steps of drop-path RevViTBlocks under bf16 autocast keep the
  low-precision rule, compile without falling back to eager steps, and leave the CUDA generator
  after the step where plain autograd's step leaves it;
- 12 identical ViT blocks compile one forward and one backward step; once compiled, a step runs
  its cache entry without Dynamo's frame hook where the guards pass, and compiles anew where they
  fail (a changed LayerNorm eps);
- ``torch.compile(fullgraph=True)`` over a memory-saving run saves the same bytes at depth 4 and
  16, and parameter hooks fire once.
"""
import contextlib
import copy
import sys
import types
import warnings

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import revkernels as rk
from revkernels.engine import compiled
from revkernels.engine.compiled import backward_blocks, compiled_steps, forward_blocks, keeps_guard
from revkernels.engine.structure import unique_grad_params
from revkernels.nn.reversible import ReversibleSequential
from revkernels.nn.revvit import RevViTBlock
from tests.helpers import (CountingBackend, assert_close_rel, compiled_saved_bytes, loss_of, make_seq,
                           perturb_parameters, plain_forward, rel_err, run_grads)

AOT = {"backend": "aot_eager"}
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _perturbed(seq):
    """Random non-identity LayerNorm weights and biases (a fresh LayerNorm is the identity map)."""
    with torch.no_grad():
        for m in seq.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    return seq


def _data(*shape):
    return [torch.randn(*shape) for _ in range(4)]


class _EagerSteps(torch.autograd.Function):
    """The run through the pure steps without compiling (the reference for compiled steps)."""

    @staticmethod
    def forward(ctx, seq, params, x1, x2, *param_tensors):
        y1, y2, ctx.states = forward_blocks(list(seq.blocks), x1, x2, None, seq.preserve_rng_state)
        ctx.seq, ctx.params = seq, params
        ctx.save_for_backward(y1, y2)
        return y1, y2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        _, _, dx1, dx2, grads = backward_blocks(list(ctx.seq.blocks), ctx.states, y1, y2, dy1, dy2, ctx.params, None)
        return (None, None, dx1, dx2, *grads)


def _eager_steps(seq):
    params = unique_grad_params(seq.blocks)
    return lambda a, b: _EagerSteps.apply(seq, params, a, b, *params)


def _assert_all_close(got, expected, tol, what=""):
    names = ["y1", "y2", "dx1", "dx2"] + [f"param grad {i}" for i in range(len(got) - 4)]
    assert len(got) == len(expected)
    for a, e, name in zip(got, expected, names):
        assert_close_rel(a, e, tol, what + name)


CONFIGS = {
    "layer_norm": dict(),
    "dropout_drop_path_batch_norm": dict(dropout=0.3, drop_path=0.25, norm="batch"),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_eager_steps_match_plain_autograd(config):
    seq = _perturbed(make_seq(3, 8, **CONFIGS[config]))
    ref = copy.deepcopy(seq)
    data = _data(6, 8)
    got = run_grads(_eager_steps(seq), seq, *data, seed=11)
    rng_after = torch.rand(4)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=11)
    _assert_all_close(got, expected, 1e-5)
    assert torch.equal(rng_after, torch.rand(4))  # the RNG stream is where plain autograd leaves it
    for a, b in zip(seq.buffers(), ref.buffers()):
        assert torch.equal(a, b)  # BatchNorm statistics updated once


def test_eager_steps_revvit_with_drop_path():
    seq = _perturbed(ReversibleSequential(*[RevViTBlock(16, 2, drop_path=0.3) for _ in range(2)]))
    ref = copy.deepcopy(seq)
    ref.engine = "autograd"
    data = _data(4, 3, 16)
    got = run_grads(_eager_steps(seq), seq, *data, seed=4)
    expected = run_grads(ref, ref, *data, seed=4)
    _assert_all_close(got, expected, 1e-5)


def test_eager_steps_follow_parameters_frozen_between_runs():
    """Which parameters the steps differentiate is read at every run: freezing some (in F and in
    G) after a run gives them no grad and leaves the others' grads those of plain autograd."""
    seq = _perturbed(make_seq(2, 8))
    ref = copy.deepcopy(seq)
    data = _data(6, 8)
    run_grads(_eager_steps(seq), seq, *data)
    for model in (seq, ref):
        for block in model.blocks:
            next(block.f.parameters()).requires_grad_(False)
            list(block.g.parameters())[-1].requires_grad_(False)
    got = run_grads(_eager_steps(seq), seq, *data)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
    assert [g is None for g in got] == [g is None for g in expected] and any(g is None for g in got)
    _assert_all_close([g for g in got if g is not None], [g for g in expected if g is not None], 1e-5)


def _revnet_grads(model, x):
    model.zero_grad()
    x = x.clone().requires_grad_()
    model(x).square().sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def test_compiled_engine_revnet18_half_coupling_blocks():
    model = rk.models.revnet18(num_classes=10, stem="cifar", engine="compiled")
    for run in model.modules():
        if isinstance(run, ReversibleSequential):
            run.compile_options = AOT
    reference = rk.models.revnet18(num_classes=10, stem="cifar", engine="autograd")
    reference.load_state_dict(model.state_dict())
    # The steps differentiate BatchNormAct2d's composition (the fused op does not support
    # torch.func); 16x16 keeps the last stage's BatchNorms off 1x1 maps (two values per channel
    # at batch 2), where the grads through them are rounding noise. float64: in fp32 about 1 draw
    # in 400 has a rebuilt ReLU input on the other side of zero (a real effect of any rebuild,
    # differentiated on the other side of the kink), which tests/models/test_revnet.py and
    # test_compile.py detect with forward hooks and draw again; hooks would route these blocks to
    # the eager steps, and float64's rebuild error leaves no ReLU input that close to zero.
    model.double(), reference.double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    got, expected = _revnet_grads(model, x), _revnet_grads(reference, x)
    for i, (a, e) in enumerate(zip(got, expected)):
        assert_close_rel(a, e, 1e-5, f"grad {i}")
    for (name, b), r in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, r), name


def test_compiled_engine_aot_matches_plain_autograd():
    seq = _perturbed(make_seq(3, 8, engine="compiled", **CONFIGS["dropout_drop_path_batch_norm"]))
    seq.compile_options = AOT
    ref = copy.deepcopy(seq)
    data = _data(6, 8)
    got = run_grads(seq, seq, *data, seed=11)
    rng_after = torch.rand(4)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=11)
    _assert_all_close(got, expected, 1e-5)
    assert torch.equal(rng_after, torch.rand(4))
    for a, b in zip(seq.buffers(), ref.buffers()):
        assert torch.equal(a, b)


def test_compiled_engine_inductor_within_1e4_of_eager_steps():  # two inductor graphs: ~20 s
    # Inductor with fallback_random: the compiled branch steps draw eager's dropout masks, and the
    # recompute replays them. (Deterministic blocks' fused steps: the aot_eager tests above.)
    seq = _perturbed(ReversibleSequential(rk.nn.ReversibleBlock(_mlp(dropout=0.3), _mlp(dropout=0.3)),
                                          engine="compiled"))
    data = _data(4, 8)
    got = run_grads(seq, seq, *data, seed=2)
    rng_after = torch.rand(4)
    eager = run_grads(_eager_steps(seq), seq, *data, seed=2)
    assert torch.equal(rng_after, torch.rand(4))
    _assert_all_close(got, eager, 1e-4)
    again = run_grads(seq, seq, *data, seed=2)  # compiled once: the second step reuses the graphs
    _assert_all_close(again, eager, 1e-4, "second call: ")


def _mlp(dropout=0.0):
    layers = [nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)]
    return nn.Sequential(*layers, nn.Dropout(dropout)) if dropout else nn.Sequential(*layers)


def _counted_vit_run(depth):
    """(graph-counting backend, a compiled run of `depth` RevViTBlocks on it, its autograd twin, data)."""
    backend = CountingBackend()
    seq = _perturbed(ReversibleSequential(*[RevViTBlock(16, 2) for _ in range(depth)], engine="compiled"))
    seq.compile_options = {"backend": backend}
    ref = copy.deepcopy(seq)
    ref.engine = "autograd"
    return backend, seq, ref, _data(2, 3, 16)


def test_inference_mode_compiles_one_forward_signature():
    """Under torch.inference_mode every block after the first got an inference tensor and the
    first the caller's (Dynamo guards on dispatch keys): two forward signatures per structure, which
    with a few structures reached the recompile limit and left their blocks eager for good."""
    backend, seq, ref, data = _counted_vit_run(3)
    run_grads(seq, seq, *data)
    assert backend.graphs == 2
    seq.eval()
    ref.eval()
    for _ in range(2):
        with torch.inference_mode():
            got = seq(data[0], data[1])
        assert all(t.is_inference() for t in got)
        _assert_all_close(list(got), list(ref(data[0], data[1])), 1e-5)
    assert backend.graphs == 3  # the eval-mode forward under inference mode, once


def test_twelve_vit_blocks_compile_one_forward_and_one_backward_step():
    backend, seq, ref, data = _counted_vit_run(12)
    got = run_grads(seq, seq, *data)
    assert backend.graphs == 2
    run_grads(seq, seq, *data)
    assert backend.graphs == 2  # no recompile on the next step
    _assert_all_close(got, run_grads(ref, ref, *data), 1e-5)


def test_steps_run_their_cache_entries_without_dynamos_frame_hook():
    """`run_step`: once compiled, a step call runs its cache entry's code directly: one compiled
    graph per block and direction, no Dynamo frame hook (its "Torch-Compiled Region" profiler
    events), a new generation per call as the hook's entry starts; under
    ``torch.compiler.set_stance("force_eager")`` Dynamo's hook decides and the steps run eagerly;
    the grads are autograd's throughout."""
    backend = CountingBackend()
    seq = _perturbed(ReversibleSequential(*[RevViTBlock(16, 2) for _ in range(3)], engine="compiled"))
    seq.compile_options = {"backend": backend}
    ref = copy.deepcopy(seq)
    ref.engine = "autograd"
    data = _data(2, 3, 16)
    expected = run_grads(ref, ref, *data)
    _assert_all_close(run_grads(seq, seq, *data), expected, 1e-5, "first step: ")
    backend.calls = 0
    generation = torch._dynamo.mutation_guard.GenerationTracker.generation
    with torch.profiler.profile() as profile:
        got = run_grads(seq, seq, *data)
    _assert_all_close(got, expected, 1e-5, "direct steps: ")
    assert backend.calls == 6 and backend.graphs == 2
    # a generation per step call, as the hook's entry starts one (CUDA graph trees count by them)
    assert torch._dynamo.mutation_guard.GenerationTracker.generation == generation + 6
    names = [e.name for e in profile.events()]
    assert not [name for name in names if name.startswith("Torch-Compiled Region")]
    assert names.count("revkernels step guards") == 6  # (a host profile counts it as Dynamo's entry)
    backend.calls = 0
    with torch.compiler.set_stance("force_eager"):
        got = run_grads(seq, seq, *data)
    _assert_all_close(got, expected, 1e-5, "force_eager: ")
    assert backend.calls == 0


def _counted_mlp_run():
    """Two generic MLP blocks on the compiled engine with a counting backend, a deep copy of them
    (the reference) and a batch."""
    backend = CountingBackend()
    seq = _perturbed(ReversibleSequential(*[rk.nn.ReversibleBlock(_mlp(), _mlp()) for _ in range(2)],
                                          engine="compiled"))
    seq.compile_options = {"backend": backend}
    return backend, seq, copy.deepcopy(seq), _data(4, 8)


def test_a_blocks_attribute_changed_after_the_first_step_compiles_new_steps():
    """Steps run directly (`run_step`) only where Dynamo's guards on their arguments pass: a
    LayerNorm eps changed between steps compiles new steps, which give plain autograd's grads with
    the new eps."""
    backend, seq, ref, data = _counted_mlp_run()
    for eps in (1e-5, 0.5):
        for model in (seq, ref):
            for m in model.modules():
                if isinstance(m, nn.LayerNorm):
                    m.eps = eps
        got = run_grads(seq, seq, *data)
        _assert_all_close(got, run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data), 1e-5, f"eps={eps}: ")
    assert backend.graphs == 4


def test_under_the_skip_guard_eval_unsafe_stance_steps_check_what_dynamo_checks():
    """Under ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` a step call checks what
    Dynamo's hook then checks, each entry's differentiating guards, and runs the entry directly: no
    frame hook, autograd's grads. A LayerNorm eps changed then runs the graphs compiled for the old
    eps (the stance's promise broken, as with any compiled code: the old eps' grads, no compile);
    out of the stance it compiles steps for the new eps, whose guard then tells the entries apart:
    under the stance again, the first eps' entry runs (the new one comes first in the cache). A
    call no entry's differentiating guards pass (float64) raises, as Dynamo's hook does, instead of
    compiling or leaving the blocks eager for good: out of the stance it compiles new steps."""
    backend, seq, ref, data = _counted_mlp_run()

    def set_eps(eps):
        for m in [*seq.modules(), *ref.modules()]:
            if isinstance(m, nn.LayerNorm):
                m.eps = eps

    def plain():
        return run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)

    def unsafe():
        return torch.compiler.set_stance(skip_guard_eval_unsafe=True)

    first = plain()
    _assert_all_close(run_grads(seq, seq, *data), first, 1e-5, "warm-up: ")
    with unsafe(), torch.profiler.profile() as profile:
        _assert_all_close(run_grads(seq, seq, *data), first, 1e-5, "under the stance: ")
    names = [e.name for e in profile.events()]
    assert not [name for name in names if name.startswith("Torch-Compiled Region")]
    assert names.count("revkernels step guards") == 4 and backend.graphs == 2
    set_eps(0.5)
    with unsafe():
        _assert_all_close(run_grads(seq, seq, *data), first, 1e-5, "eps=0.5 under the stance: ")
    assert backend.graphs == 2
    _assert_all_close(run_grads(seq, seq, *data), plain(), 1e-5, "eps=0.5: ")
    assert backend.graphs == 4
    set_eps(1e-5)
    with unsafe():
        _assert_all_close(run_grads(seq, seq, *data), first, 1e-5, "eps=1e-5 under the stance again: ")
    assert backend.graphs == 4
    seq.double()
    ref.double()
    data = [t.double() for t in data]
    with unsafe(), pytest.raises(RuntimeError, match=r"block_forward step of blocks\[0\].*skip_guard_eval_unsafe"):
        run_grads(seq, seq, *data)
    _assert_all_close(run_grads(seq, seq, *data), plain(), 1e-5, "float64: ")
    assert backend.graphs == 6


def test_a_stochastic_depth_schedule_compiles_its_branch_steps_once():
    """12 RevViTBlocks with a drop-path rate per block (0 to 0.2, as revvit/revswin build them):
    DropPath's rate is a graph input, so the blocks share their steps (the rate-0 block's block
    steps, F's and G's branch steps: 6 graphs) instead of reaching the recompile limit (each rate
    was a signature, and the blocks then ran eagerly); grads are the autograd engine's."""
    backend = CountingBackend()
    seq = _perturbed(ReversibleSequential(*[RevViTBlock(16, 2, drop_path=0.2 * i / 11) for i in range(12)],
                                          engine="compiled"))
    seq.compile_options = {"backend": backend}
    ref = copy.deepcopy(seq)
    ref.engine = "autograd"
    data = _data(2, 3, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (3, 4):
            got = run_grads(seq, seq, *data, seed=seed)
            _assert_all_close(got, run_grads(ref, ref, *data, seed=seed), 1e-5, f"seed {seed}: ")
    assert backend.graphs == 6 and not [str(w.message) for w in caught if "revkernels" in str(w.message)]


PARAMETRIZED = {  # F or G with parametrized linears: weight and bias of weight_norm, spectral norm's power iteration
    "weight_norm": lambda: nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 8)), nn.Tanh(),
                                         nn.utils.parametrizations.weight_norm(nn.Linear(8, 8), name="bias", dim=None)),
    "spectral_norm": lambda: nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)), nn.Tanh()),
}


@pytest.mark.parametrize("kind", PARAMETRIZED)
def test_parametrized_blocks_compile_one_forward_and_one_backward_step(kind):
    """torch.nn.utils.parametrize gives each parametrized module a class of its own, and Dynamo
    guards on classes: ten weight_norm blocks compiled ten times, and past the recompile limit (8)
    blocks[8:] ran eagerly with a warning. The steps run them under one shared class, for the call
    only. Spectral norm's power iteration assigns its vectors in every training forward, which bumped
    the structure version inside the traced step: every call compiled again. Grads and buffers are
    plain autograd's."""
    torch.manual_seed(0)
    branch = PARAMETRIZED[kind]
    seq = ReversibleSequential(*[rk.nn.ReversibleBlock(branch(), branch()) for _ in range(10)], engine="compiled")
    perturb_parameters(seq)  # weight_norm's g (a vector) and the parametrized biases
    classes = [type(m) for m in seq.modules()]
    backend = CountingBackend()
    seq.compile_options = {"backend": backend}
    ref = copy.deepcopy(seq)
    ref.engine = "autograd"
    data = _data(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _assert_all_close(run_grads(seq, seq, *data), run_grads(ref, ref, *data), 1e-5)
    assert not [w for w in caught if "revkernels" in str(w.message)]
    assert backend.graphs == 2
    assert [type(m) for m in seq.modules()] == classes  # each module's own class again
    for (name, a), (_, b) in zip(seq.named_buffers(), ref.named_buffers(), strict=True):
        assert torch.equal(a, b), name


class _Checkpointed(nn.Module):
    reentrant = False

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.net, x, use_reentrant=self.reentrant)


class _ReentrantCheckpointed(_Checkpointed):
    # (a class of its own: the structures whose steps failed are remembered by their module types)
    reentrant = True


class _Nested(nn.Module):
    """F holding a reversible run of its own (its autograd.Function has no setup_context)."""

    def __init__(self):
        super().__init__()
        self.inner = ReversibleSequential(*[rk.nn.ReversibleBlock(_mlp(), _mlp()) for _ in range(2)])

    def forward(self, x):
        y1, y2 = self.inner(x, 0.5 * x)
        return torch.tanh(y1 + y2)


@pytest.mark.parametrize("compile_it", [True, False], ids=["compiled", "pure-eager"])
@pytest.mark.parametrize("branch", [_Checkpointed, _Nested], ids=["checkpoint", "nested-run"])
def test_blocks_whose_pure_steps_fail_run_the_eager_steps(branch, compile_it):
    """torch.func.vjp takes no saved-tensor hooks (torch.utils.checkpoint in F) and no
    autograd.Function without setup_context (a nested run): the compiled backward raised, also
    from its eager fallback. Such a block now runs the sequential engine's eager steps, and so do
    the blocks of its structure without trying to compile: one warning; plain autograd's grads
    over two steps. A failed compile leaves torch's saved-tensor hooks disabled for the process;
    they are enabled again. Without compiled steps (the opaque op's kernels for the eager engines)
    the pure steps fail eagerly: the same."""
    def build():
        torch.manual_seed(0)
        seq = _perturbed(ReversibleSequential(*[rk.nn.ReversibleBlock(branch(), _mlp()) for _ in range(2)]))
        seq.compile_options = AOT
        return seq

    seq, ref = build(), build()
    seq.engine = "compiled"
    run = seq if compile_it else _eager_steps(seq)
    data = _data(4, 8)
    for step in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run_grads(run, seq, *data)
        messages = [str(w.message) for w in caught if "revkernels" in str(w.message)]
        if step == 0:  # blocks[1] fails first (the backward's first block); blocks[0] is of its structure
            assert len(messages) == 1 and "blocks[1]" in messages[0], messages
            assert "the blocks of its structure run the sequential engine's eager steps" in messages[0], messages
        else:
            assert not messages, messages
        assert torch._C._autograd._saved_tensors_hooks_is_enabled()
        _assert_all_close(got, run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data), 1e-5)


@pytest.mark.parametrize("engine", ["sequential", "pareprop", "graphs"])
def test_branches_that_checkpoint_run_with_the_eager_engines(engine):
    """docs/support.md (torch.utils.checkpoint inside F or G, use_reentrant=False): the eager engines' local
    graphs take its saved-tensor hooks; plain autograd's grads."""
    seq = _perturbed(ReversibleSequential(*[rk.nn.ReversibleBlock(_Checkpointed(), _mlp()) for _ in range(2)],
                                          engine=engine))
    data = _data(4, 8)
    _assert_all_close(run_grads(seq, seq, *data), run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data), 1e-5)


def test_branches_that_checkpoint_with_reentrant_autograd_raise_torchs_error():
    """docs/support.md (torch.utils.checkpoint): with use_reentrant=True inside F or G the memory-saving
    engines' backward, which differentiates with respect to given inputs, gets torch's error."""
    for engine in ("sequential", "compiled"):
        seq = ReversibleSequential(*[rk.nn.ReversibleBlock(_ReentrantCheckpointed(), _mlp()) for _ in range(2)],
                                   engine=engine)
        seq.compile_options = AOT
        with pytest.raises(RuntimeError, match="incompatible with .grad()"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_grads(seq, seq, *_data(4, 8))


def test_steps_are_shared_by_stride_0_grads_and_by_calls_from_the_opaque_op():
    """A loss like y.sum() hands down expanded grads, and under torch.compile the steps run inside
    the opaque op's kernels: neither is a signature of its own (one forward and one backward graph)."""
    backend = CountingBackend()
    seq = make_seq(2, 8, engine="compiled")
    seq.compile_options = {"backend": backend}
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    y1, y2 = seq(x, x)
    ((y1 * w).sum() + (y2 * w).sum()).backward()
    assert backend.graphs == 2
    y1, y2 = seq(x, x)
    (y1.sum() + y2.sum()).backward()
    assert backend.graphs == 2
    y1, y2 = torch.compile(lambda a, b: seq(a, b), fullgraph=True, backend="aot_eager")(x, x)
    ((y1 * w).sum() + (y2 * w).sum()).backward()
    assert backend.graphs == 2


def test_a_new_batch_size_with_dropout_compiles_static_steps():
    """The branch steps (blocks with active dropout) have static shapes by default: an odd batch (an
    epoch's last) compiles graphs of its own instead of a symbolic-size recompile, which cannot
    differentiate dropout under torch.func.vjp (every block then ran eagerly for good, with a
    warning); the grads are plain autograd's throughout."""
    seq = make_seq(2, 8, engine="compiled", dropout=0.3)
    seq.compile_options = AOT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in (6, 6, 5, 6):
            data = _data(batch, 8)
            expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=batch)
            _assert_all_close(run_grads(seq, seq, *data, seed=batch), expected, 1e-5, f"batch {batch}")
    assert not any(compiled_steps(seq, "cpu").fell_back(block) for block in seq.blocks)


def test_a_dropout_block_below_a_deterministic_one_keeps_static_steps():
    """The backward reaches the dropout block's static branch steps with the outputs of the block
    steps above it, which Dynamo marks with their dynamic sizes once those steps went dynamic: the
    branch step was traced with a symbolic batch size, F.dropout failed under torch.func.vjp, and
    the block ran eagerly for good with a warning at the second batch size (found by a probe)."""
    torch.manual_seed(0)
    blocks = [rk.nn.ReversibleBlock(_mlp(0.3), _mlp()), rk.nn.ReversibleBlock(_mlp(), _mlp())]
    seq = _perturbed(ReversibleSequential(*blocks, engine="compiled"))
    seq.compile_options = AOT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in (3, 4, 5):
            data = _data(batch, 8)
            expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data, seed=batch)
            _assert_all_close(run_grads(seq, seq, *data, seed=batch), expected, 1e-5, f"batch {batch}")
    assert not any(compiled_steps(seq, "cpu").fell_back(block) for block in seq.blocks)


@pytest.mark.parametrize("mark", ["_dynamo_propagated_dynamic_indices", "_dynamo_weak_dynamic_indices"])
def test_static_branch_steps_get_aliases_without_dynamic_size_marks(mark):
    # The marks that torch 2.13+ (propagated) and torch 2.11 (weak) leave on the outputs of a step
    # compiled with dynamic shapes: the test above, where 2.13 sets the first, covers the second on 2.11.
    t = torch.randn(3, 4)
    setattr(t, mark, {0})
    alias = compiled._unmarked(t)
    assert not hasattr(alias, mark) and alias.data_ptr() == t.data_ptr() and hasattr(t, mark)
    plain = torch.randn(3)
    assert compiled._unmarked(plain) is plain


def test_blocks_without_randomness_take_any_number_of_batch_sizes():
    """The block steps keep Dynamo's automatic dynamic shapes: ten batch sizes stay within the
    recompile limit (a static compile per size would send the blocks to eager at the ninth)."""
    seq = make_seq(2, 8, engine="compiled")
    seq.compile_options = AOT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in range(1, 11):
            data = _data(batch, 8)
            expected = run_grads(lambda a, b: plain_forward(seq, a, b), seq, *data)
            _assert_all_close(run_grads(seq, seq, *data), expected, 1e-5, f"batch {batch}")
    assert not any(compiled_steps(seq, "cpu").fell_back(block) for block in seq.blocks)


def test_transformer_streams_take_any_number_of_batch_sizes_and_lengths():
    """(batch, tokens, dim) streams: traced under torch.func.vjp, F.linear with a bias specialized
    the backward step on every batch size and token count (torch 2.13), so a ViT or text model
    compiled a backward graph per shape and ran eagerly after eight; the backward step now
    computes such linears on rows (`_FlatLinears`)."""
    backend, seq, ref, _ = _counted_vit_run(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch, tokens in [(b, 5) for b in range(1, 11)] + [(3, t) for t in range(1, 9)]:
            data = _data(batch, tokens, 16)
            _assert_all_close(run_grads(seq, seq, *data), run_grads(ref, ref, *data), 1e-5, f"{batch}x{tokens}: ")
    assert not any(compiled_steps(seq, "cpu").fell_back(block) for block in seq.blocks)
    # per step: the first shape, then batch dynamic, tokens=1 (Dynamo specializes sizes 0 and 1),
    # then tokens dynamic; none after
    assert backend.graphs == 8


def test_transformer_blocks_with_dropout_and_drop_path_take_any_shape():
    """Blocks whose random layers are revkernels' own (ResidualDropout, DropPath) compile their
    branch steps with dynamic shapes: a text model trained on variable lengths used to compile a
    graph per length and run eagerly after a few (nn.Dropout keeps static branch steps: see the
    test above). Grads equal autograd's with the same draws throughout."""
    backend = CountingBackend()
    torch.manual_seed(0)
    seq = _perturbed(ReversibleSequential(*[rk.nn.RevTransformerBlock(16, 2, drop_path=0.2, dropout=0.1)
                                            for _ in range(2)], engine="compiled"))
    seq.compile_options = {"backend": backend}
    ref = copy.deepcopy(seq)
    ref.engine = "autograd"
    shapes = [(b, 5) for b in range(1, 7)] + [(3, t) for t in range(2, 8)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k, (batch, tokens) in enumerate(shapes):
            if k == len(shapes) - 4:
                settled = backend.graphs
            data = _data(batch, tokens, 16)
            _assert_all_close(run_grads(seq, seq, *data, seed=k), run_grads(ref, ref, *data, seed=k), 1e-5,
                              f"{batch}x{tokens}: ")
    assert not any(compiled_steps(seq, "cpu").fell_back(block) for block in seq.blocks)
    assert backend.graphs == settled == 12  # none for the last four lengths


def _assert_low_precision_rule(seq, data, device_type, seed=None):
    """Under bf16 autocast, every grad of `seq` (engine "compiled") is within twice the error of
    plain autograd under the same autocast, both against plain autograd in fp32 (same seed: the
    same dropout and drop-path draws). With a seed, the generator after the step (forward and
    backward) must also be where plain autograd's step leaves it."""
    ref = copy.deepcopy(seq)
    ref.engine = "autograd"
    exact = run_grads(ref, ref, *data, seed=seed)
    with torch.autocast(device_type, dtype=torch.bfloat16):
        same_dtype = run_grads(ref, ref, *data, seed=seed)
        rng_after_plain = torch.rand(4, device=device_type)
        ours = run_grads(seq, seq, *data, seed=seed)
        rng_after_ours = torch.rand(4, device=device_type)
    assert ours[0].dtype == ours[1].dtype == torch.float32
    for k in range(2, len(exact)):
        assert rel_err(ours[k], exact[k]) <= 2 * rel_err(same_dtype[k], exact[k]) + 1e-6, k
    if seed is not None:
        assert torch.equal(rng_after_ours, rng_after_plain)


def test_bf16_autocast_follows_the_low_precision_rule():
    seq = _perturbed(make_seq(3, 8, engine="compiled"))
    seq.compile_options = AOT
    _assert_low_precision_rule(seq, _data(6, 8), "cpu")


@pytest.mark.gpu
def test_cuda_inductor_steps_bf16_autocast_with_drop_path():
    """The GPU training setting: RevViTBlocks with drop-path under bf16 autocast, steps compiled by
    inductor on CUDA (random blocks: branch steps, the CUDA generator's draws replayed)."""
    seq = _perturbed(ReversibleSequential(*[RevViTBlock(32, 4, drop_path=0.25) for _ in range(2)],
                                          engine="compiled")).cuda()
    data = [t.cuda() for t in _data(4, 5, 32)]
    with warnings.catch_warnings():
        # a step that fails to compile runs eagerly (correct, but not what this test is for)
        warnings.filterwarnings("error", message="revkernels: compiling")
        _assert_low_precision_rule(seq, data, "cuda", seed=5)


def test_compile_failure_warns_naming_the_block_and_runs_it_eagerly():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.linear(x)

    seq = ReversibleSequential(rk.nn.ReversibleBlock(_mlp(), _mlp()), rk.nn.ReversibleBlock(Untraceable(), _mlp()),
                               engine="compiled")
    seq.compile_options = AOT
    ref = copy.deepcopy(seq)
    data = _data(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_grads(seq, seq, *data)
        run_grads(seq, seq, *data)
    messages = [str(w.message) for w in caught if "revkernels" in str(w.message)]
    assert len(messages) == 1 and "blocks[1]" in messages[0], messages
    _assert_all_close(got, run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data), 1e-5)


def test_module_hooks_registered_after_the_steps_compiled_run_as_with_the_sequential_engine():
    """The compiled steps leave the module hook dicts unguarded (the walkers check every block for
    hooks before each step): a forward hook registered on F's layer after the first step, and
    then a global module forward hook, still fire in the forward and in the recompute, and the grads
    stay plain autograd's."""
    seq = perturb_parameters(make_seq(2, 8, engine="compiled"))
    seq.compile_options = AOT
    ref = copy.deepcopy(seq)
    data = _data(4, 8)
    run_grads(seq, seq, *data)  # compiles the steps without hooks
    calls = []
    handle = seq.blocks[1].f[1].register_forward_hook(lambda m, i, o: calls.append(torch.is_grad_enabled()))
    got = run_grads(seq, seq, *data)
    assert calls == [False, True]
    _assert_all_close(got, run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data), 1e-5)
    handle.remove()
    calls.clear()
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: calls.append(torch.is_grad_enabled()) if m is seq.blocks[0].g[3] else None)
    try:
        got = run_grads(seq, seq, *data)
    finally:
        handle.remove()
    assert calls == [False, True]
    _assert_all_close(got, run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data), 1e-5)


_SCALES_G = False  # read by _ScaledMlp's forward: a module-level constant of user code


class _ScaledMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x):
        return self.net(x) * 3.0 if _SCALES_G else self.net(x)


def test_compiled_steps_follow_a_module_level_constant_of_user_code():
    """Only library code (torch, revkernels, the standard library) is left unguarded among the
    globals a step reads: a constant of the user's module that F reads, changed after the first
    step, compiles new steps (plain autograd's grads with the new value)."""
    global _SCALES_G
    seq = _perturbed(ReversibleSequential(rk.nn.ReversibleBlock(_ScaledMlp(), _mlp()), engine="compiled"))
    seq.compile_options = AOT
    ref = copy.deepcopy(seq)
    data = _data(4, 8)
    try:
        for scales in (False, True):
            _SCALES_G = scales
            got = run_grads(seq, seq, *data)
            _assert_all_close(got, run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data), 1e-5,
                              f"_SCALES_G={scales}: ")
    finally:
        _SCALES_G = False


def _guard(name, guard_type, is_global=True):
    return types.SimpleNamespace(name=name, guard_type=guard_type, is_global=is_global)


def test_guard_filter_drops_hook_dicts_and_library_code_only(monkeypatch):
    # a user's module named like a standard-library one, loaded from the user's folder
    monkeypatch.setitem(sys.modules, "this",
                        types.SimpleNamespace(__spec__=types.SimpleNamespace(origin="/home/u/this.py")))
    dropped = [
        _guard("block._modules['f']._forward_hooks", "EMPTY_NN_MODULE_HOOKS_DICT", is_global=False),
        _guard("G['__import_torch_dot__functorch_dot_eager_transforms']._vjp_with_argnums", "CLOSURE_MATCH"),
        _guard("G['__import_torch_dot_nn_dot_modules_dot_linear'].F", "DUPLICATE_INPUT"),
        _guard("G['__import_torch_dot_utils_dot__pytree']._LEAF_SPEC.num_leaves", "CONSTANT_MATCH"),
        _guard("G['vjp'].__kwdefaults__['has_aux']", "CONSTANT_MATCH"),  # this module's own import
        _guard("G['check_residual']", "CLOSURE_MATCH"),  # this module's own global
        _guard("G['__builtins_dict___2']['len']", "BUILTIN_MATCH"),
        _guard("__import__('torch').utils._pytree.SUPPORTED_NODES", "DICT_CONTAINS", is_global=False),
        _guard("list(dict.keys(__import__('torch').utils._pytree.SUPPORTED_NODES))[0]", "BUILTIN_MATCH",
               is_global=False),
        _guard("G['__import_revkernels_dot_nn_dot_revvit'].F.gelu", "BUILTIN_MATCH"),
        _guard("G['__import_revkernels_dot_nn_dot_revvit']._check_tokens.__defaults__[0]", "CONSTANT_MATCH"),
        _guard("G['__import_contextlib'].nullcontext", "CLASS_MATCH"),
    ]
    kept = [
        _guard("block._modules['f']._modules['norm'].eps", "CONSTANT_MATCH", is_global=False),
        _guard("block._modules['f']._parameters['weight']", "TENSOR_MATCH", is_global=False),
        _guard("G['__import_mymodel'].SCALE", "CONSTANT_MATCH"),
        _guard("G['__import_mymodel'].helper", "CLOSURE_MATCH"),
        _guard("G['__import_this'].helper", "CLOSURE_MATCH"),
        _guard("G['__import_torchvision_dot_ops'].nms", "CLOSURE_MATCH"),
        _guard("G['__import_torch_dot_backends_dot_cudnn'].enabled", "CONSTANT_MATCH"),
        _guard("G['__import_revkernels_dot_nn_dot_attention'].MATH_MAX_KEYS", "EQUALS_MATCH"),
        _guard("G['__import_math'].pi", "CONSTANT_MATCH"),
    ]
    assert not any(keeps_guard(g) for g in dropped), [g.name for g in dropped if keeps_guard(g)]
    assert all(keeps_guard(g) for g in kept), [g.name for g in kept if not keeps_guard(g)]


def test_a_guard_filter_in_the_compile_options_replaces_the_engines():
    seen = []
    seq = make_seq(1, 8, engine="compiled")
    seq.compile_options = {**AOT, "options": {"guard_filter_fn": lambda entries: seen.append(entries) or
                                              [True] * len(entries)}}
    run_grads(seq, seq, *_data(4, 8))
    assert len(seen) == 2 and any(e.guard_type == "EMPTY_NN_MODULE_HOOKS_DICT" for e in seen[0])


def test_bad_compile_options_raise_naming_the_argument():
    seq = make_seq(1, 8, engine="compiled")
    assert seq.compile_options is None  # the default, readable before it is set
    seq.compile_options = {"fullgraph": False}
    with pytest.raises(ValueError, match="compile_options"):
        seq(torch.randn(2, 8, requires_grad=True), torch.randn(2, 8))


def test_inductor_steps_use_the_cpp_wrapper_on_cpu_unless_the_options_say_otherwise():
    # (the inductor test above runs the default, so its steps run through the C++ wrapper)
    seq = make_seq(1, 8, engine="compiled")
    assert compiled_steps(seq, "cpu").options["options"]["cpp_wrapper"] is True
    assert "cpp_wrapper" not in compiled_steps(seq, "cuda").options["options"]
    seq.compile_options = {"options": {"cpp_wrapper": False}}
    assert compiled_steps(seq, "cpu").options["options"]["cpp_wrapper"] is False
    seq.compile_options = AOT
    assert "options" not in compiled_steps(seq, "cpu").options


def test_fullgraph_compile_saves_the_same_bytes_at_depth_4_and_16():
    # The opaque op is the same for every memory-saving engine (sequential: no inner compiles).
    x = torch.randn(4, 8, requires_grad=True)
    saved = []
    for depth in (4, 16):
        saved.append(compiled_saved_bytes(make_seq(depth, 8, engine="sequential"), x))
    outputs = 2 * x.numel() * x.element_size()
    assert saved == [outputs, outputs], saved


def test_fullgraph_compile_parameter_hook_fires_once_with_the_full_grad():
    seq = _perturbed(make_seq(3, 8, engine="sequential"))
    ref = copy.deepcopy(seq)
    data = _data(4, 8)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
    param = seq.blocks[1].g[1].weight
    calls = []
    param.register_hook(lambda g: calls.append(g.clone()))
    fn = torch.compile(lambda a, b: seq(a, b), fullgraph=True, backend="aot_eager")
    got = run_grads(fn, seq, *data)
    assert len(calls) == 1
    assert_close_rel(calls[0], ref.blocks[1].g[1].weight.grad, 1e-5, "hook grad")
    _assert_all_close(got, expected, 1e-5)


def test_fullgraph_compile_follows_train_and_eval():
    # Which blocks draw random numbers (and so the op's generator-state output) depends on the
    # run's mode: switching it traces the graph again.
    seq = make_seq(2, 8, engine="sequential", dropout=0.3)
    fn = torch.compile(lambda a, b: seq(a, b), fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 8, requires_grad=True)
    loss_of(*fn(x, x), 1.0, 1.0).backward()
    seq.eval()
    with torch.no_grad():
        got = fn(x, x)
        expected = plain_forward(seq, x, x)
    for a, e in zip(got, expected):
        assert_close_rel(a, e, 1e-6)
    seq.train()
    loss_of(*fn(x, x), 1.0, 1.0).backward()


class _Scaled(nn.Module):
    """A linear whose output is scaled by a Python float: blocks with other scales are other
    signatures (Dynamo guards on the attribute)."""

    def __init__(self, width, scale):
        super().__init__()
        self.lin, self.scale = nn.Linear(width, width), scale

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


def test_a_fall_back_after_f_ran_draws_the_blocks_numbers_as_eager():
    """A block with dropout whose G branch step fails after F's ran (here Dynamo's recompile limit,
    1: F's signature compiles, G's does not): the eager steps that run the block instead draw from
    the state before it, so masks, outputs, grads and the generator stream after the step are those
    of plain autograd with the same seed (they drew F's mask a second time: outputs 0.4 off)."""
    torch.manual_seed(0)
    seq = ReversibleSequential(*[rk.nn.ReversibleBlock(_mlp(0.2), _Scaled(8, 0.5)) for _ in range(2)],
                               engine="compiled")
    seq.compile_options = {"backend": "aot_eager", "dynamic": False}  # steps of their own: a fresh count
    ref = copy.deepcopy(seq)
    data = _data(4, 8)
    with torch._dynamo.config.patch(recompile_limit=1), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run_grads(seq, seq, *data, seed=3)
        rng_after = torch.rand(4)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=3)
    assert torch.equal(rng_after, torch.rand(4))
    for a, b in zip(got, expected, strict=True):
        assert_close_rel(a, b, 1e-5)


def test_past_the_recompile_limit_the_warning_says_so_and_the_grads_stay_exact():
    # (the warning read "compiling the block_forward step ... failed", as for a step that cannot compile)
    torch.manual_seed(0)
    seq = ReversibleSequential(*[rk.nn.ReversibleBlock(_Scaled(8, 0.5 + i / 4), _Scaled(8, 1.5 - i / 4))
                                 for i in range(3)], engine="compiled")
    seq.compile_options = AOT
    ref = copy.deepcopy(seq)
    data = _data(4, 8)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_grads(seq, seq, *data, seed=1)
    messages = [str(w.message) for w in caught if "recompile_limit" in str(w.message)]
    assert len(messages) == 1 and "reached torch._dynamo.config.recompile_limit (2 signatures) at blocks[" \
        in messages[0] and "dropout probability" in messages[0], [str(w.message) for w in caught]
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data, seed=1)
    for a, b in zip(got, expected, strict=True):
        assert_close_rel(a, b, 1e-5)


class _SweepLinear(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_each_block_structure_has_a_recompile_budget_of_its_own():
    # A width sweep, one model per width: with one set of step functions for the whole process the
    # models past Dynamo's recompile limit compiled nothing and ran eagerly, with a warning.
    backend = CountingBackend()
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for width in (4, 6, 8, 10):
            seq = ReversibleSequential(rk.nn.ReversibleBlock(_SweepLinear(width), _SweepLinear(width)),
                                       engine="compiled")
            seq.compile_options = {"backend": backend}
            ref = copy.deepcopy(seq)
            data = _data(3, width)
            got = run_grads(seq, seq, *data)
            expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
            for a, b in zip(got, expected, strict=True):
                assert_close_rel(a, b, 1e-5)
    assert [str(w.message) for w in caught if "revkernels" in str(w.message)] == []
    assert backend.graphs == 8  # a forward and a backward step per width
    assert not compiled_steps(seq, "cpu").failed


class _CountingMode(TorchDispatchMode):
    # a user's Python dispatch mode (a FLOP counter, a memory tracker): counts the ops it sees
    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _anomaly_detection():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's "Anomaly Detection has been enabled")
        with torch.autograd.detect_anomaly():
            yield


@pytest.mark.parametrize("mode", ["anomaly", "dispatch_mode"])
def test_a_step_under_a_debugging_mode_runs_eagerly_and_leaves_the_steps_compiled(mode):
    # One step under torch.autograd.detect_anomaly() or a Python dispatch mode (whose frames Dynamo
    # skips: a fullgraph step found no compiled frame) marked the structure failed for the rest of
    # the process: it now runs the eager steps for that call, and later calls the compiled ones.
    backend = CountingBackend()
    seq = ReversibleSequential(*[rk.nn.ReversibleBlock(_SweepLinear(8), _SweepLinear(8)) for _ in range(2)],
                               engine="compiled")
    seq.compile_options = {"backend": backend}
    ref = copy.deepcopy(seq)
    data = _data(3, 8)
    expected = run_grads(lambda a, b: plain_forward(ref, a, b), ref, *data)
    counting = _CountingMode()
    with counting if mode == "dispatch_mode" else _anomaly_detection():
        under_mode = run_grads(seq, seq, *data)
    assert backend.calls == 0 and not compiled_steps(seq, "cpu").failed
    assert counting.ops > 0 or mode == "anomaly"  # (the mode saw the eager steps' ops)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        after = run_grads(seq, seq, *data)
    assert backend.calls == 4 and backend.graphs == 2  # two blocks, a forward and a backward step each
    for grads in (under_mode, after):
        for a, b in zip(grads, expected, strict=True):
            assert_close_rel(a, b, 1e-5)


def test_compile_options_are_shared_by_equal_functions_and_bounded():
    # keyed by repr, a backend lambda made at each call was a new option set (a new compile) every
    # time, and the registry grew with every one
    def options():
        return {"backend": lambda gm, inputs: gm.forward, "dynamic": False}

    seq = make_seq(1, 4, engine="compiled")
    seq.compile_options = options()
    first = compiled_steps(seq, "cpu")
    seq.compile_options = options()
    assert compiled_steps(seq, "cpu") is first
    seq.compile_options = {"backend": lambda gm, inputs: gm.forward, "dynamic": True}
    assert compiled_steps(seq, "cpu") is not first
    for i in range(compiled.MAX_OPTION_SETS + 1):
        seq.compile_options = {"backend": "eager", "mode": None, "options": {"tag": i}}
        compiled_steps(seq, "cpu")
    assert len(compiled._SHARED) == compiled.MAX_OPTION_SETS
