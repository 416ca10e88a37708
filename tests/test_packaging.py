"""Packaging: the source distribution holds what a build needs; setup.py's optional extension
falls back to the pure-PyTorch package where the CPU ISA variants fail to compile; the message of
a missing compiled library; benchmark provenance outside revkernels' own checkout."""
import os
import runpy
import shutil
import subprocess
import sys
import tarfile
import types

import pytest
import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tracked(*paths):
    """The checkout's files (tracked, or new and not ignored) under `paths`."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *paths], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="needs the git checkout")
def test_the_sdist_holds_every_source_header_and_build_file(tmp_path):
    # From a copy of the checkout's files: an egg-info left in the checkout by an earlier build
    # would add its file list to the sdist's
    source = tmp_path / "source"
    for name in _tracked():
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(source / os.path.dirname(name), exist_ok=True)
            shutil.copy(os.path.join(ROOT, name), source / name)
    env = dict(os.environ, REVKERNELS_SKIP_EXTENSION="1")  # (the sdist's file list does not depend on it)
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=source, env=env, check=True,
                   capture_output=True)
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    needed = _tracked("csrc", "revkernels", "tests", "scripts") | {"setup.py", "pyproject.toml", "CMakeLists.txt",
                                                                   "README.md"}
    assert not needed - names, sorted(needed - names)[:10]


@pytest.mark.parametrize("optional", [True, False])
def test_a_failed_own_build_skips_an_optional_extension(tmp_path, monkeypatch, optional):
    """ninja's failure on the builds setup.py runs itself (the precompiled header, the ISA variants)
    skips the optional extension with a warning (the pure-PyTorch package is then installed), as
    setuptools does for a failed compile; it aborted the install. A required extension
    (REVKERNELS_BUILD_CUDA set) still fails."""
    pytest.importorskip("ninja")
    from torch.utils.cpp_extension import BuildExtension

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    monkeypatch.setenv("REVKERNELS_SKIP_EXTENSION", "1")
    namespace = runpy.run_path(os.path.join(ROOT, "setup.py"))
    command = namespace["_build_ext_class"](BuildExtension, [])(setuptools.Distribution({"name": "probe"}))
    cxx = shutil.which("c++") or "c++"
    command.compiler = types.SimpleNamespace(compiler_so=[cxx], compiler_cxx=[cxx], include_dirs=[])
    command.build_temp = str(tmp_path)
    warnings = []
    monkeypatch.setattr(command, "warn", warnings.append)
    bad_flag = ["-fno-such-flag-revkernels"]
    ext = types.SimpleNamespace(name="revkernels._C", optional=optional, include_dirs=[],
                                extra_compile_args={"cxx": bad_flag})
    if not optional:
        with pytest.raises(subprocess.CalledProcessError):
            command._own_builds(ext, {"bad": bad_flag})
        return
    assert command._own_builds(ext, {"bad": bad_flag}) is None
    assert len(warnings) == 1 and "ISA variants" in warnings[0]


def test_a_missing_compiled_library_is_named_in_the_warning(tmp_path):
    """The package without revkernels._C warns naming the missing module (it said "most likely due to
    a circular import")."""
    shutil.copytree(os.path.join(ROOT, "revkernels"), tmp_path / "revkernels",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # (an editable install's finder would find the checkout's library for the copy)
    code = ("import sys, warnings; sys.meta_path[:] = [f for f in sys.meta_path if not "
            "getattr(f, '__module__', '').startswith('__editable__')]; warnings.simplefilter('always'); "
            "import revkernels; print(revkernels.__file__, revkernels.HAS_C_EXTENSION)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(tmp_path)), timeout=300)
    assert result.stdout.split() == [str(tmp_path / "revkernels" / "__init__.py"), "False"], result.stderr
    assert "No module named 'revkernels._C'" in result.stderr and "circular" not in result.stderr, result.stderr


def test_benchmark_provenance_names_no_commit_of_another_repository(tmp_path):
    """revkernels installed inside a user's git project: the project's commit is not revkernels'."""
    from revkernels.bench import report

    project = tmp_path / "project"
    package = project / "site" / "revkernels" / "bench"
    package.mkdir(parents=True)
    git = ["git", "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run([*git, "init", "-q", str(project)], check=True)
    subprocess.run([*git, "-C", str(project), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    assert report._git_commit(str(package)) == "unknown"
    if os.path.isdir(os.path.join(ROOT, ".git")):
        assert report._git_commit(os.path.join(ROOT, "revkernels", "bench")) != "unknown"
