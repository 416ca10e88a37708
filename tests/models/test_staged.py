"""What RevNet and Rev-Swin share (`revkernels.models.staged`): under autocast their
non-reversible stages hand the reversible runs streams in the parameters' dtype, so the runs
rebuild in fp32 while F and G compute in bf16 (docs/numerics.md)."""
import pytest
import torch

from revkernels.models import revnet18, revswin
from tests.helpers import perturb_parameters


def _revnet18(engine):
    # (16 x 16 images, batch 8: at 8 x 8 with batch 4 BatchNorm's train-mode grads are so
    # ill-conditioned that fp32 autograd itself differs from fp64 by percents)
    return perturb_parameters(revnet18(num_classes=5, stem="cifar", engine=engine)), (8, 3, 16, 16)


def _revswin(engine):
    model = revswin("swin_t", num_classes=5, img_size=32, window_size=4, embed_dim=16, depths=(2, 2, 2, 2),
                    num_heads=(2, 2, 4, 4), drop_path_rate=0.0, engine=engine)
    return perturb_parameters(model), (4, 3, 32, 32)


BUILDERS = {"revnet18": _revnet18, "revswin": _revswin}


def _grads(name, engine, autocast):
    """Grads of one train step of a loss with random weights (same weights, images and loss for
    every call), and the dtypes of the streams that entered the reversible runs."""
    torch.manual_seed(0)
    model, shape = BUILDERS[name](engine)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(shape, generator=generator)
    target = torch.randn(shape[0], 5, generator=generator)
    dtypes = []
    for run in model.runs:
        run.register_forward_pre_hook(lambda module, args: dtypes.extend(a.dtype for a in args))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(images)
    (logits.float() * target).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), dtypes


@pytest.mark.parametrize("name", list(BUILDERS))
def test_autocast_keeps_the_streams_of_the_runs_fp32(name):
    reference, _ = _grads(name, "autograd", autocast=False)
    autograd, autograd_dtypes = _grads(name, "autograd", autocast=True)
    sequential, dtypes = _grads(name, "sequential", autocast=True)
    assert set(dtypes) == set(autograd_dtypes) == {torch.float32}
    # bf16 tolerance rule: the rebuilding engine's error against the fp32 step is at most twice
    # that of ordinary backprop through the same autocast model
    error = ((sequential - reference).norm() / reference.norm()).item()
    autograd_error = ((autograd - reference).norm() / reference.norm()).item()
    assert 0 < error <= 2 * autograd_error, (error, autograd_error)
    # and the fp32 rebuild keeps it next to ordinary backprop's grads (bf16 streams rebuilt to bf16
    # precision were 2e-2 (RevNet-18) and 5e-3 (Rev-Swin) off them)
    assert ((sequential - autograd).norm() / autograd.norm()).item() <= 1e-3
