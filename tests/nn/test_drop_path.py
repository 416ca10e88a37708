"""DropPath: the argument check names DropPath's own argument and the value given; the forward is
the Python-float formula bit for bit."""
import math

import pytest
import torch

from revkernels.nn import DropPath
from revkernels.nn.drop_path import check_drop_probability


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1, math.nan])
def test_bad_p_is_named_with_its_value(p):
    with pytest.raises(ValueError, match=rf"^revkernels: DropPath's p must be in \[0, 1\), got {p!r}$"):
        DropPath(p)


@pytest.mark.parametrize("p", [0, 0.0, 0.25, 0.999])
def test_p_in_range_is_kept_as_a_float(p):
    module = DropPath(p)
    assert isinstance(module.p, float) and module.p == p


def test_check_names_the_callers_argument():
    with pytest.raises(ValueError, match=r"^revkernels: drop_path_rate must be in \[0, 1\), got 2$"):
        check_drop_probability(2, "drop_path_rate")
    assert check_drop_probability(0.5, "drop_path_rate") == 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_forward_is_the_float_formula_bitwise_and_follows_a_new_p(dtype):
    """The rate is read as 0-d tensors (a graph input under torch.compile); the result is the
    Python-float formula's, bit for bit, also after `p` is set anew."""
    drop = DropPath(0.25)
    x = torch.randn(64, 3, 5).to(dtype)
    for p in (0.25, 1 / 3, 0.0, 0.9):
        drop.p = p
        torch.manual_seed(0)
        got = drop(x)
        torch.manual_seed(0)
        expected = x * ((torch.rand(64, 1, 1) >= p).to(dtype) / (1.0 - p)) if p > 0 else x
        assert torch.equal(got, expected), p
        assert drop.draws_random() == (p > 0)
    drop.eval()
    assert torch.equal(drop(x), x) and not drop.draws_random()
    with pytest.raises(ValueError, match="DropPath's p"):
        drop.p = 1.0


def test_a_drop_path_pickled_with_p_in_its_dict_loads():
    """Whole-module pickles from before the rate became a property hold `p` in the instance dict."""
    old = DropPath(0.3)
    state = {k: v for k, v in old.__dict__.items() if k not in ("_p", "_active", "_rate", "_keep")}
    state["p"] = 0.3
    loaded = DropPath.__new__(DropPath)
    loaded.__setstate__(state)
    assert loaded.p == 0.3 and loaded.draws_random() and torch.equal(loaded._keep, old._keep)
