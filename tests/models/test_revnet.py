"""RevNet-18/34/50 in PETRA's layouts: stages, parameter counts, one training step against plain
autograd (grads and BatchNorm statistics), saved memory, the stage list as PETRA runs it."""
import copy

import pytest
import torch
from torch import nn

import revkernels as rk
from revkernels.models import BasicResidual, BottleneckResidual, ReversibleStage, revnet18, revnet34, revnet50
from revkernels.models.revnet import KINDS
from tests.helpers import assert_close_rel, perturb_parameters, record_relu_input_signs, relu_kink_crossings

# name: (builder, layout, lengths of the reversible runs, paper's count, our count, count with conv biases)
MODELS = {
    "revnet18": (revnet18, "S r r D r D r D r H", [2, 1, 1, 1], 12.22e6, 12_211_048, 12_215_912),
    "revnet34": (revnet34, "S r r r D r r r D r r r r r D r r H", [3, 3, 5, 2], 22.33e6, 22_319_208, 22_327_784),
    "revnet50": (revnet50, "S D r r D r r r D r r r r r D r r H", [2, 3, 5, 2], 30.42e6, 30_391_144, 30_421_608),
}
NAMES = list(MODELS)
KIND_OF = {"S": "stem", "r": "reversible", "D": "down", "H": "head"}
CLASSES = 10


def _build(name, device="cpu", **kwargs):
    kwargs.setdefault("num_classes", CLASSES)
    kwargs.setdefault("stem", "cifar")
    with torch.device(device):
        model = MODELS[name][0](**kwargs)
    # Random BatchNorm affine parameters and statistics (not weight 1, bias 0): a fused step that
    # reads the wrong BatchNorm's parameters must give a wrong result.
    return model if device == "meta" else perturb_parameters(model)


def _run_stages(stages, x):
    """The stage list as a PETRA pipeline runs it: each stage module called on the previous output."""
    out = stages[0](x)
    for stage in stages[1:]:
        out = stage(*out)
    return out


def _plain_forward(model, x):
    """The model's function stage by stage with ordinary autograd, the couplings written out (no
    revkernels engine or block forward involved)."""
    stages = model.stages
    x1, x2 = stages[0](x)
    for stage in stages[1:-1]:
        if stage.reversible:
            x1, x2 = x2, x1 + stage.f(x2)
        else:
            x1, x2 = stage(x1, x2)
    return stages[-1](x1, x2)


def _train_step(model, x, w, forward=None):
    """One forward/backward in train mode; returns logits, input grad, param grads and buffers."""
    model.train()
    x = x.clone().requires_grad_()
    logits = model(x) if forward is None else forward(model, x)
    (logits * w).sum().backward()
    grads = [(n, p.grad) for n, p in model.named_parameters()]
    return logits.detach(), x.grad, grads, [(n, b.clone()) for n, b in model.named_buffers()]


def _assert_grads_close(actual, expected, tol=1e-5):
    # A BatchNorm shift whose output reaches the loss only through 1x1 convolutions followed by
    # training-mode BatchNorm has exactly zero gradient (BN removes any per-channel shift); both
    # runs then hold rounding noise (~1e-8 of the model's grad scale, where real grads are >= 1e-3
    # of it), which is compared on the model's grad scale instead of its own.
    scale = max(e.abs().max().item() for _, e in expected)
    for (name, a), (_, e) in zip(actual, expected):
        assert a is not None and e is not None, f"{name}: no grad"
        if e.abs().max().item() <= 1e-6 * scale:
            err = (a - e).abs().max().item() / scale
            assert err <= tol, f"{name} (zero grad): error {err:.3e} of the grad scale > {tol:.1e}"
        else:
            assert_close_rel(a, e, tol, f"{name} grad")


# --- structure ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_stage_layout_and_kinds(name):
    _, layout, run_lengths, *_ = MODELS[name]
    model = _build(name, "meta")
    stages = model.stages
    assert len(stages) == {"revnet18": 10, "revnet34": 18, "revnet50": 18}[name]
    assert model.layout == layout
    assert [s.kind for s in stages] == [KIND_OF[c] for c in layout.split()]
    for i, stage in enumerate(stages):
        assert stage.kind in KINDS, f"stage {i}"
        assert stage.reversible == (stage.kind == "reversible"), f"stage {i}"
        assert isinstance(stage, rk.nn.HalfCouplingBlock) == stage.reversible, f"stage {i}"
        if stage.reversible:
            assert isinstance(stage, ReversibleStage)
            assert type(stage.f) is (BottleneckResidual if name == "revnet50" else BasicResidual)
    assert [len(run) for run in model.runs] == run_lengths
    assert all(isinstance(run, rk.nn.ReversibleSequential) and run.engine == "auto" for run in model.runs)


@pytest.mark.parametrize("name", NAMES)
def test_streams_have_resnet_widths_and_resolutions(name):
    model = _build(name, "meta", num_classes=1000, stem="imagenet")
    expansion = 4 if name == "revnet50" else 1
    widths = {56: 64 * expansion, 28: 128 * expansion, 14: 256 * expansion, 7: 512 * expansion}
    stages = model.stages
    with torch.device("meta"), torch.no_grad():
        out = stages[0](torch.empty(2, 3, 224, 224))
        assert [tuple(t.shape) for t in out] == [(2, 64, 56, 56)] * 2
        sizes = []
        for stage in stages[1:-1]:
            out = stage(*out)
            assert out[0].shape == out[1].shape
            sizes.append(out[0].shape[-1])
            assert out[0].shape[1:] == (widths[sizes[-1]], sizes[-1], sizes[-1]), f"{stage.kind} stage"
        assert stages[-1](*out).shape == (2, 1000)
    # Resolution changes exactly at the down stages (RevNet50's first down keeps 56x56).
    changes = [i + 1 for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]]
    downs = [i for i, s in enumerate(stages) if s.kind == "down"]
    assert changes == (downs[1:] if name == "revnet50" else downs)


@pytest.mark.parametrize("name", NAMES)
def test_parameter_counts_match_the_paper(name):
    _, _, _, paper, ours, with_bias = MODELS[name]
    count = sum(p.numel() for p in _build(name, "meta", num_classes=1000, stem="imagenet").parameters())
    assert count == ours
    assert abs(count / paper - 1) <= 0.005, f"{count} vs paper {paper:.0f}"
    # With a bias on every convolution (the authors' code) the count rounds to the paper's figure.
    biased = sum(p.numel() for p in _build(name, "meta", num_classes=1000, stem="imagenet", conv_bias=True).parameters())
    assert biased == with_bias and round(biased / 1e4) == round(paper / 1e4)


@pytest.mark.parametrize("name", NAMES)
def test_stages_are_the_modules_the_forward_runs(name):
    model = _build(name, "meta")
    stages = model.stages
    # Parameters are shared, not copied: the stages hold exactly the model's parameters, once each.
    stage_params = [p for s in stages for p in s.parameters()]
    assert len({id(p) for p in stage_params}) == len(stage_params)
    assert {id(p) for p in stage_params} == {id(p) for p in model.parameters()}
    run_blocks = [id(b) for run in model.runs for b in run.blocks]
    assert [id(s) for s in stages if s.reversible] == run_blocks
    assert all(any(s is m for m in model.segments) for s in stages if not s.reversible)
    # The forward calls each stage once, in the stage order.
    calls = []
    for i, stage in enumerate(stages):
        (stage.f if stage.reversible else stage).register_forward_hook(lambda *args, i=i: calls.append(i))
    with torch.device("meta"), torch.no_grad():
        model(torch.empty(2, 3, 16, 16))
    assert calls == list(range(len(stages)))


# --- one training step against plain autograd -------------------------------------------------------

# The engines that rebuild activations. On CPU "pareprop" runs the sequential schedule (asserted in
# tests/engine/test_pareprop.py), so only the CUDA check lists it.
REBUILDING_ENGINES = {"cpu": ["sequential"], "cuda": ["sequential", "pareprop"]}


def _check_one_training_step(name, device="cpu", batch=2, size=16):
    """Each rebuilding engine vs engine "autograd" vs the stage list run with ordinary autograd:
    logits, input grad, every parameter grad (fp32, train-mode BatchNorm), BN running statistics."""
    base = _build(name).to(device)
    for _ in range(3):
        x = torch.randn(batch, 3, size, size, device=device)
        w = torch.randn(batch, CLASSES, device=device)
        ours, crossings = {}, 0
        for engine in REBUILDING_ENGINES[torch.device(device).type]:
            model = copy.deepcopy(base).set_engine(engine)
            records = record_relu_input_signs(model)
            ours[engine] = _train_step(model, x, w)
            crossings += relu_kink_crossings(records)
        # A rebuilt input is exact to ~1e-6; if that moved a ReLU input across zero, the recompute
        # differentiates the other side of the kink (a real, rare (~3% of draws for RevNet34 here)
        # fp32 effect of any rebuild): such a draw cannot be compared at 1e-5, so draw again.
        if crossings == 0:
            break
    else:
        pytest.fail("three draws in a row put a ReLU input within rounding error of zero")
    reference = _train_step(copy.deepcopy(base).set_engine("autograd"), x, w)
    plain = _train_step(copy.deepcopy(base), x, w, forward=_plain_forward)

    for what, other in [*ours.items(), ("autograd", reference)]:
        assert_close_rel(other[0], plain[0], 1e-5, f"{what}: logits")
        assert_close_rel(other[1], plain[1], 1e-5, f"{what}: input grad")
        _assert_grads_close(other[2], plain[2])
        # BatchNorm running statistics: updated once by the forward, never by the recompute.
        # (Bitwise on CPU: the same kernels on the same inputs; CUDA gets a rounding's slack.)
        for (name_b, a), (_, e) in zip(other[3], plain[3]):
            if device == "cpu" or not a.is_floating_point():
                assert torch.equal(a, e), f"{what}: {name_b} differs from plain autograd after one step"
            else:
                assert_close_rel(a, e, 1e-6, f"{what}: {name_b} after one step")
        tracked = [b for n, b in other[3] if n.endswith("num_batches_tracked")]
        assert tracked and all(int(b) == 1 for b in tracked)


@pytest.mark.parametrize("name", NAMES)
def test_one_training_step_matches_plain_autograd(name):
    _check_one_training_step(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["revnet18", "revnet50"])
def test_cuda_training_step_matches_plain_autograd(name):
    # fp32 throughout (no TF32) and deterministic cuDNN algorithms, so that the forward of the
    # engine (under no_grad) and of the references run the same kernels.
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True, allow_tf32=False):
        matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            _check_one_training_step(name, "cuda")
        finally:
            torch.backends.cuda.matmul.allow_tf32 = matmul_tf32


@pytest.mark.parametrize("residual", ["basic", "bottleneck"])
def test_saved_memory_of_a_reversible_run_is_flat_in_depth(residual):
    def make_f():
        return BasicResidual(16) if residual == "basic" else BottleneckResidual(16, 4, 16)

    def saved_bytes(engine, depth):
        run = rk.nn.ReversibleSequential(*[ReversibleStage(make_f()) for _ in range(depth)], engine=engine)
        x1 = torch.randn(4, 16, 8, 8, requires_grad=True)
        x2 = torch.randn(4, 16, 8, 8, requires_grad=True)
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(x1, x2)
        params = {p.untyped_storage().data_ptr() for p in run.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    activation = 4 * 16 * 8 * 8 * 4
    assert [saved_bytes("sequential", d) for d in (1, 4)] == [2 * activation] * 2  # the run's outputs
    one, four = saved_bytes("autograd", 1), saved_bytes("autograd", 4)
    assert one > 2 * activation and four >= 3.5 * one  # what the engine saves us


# --- the stage list as PETRA runs it; inference ------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_stages_in_sequence_equal_the_model(name):
    model = _build(name)
    x = torch.randn(2, 3, 16, 16)
    # Train mode (batch statistics), through the engine with autograd on.
    assert_close_rel(_run_stages(model.stages, x).detach(), model(x.requires_grad_()).detach(), 1e-5, "train logits")
    # Eval mode under no_grad: running statistics, nothing recorded, no buffer changes.
    model.eval()
    buffers = [b.clone() for b in model.buffers()]
    with torch.no_grad():
        logits = model(x)
        staged = _run_stages(model.stages, x)
        # A reversible stage rebuilds its input from its output (what PETRA's backward does).
        out = model.stages[0](x)
        for stage in model.stages[1:-1]:
            new = stage(*out)
            if stage.reversible:
                for rebuilt, exact in zip(stage.inverse(*new), out):
                    assert_close_rel(rebuilt, exact, 1e-5, "rebuilt stage input")
            out = new
    assert logits.shape == (2, CLASSES) and not logits.requires_grad and torch.isfinite(logits).all()
    assert torch.equal(logits, staged)
    assert all(torch.equal(a, b) for a, b in zip(buffers, model.buffers()))


def test_imagenet_stem_forward():
    model = revnet18(num_classes=7, stem="imagenet").eval()
    with torch.no_grad():
        out = model.stages[0](torch.randn(1, 3, 64, 64))
        assert [tuple(t.shape) for t in out] == [(1, 64, 16, 16)] * 2  # 7x7/2 conv, 3x3/2 max-pool
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)


# --- engine choice, bad input ------------------------------------------------------------------------

def test_set_engine_switches_every_run():
    model = _build("revnet34", "meta", engine="autograd")
    assert model.engine == "autograd" and {run.engine for run in model.runs} == {"autograd"}
    assert model.set_engine("sequential") is model
    assert model.engine == "sequential" and {run.engine for run in model.runs} == {"sequential"}
    with pytest.raises(ValueError, match="engine must be one of"):
        model.set_engine("magic")
    assert model.engine == "sequential" and {run.engine for run in model.runs} == {"sequential"}


def test_bad_arguments():
    with pytest.raises(ValueError, match="stem must be one of"):
        revnet18(stem="mnist")
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        revnet18(num_classes=0)
    with pytest.raises(ValueError, match="engine must be one of"):
        revnet18(engine="nope")
    model = _build("revnet18", "meta")
    with torch.device("meta"), pytest.raises(ValueError, match=r"images must be a float tensor \(batch, channels"):
        model(torch.empty(3, 32, 32))  # one unbatched image
    down = model.stages[3]
    assert down.kind == "down"
    with torch.device("meta"), pytest.raises(ValueError, match="x1 and x2 must have the same shape"):
        down(torch.empty(2, 64, 8, 8), torch.empty(2, 64, 4, 4))


# --- fused BatchNorm (+ ReLU) in the residual functions ------------------------------------------------

def test_residual_functions_use_fused_batchnorm_with_unchanged_state_keys():
    from revkernels.nn import BatchNormAct2d

    basic, bottleneck = BasicResidual(8), BottleneckResidual(16, 4, 16)
    assert [(type(m), m.relu) for m in (basic.bn1, basic.bn2)] == [(BatchNormAct2d, True), (BatchNormAct2d, False)]
    assert [m.relu for m in (bottleneck.bn1, bottleneck.bn2, bottleneck.bn3)] == [True, True, False]
    bn_keys = ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
    assert list(basic.state_dict()) == (["conv1.weight"] + [f"bn1.{k}" for k in bn_keys]
                                        + ["conv2.weight"] + [f"bn2.{k}" for k in bn_keys])
    # A state_dict of the unfused function (nn.BatchNorm2d + torch.relu) loads and computes the same.
    unfused = nn.Sequential()
    unfused.conv1, unfused.bn1 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
    unfused.conv2, unfused.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
    with torch.no_grad():
        for p in unfused.parameters():
            p.normal_()
    basic.load_state_dict(unfused.state_dict())
    x = torch.randn(2, 8, 6, 6)
    want = unfused.bn2(unfused.conv2(torch.relu(unfused.bn1(unfused.conv1(x)))))
    assert_close_rel(basic(x), want, 1e-5, "fused BasicResidual")
    for a, b in zip(basic.buffers(), unfused.buffers()):
        assert_close_rel(a.float(), b.float(), 1e-5, "running statistics")


@pytest.mark.parametrize("residual", ["basic", "bottleneck"])
def test_recompute_is_bitwise_the_forward(residual):
    # An engine runs F under no_grad in the forward and again with autograd (BN statistics frozen)
    # in the recompute; at the same input the two are the same ops, so bitwise the same output.
    from revkernels.engine.structure import recompute_context

    f = BasicResidual(8) if residual == "basic" else BottleneckResidual(16, 4, 16)
    x = torch.randn(2, 8 if residual == "basic" else 16, 6, 6)
    with torch.no_grad():
        forward = f(x)
    buffers = [b.clone() for b in f.buffers()]
    with recompute_context(f):
        recompute = f(x.clone().requires_grad_())
    assert recompute.requires_grad and torch.equal(forward, recompute.detach())
    assert all(torch.equal(a, b) for a, b in zip(buffers, f.buffers()))  # counted once
