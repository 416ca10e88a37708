"""run_recomputed: a non-reversible piece that keeps only its input, against plain autograd."""
import pytest
import torch
from torch import nn

from revkernels.engine.recompute import run_recomputed
from revkernels.models import revnet18
from tests.helpers import assert_close_rel


class TwoStreamPiece(nn.Module):
    """A downsampling-like module: BatchNorm, dropout, two inputs, two outputs."""

    def __init__(self, width=12):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Dropout(0.3))
        self.b = nn.Linear(width, width)

    def forward(self, x1, x2):
        h = self.a(x2)
        return h, x1 + self.b(h)


def _saved_bytes(fn):
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, storages


def test_grads_bn_stats_rng_and_hooks_match_plain_autograd():
    piece, reference = TwoStreamPiece(), TwoStreamPiece()
    reference.load_state_dict(piece.state_dict())
    x1, x2, w = torch.randn(8, 12), torch.randn(8, 12), torch.randn(8, 12)
    hook_calls = []
    piece.b.weight.register_hook(lambda g: hook_calls.append(g.clone()))
    results = []
    for module, fn in ((reference, lambda a, b: reference(a, b)), (piece, lambda a, b: run_recomputed(piece, a, b))):
        a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        torch.manual_seed(3)
        h, y = fn(a, b)
        ((h * w).sum() + y.square().sum()).backward()
        results.append([h.detach(), y.detach(), a.grad, b.grad] + [p.grad for p in module.parameters()])
    for i, (ours, ref) in enumerate(zip(results[1], results[0])):
        assert_close_rel(ours, ref, 1e-5, f"output/grad {i}")
    for (name, a), (_, b) in zip(piece.named_buffers(), reference.named_buffers()):
        assert torch.equal(a, b), f"{name}: BatchNorm statistics must be updated once"
    assert len(hook_calls) == 1


@pytest.mark.parametrize("switch", ["eval", "rate"])
def test_recomputes_with_the_forwards_parameters_and_mode(switch):
    """torch.func.functional_call's tensors are back out of the module when the backward runs, and
    a model.eval() or a dropout rate changed between forward and backward must not change the
    recompute: both are taken from the forward (dropout replayed with its rate, BatchNorm on batch
    statistics)."""
    piece, reference = TwoStreamPiece(), TwoStreamPiece()
    reference.load_state_dict(piece.state_dict())
    x1, x2, w = torch.randn(8, 12), torch.randn(8, 12), torch.randn(8, 12)
    swapped = {"b.weight": (piece.b.weight.detach() + 0.3 * torch.randn(12, 12)).requires_grad_()}
    with torch.no_grad():
        reference.b.weight.copy_(swapped["b.weight"])
    results = []
    for module, fn in ((reference, lambda a, b: reference(a, b)),
                       (piece, lambda a, b: _recomputed_in_functional_call(piece, swapped, a, b))):
        a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
        torch.manual_seed(3)
        h, y = fn(a, b)
        if switch == "eval":
            module.eval()
        else:
            module.a[3].p = 0.7
        ((h * w).sum() + y.square().sum()).backward()
        module.train()
        module.a[3].p = 0.3
        grads = {n: p.grad for n, p in module.named_parameters()}
        if module is piece:
            grads["b.weight"] = swapped["b.weight"].grad
        results.append([h.detach(), y.detach(), a.grad, b.grad] + [grads[n] for n, _ in module.named_parameters()])
    for i, (ours, ref) in enumerate(zip(results[1], results[0], strict=True)):
        assert_close_rel(ours, ref, 1e-5, f"output/grad {i}")
    assert piece.b.weight.grad is None


class _Recomputing(nn.Module):
    def __init__(self, piece):
        super().__init__()
        self.piece = piece

    def forward(self, a, b):
        return run_recomputed(self.piece, a, b)


def _recomputed_in_functional_call(piece, swapped, a, b):
    """``run_recomputed(piece, a, b)`` inside ``functional_call`` with `swapped` (names in `piece`)."""
    return torch.func.functional_call(_Recomputing(piece), {f"piece.{n}": t for n, t in swapped.items()}, (a, b))


def test_a_parameter_changed_in_place_before_the_backward_raises_autograds_error():
    piece = TwoStreamPiece()
    h, y = run_recomputed(piece, torch.randn(8, 12, requires_grad=True), torch.randn(8, 12))
    with torch.no_grad():
        piece.b.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: b.weight is at version"):
        (h.sum() + y.square().sum()).backward()


def test_gradient_penalty_through_a_recompute_raises():
    """Its backward is not differentiable, also under a loss linear in its outputs."""
    piece = TwoStreamPiece()
    a = torch.randn(8, 12, requires_grad=True)
    h, y = run_recomputed(piece, a, torch.randn(8, 12))
    (da,) = torch.autograd.grad(h.sum() + y.sum(), a, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        da.square().sum().backward()
    with pytest.raises(RuntimeError, match="differentiate twice"):  # restricted to the parameters too
        torch.autograd.grad(da.square().sum(), list(piece.parameters()), allow_unused=True)


def test_keeps_only_its_inputs():
    piece = TwoStreamPiece()
    x1, x2 = torch.randn(8, 12, requires_grad=True), torch.randn(8, 12, requires_grad=True)
    _, storages = _saved_bytes(lambda: run_recomputed(piece, x1, x2))
    params = {p.untyped_storage().data_ptr() for p in piece.parameters()}
    activations = {ptr: n for ptr, n in storages.items() if ptr not in params}
    assert set(activations) == {x1.untyped_storage().data_ptr(), x2.untyped_storage().data_ptr()}


def test_revnet_stores_far_less_with_a_memory_saving_engine():
    def saved(engine):
        model = revnet18(num_classes=10, stem="cifar", engine=engine)
        images = torch.randn(2, 3, 16, 16)
        _, storages = _saved_bytes(lambda: model(images))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return sum(n for ptr, n in storages.items() if ptr not in params)

    assert saved("autograd") > 5 * saved("sequential")
