"""Packaging: the source distribution holds what a build needs; setup.py's optional extension
falls back to the pure-PyTorch package where the CPU ISA variants fail to compile, and to the CPU
kernels alone where a CUDA build fails; its CUDA architectures with no GPU visible; the message of
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

    namespace = _setup_namespace(monkeypatch)
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


def test_the_sources_the_precompiled_header_and_the_isa_builds_share_one_cxx_standard(tmp_path, monkeypatch):
    """BuildExtension adds its own -std only where the sources name none, C++17 in torch 2.11: the
    precompiled header and the ISA variants, built as C++20, then did not match the sources (GCC
    skipped the header with 16 warnings, and the variants were another standard's objects). The
    sources name C++20; every own build takes their flags."""
    namespace = _setup_namespace(monkeypatch)
    monkeypatch.delenv("REVKERNELS_SKIP_EXTENSION")
    monkeypatch.setenv("REVKERNELS_BUILD_CUDA", "0")
    (ext,), cmdclass = namespace["_extensions"]()
    standards = [f for f in ext.extra_compile_args["cxx"] if f.startswith("-std=")]
    assert standards == ["-std=c++20"], standards
    command = cmdclass["build_ext"](setuptools.Distribution({"name": "probe"}))
    command.compiler = types.SimpleNamespace(compiler_so=["c++"], compiler_cxx=["c++"], include_dirs=[])
    command.build_temp = str(tmp_path)
    builds = []
    monkeypatch.setattr(command, "_ninja", builds.extend)
    command._own_builds(ext, {"avx2": ["-mavx2"]})
    assert len(builds) == (2 if namespace["_gcc"]() else 1)  # the precompiled header (GCC), the variant
    for output, _, flags in builds:
        assert [f for f in flags if f.startswith("-std=")] == standards, output


def _setup_namespace(monkeypatch):
    """setup.py's functions, without building anything."""
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    monkeypatch.setenv("REVKERNELS_SKIP_EXTENSION", "1")
    return runpy.run_path(os.path.join(ROOT, "setup.py"))


def _torch_with_cuda(arch_list, gpu_visible=False, arch_flags=True):
    """A stand-in for a CUDA build of torch compiled for `arch_list`: torch 2.14's get_arch_list lists
    them with no GPU visible; torch 2.11's lists none then, and only its compiled arch flags
    (`arch_flags`; absent where False) name them."""
    listed = list(arch_list) if gpu_visible or not arch_flags else []
    cuda = types.SimpleNamespace(is_available=lambda: gpu_visible, get_arch_list=lambda: listed)
    flags = {"_cuda_getArchFlags": lambda: " ".join(arch_list) or None} if arch_flags else {}
    return types.SimpleNamespace(cuda=cuda, _C=types.SimpleNamespace(**flags))


def test_cuda_architectures_with_no_gpu_visible_are_those_torch_was_built_for(monkeypatch):
    """With no GPU to read them from and no TORCH_CUDA_ARCH_LIST, torch's extension builder
    failed with an IndexError (torch 2.14 with CUDA on a machine with nvcc and no GPU, as in a
    container build): setup.py then sets the sm_XY architectures torch lists, the newest as PTX too."""
    arch_list = _setup_namespace(monkeypatch)["_default_cuda_arch_list"]
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    torch_archs = ["sm_90", "sm_75", "sm_80", "sm_86", "sm_90a", "sm_100", "sm_120", "compute_120"]
    for required in (False, True):
        for arch_flags in (True, False):
            torch = _torch_with_cuda(torch_archs, arch_flags=arch_flags)
            assert arch_list(torch, required) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
        assert arch_list(_torch_with_cuda(torch_archs, gpu_visible=True), required) is None  # torch reads the GPUs
    # a torch naming none: the automatic build goes on (and falls back to the CPU kernels), a forced one stops
    for arch_flags in (True, False):
        assert arch_list(_torch_with_cuda([], arch_flags=arch_flags), False) is None
        with pytest.raises(SystemExit, match="TORCH_CUDA_ARCH_LIST"):
            arch_list(_torch_with_cuda([], arch_flags=arch_flags), True)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert arch_list(_torch_with_cuda(torch_archs), True) is None  # the user's list stands


@pytest.mark.parametrize("forced", [False, True])
def test_a_failed_cuda_build_builds_the_cpu_kernels(monkeypatch, forced):
    """A CUDA build that fails (here torch's IndexError; also a compile error, a toolkit without
    the headers torch's CUDA code includes) builds the extension's CPU fallback instead, with a
    warning; it aborted the install. A forced CUDA build (REVKERNELS_BUILD_CUDA=1: no fallback)
    still fails."""
    build_ext_class = _setup_namespace(monkeypatch)["_build_ext_class"]
    built, warnings = [], []

    class Builder:  # BuildExtension's build_extensions, for extensions named "cuda" or "cpu"
        def build_extensions(self):
            built.append([ext.name for ext in self.extensions])
            if any(ext.name == "cuda" for ext in self.extensions):
                raise IndexError("list index out of range")

        def warn(self, message):
            warnings.append(message)

    command = build_ext_class(Builder, [])()
    cpu = types.SimpleNamespace(name="cpu", sources=["ops.cpp"], _private="the fallback's own")
    ext = types.SimpleNamespace(name="cuda", sources=["ops.cpp", "kernels.cu"], _private="setuptools' state",
                                **({} if forced else {"cpu_fallback": cpu}))
    command.extensions = [ext]
    if forced:
        with pytest.raises(IndexError):
            command.build_extensions()
        assert built == [["cuda"]] and not warnings
        return
    command.build_extensions()
    # the same extension object, now the CPU one (setuptools keeps private state on it)
    assert built == [["cuda"], ["cpu"]] and command.extensions == [ext]
    assert ext.sources == ["ops.cpp"] and ext._private == "setuptools' state"
    assert len(warnings) == 1 and "IndexError: list index out of range" in warnings[0]
    assert "CPU kernels only" in warnings[0]


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
