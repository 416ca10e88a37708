"""REVKERNELS_C_LIBRARY: `import revkernels` imports the op library from that file as revkernels._C
(scripts/sanitize.sh points it at its sanitized build), and fails clearly where the file will not load."""
import os
import subprocess
import sys

import pytest

import revkernels as rk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _import_with(library, preamble="", then=""):
    """Imports revkernels with REVKERNELS_C_LIBRARY=library in a fresh interpreter; prints whether
    it has the library and the file it was loaded from."""
    code = preamble + ("import revkernels as rk, torch\n"
                       "print(rk.HAS_C_EXTENSION, rk._extension._C and rk._extension._C.__file__)\n") + then
    env = dict(os.environ, REVKERNELS_C_LIBRARY=str(library),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_the_named_library_is_imported(tmp_path):
    if not rk.HAS_C_EXTENSION:
        pytest.skip("revkernels._C is not built")
    # Another path to the built library: a different file name, which only the variable leads to.
    library = tmp_path / "another_build.so"
    library.symlink_to(rk._extension._C.__file__)
    result = _import_with(library, then="print(torch.ops.revkernels.coupling_sub(torch.ones(3), torch.ones(3)).tolist())\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"True {library}", "[0.0, 0.0, 0.0]"]


@pytest.mark.parametrize("name, message", [("missing.so", "could not be loaded"),
                                           ("library.txt", "is not a shared library")])
def test_a_library_that_does_not_load_is_an_error(tmp_path, name, message):
    library = tmp_path / name
    if name.endswith(".txt"):
        library.write_text("not a library")
    result = _import_with(library)
    assert result.returncode != 0
    assert f"RuntimeError: revkernels: REVKERNELS_C_LIBRARY='{library}' {message}" in result.stderr, result.stderr


def test_a_hidden_library_stays_hidden(tmp_path):
    """A None in sys.modules (how the tests hide revkernels._C) wins over the variable: the package
    falls back to the pure-PyTorch ops, without loading the file."""
    result = _import_with(tmp_path / "missing.so", preamble="import sys\nsys.modules['revkernels._C'] = None\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "None"]
