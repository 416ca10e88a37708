"""revkernels runs with its declared dependencies only: NumPy is not one of them, so the package
imports, checks its scalar arguments and trains without it (in a child process where importing
NumPy fails)."""
import pathlib
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]

WITHOUT_NUMPY = """
import sys
sys.modules["numpy"] = None  # any "import numpy" now raises ImportError
import warnings
warnings.simplefilter("ignore")  # torch warns once that it runs without NumPy
import torch
import revkernels as rk
import revkernels.reference
from revkernels import engine, models, nn, ops, petra

y, g, w, b = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8), torch.randn(8)
x, out = ops.sub_layer_norm(y, g, w, b, 1e-5)[:2]
want = torch.nn.functional.layer_norm(y - g, (8,), w, b, 1e-5)
assert torch.equal(x, y - g) and torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
for eps, error in ((True, TypeError), ("1e-5", TypeError), (-1.0, ValueError)):
    try:
        ops.sub_layer_norm(y, g, w, b, eps)
    except error as caught:
        assert "eps" in str(caught)
    else:
        raise AssertionError(f"eps={eps!r} was taken")

torch.manual_seed(0)
seq = nn.ReversibleSequential(*[nn.ReversibleBlock(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)) for _ in range(3)])
x1, x2 = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
sum(seq(x1, x2)).square().sum().backward()
assert x1.grad is not None and all(p.grad is not None for p in seq.parameters())
print("ok", "numpy" in sys.modules and sys.modules["numpy"] is not None)
"""


def test_numpy_is_not_a_dependency():
    with open(ROOT / "pyproject.toml", "rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    assert not [d for d in dependencies if d.lower().startswith("numpy")]


def test_the_package_runs_without_numpy():
    done = subprocess.run([sys.executable, "-c", WITHOUT_NUMPY], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "False"]
