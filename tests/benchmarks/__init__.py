import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(stem):
    """The module of ``benchmarks/<stem>.py`` (a script, not a package: loaded by path, once per
    process, as ``benchmarks_<stem>``; its main is guarded)."""
    name = f"benchmarks_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
