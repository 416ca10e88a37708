"""Rev-ViT models: shapes, parameter counts, and grads of each engine against plain autograd."""
import pytest
import torch

import revkernels as rk
from revkernels.models.revvit import RevViT, revvit
from tests.helpers import CPU_ENGINES, assert_close_rel, perturb_parameters, plain_forward


def _plain(model, images):
    """The same model evaluated with ordinary autograd through the blocks' modules."""
    tokens = model.patch_embed(images).flatten(2).transpose(1, 2) + model.pos_embed
    y1, y2 = plain_forward(model.blocks, tokens, tokens)
    return model.head(model.norm((y1 + y2) * 0.5).mean(dim=1))


@pytest.mark.parametrize("engine", CPU_ENGINES)  # pareprop/graphs: the sequential code on CPU
def test_grads_equal_plain_autograd(engine):
    model = RevViT(dim=32, depth=3, heads=4, num_classes=5, img_size=32, drop_path_rate=0.2, engine=engine)
    perturb_parameters(model)  # no LayerNorm at weight 1 / bias 0: F's and G's parameters differ
    images, target = torch.randn(2, 3, 32, 32), torch.randint(0, 5, (2,))
    results = []
    for fn in (lambda x: _plain(model, x), model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(4)
        loss = torch.nn.functional.cross_entropy(fn(images), target)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    for i, (a, e) in enumerate(zip(results[1], results[0])):
        assert_close_rel(a, e, 1e-5, f"loss/grad {i}")


@pytest.mark.parametrize("name,millions", [("vit_s16", 22.05), ("vit_b16", 86.57), ("vit_l16", 304.33)])
def test_parameter_counts_match_vit(name, millions):
    # timm ViT S/B/L-16 counts (22.05M, 86.57M, 304.33M); Rev-ViT drops the class token: within 0.5%.
    with torch.device("meta"):
        model = revvit(name)
    assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - millions) <= 0.005 * millions


def test_bad_input():
    with pytest.raises(ValueError, match="name must be one of"):
        revvit("vit_h14")
    model = revvit("vit_s16", num_classes=3, img_size=32)
    with pytest.raises(ValueError, match=r"images must be a float tensor \(batch, channels, 32, 32\)"):
        model(torch.randn(1, 3, 16, 16))
    with pytest.raises(ValueError, match=r"images must be a float tensor .* got torch.uint8"):
        model(torch.randint(0, 255, (1, 3, 32, 32), dtype=torch.uint8))
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    assert isinstance(model.blocks, rk.nn.ReversibleSequential)
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        revvit("vit_s16", num_classes=0, img_size=32)


def test_set_engine_returns_the_model():
    model = revvit("vit_s16", num_classes=3, img_size=32)
    assert model.set_engine("autograd") is model  # model.set_engine(e).zero_grad() as with the other models
    assert model.engine == model.blocks.engine == "autograd"
    model.engine = "pareprop"
    assert model.blocks.engine == "pareprop"
    with pytest.raises(ValueError, match="engine must be one of"):
        model.set_engine("magic")
