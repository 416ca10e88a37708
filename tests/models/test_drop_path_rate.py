"""The models check drop_path_rate themselves: the error names drop_path_rate and the value the user
gave, not the per-block probability derived from it (e.g. 1.5 * 8 / 11 = 1.09 for a 12-block ViT)."""
import math

import pytest

import revkernels as rk

MODELS = {
    "revvit": lambda rate: rk.models.revvit("vit_s16", drop_path_rate=rate),
    "RevViT": lambda rate: rk.models.RevViT(dim=32, depth=3, heads=4, img_size=32, drop_path_rate=rate),
    "revtext": lambda rate: rk.models.revtext("gpt2_small", 64, 16, drop_path_rate=rate),
    "revswin": lambda rate: rk.models.revswin("swin_t", drop_path_rate=rate),
}


@pytest.mark.parametrize("rate", [1.5, 1.0, -0.1, math.nan])
@pytest.mark.parametrize("model", list(MODELS))
def test_bad_drop_path_rate_is_named_with_the_users_value(model, rate):
    with pytest.raises(ValueError, match=rf"^revkernels: drop_path_rate must be in \[0, 1\), got {rate!r}$"):
        MODELS[model](rate)
