"""DropPath's argument check: the error names DropPath's own argument and the value given."""
import math

import pytest

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
