"""The documentation site (mkdocs.yml, docs/): it builds strictly (a warning fails the build), every
python block of its pages runs as written, and the README, the pages and CONTRIBUTING.md name only
files that exist in the repository."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
TEXTS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *PAGES]
# a path of this repository quoted in backticks: `benchmarks/results/drift_cpu.csv`, `tests/engine/`
# (a pattern such as `revkernels/ops/<family>.py` is not a path)
QUOTED_PATH = re.compile(r"`((?:benchmarks|tests|scripts|revkernels|csrc|docs|\.ci)/[\w./-]*)(?=[`\s:)])")


def python_blocks(text):
    """(first line number, code) of each ```python block of a markdown text."""
    return [(text[:m.start(1)].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def test_the_site_builds_strictly(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                             str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert (tmp_path / "site" / "api" / "nn" / "index.html").exists()


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(ROOT / "docs")) for p in PAGES if f" {p.relative_to(ROOT / 'docs')}" not in nav]
    assert not missing, missing


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_python_blocks_of_a_page_run(page, tmp_path, monkeypatch):
    """The blocks of one page run in order in one namespace (a later block may use an earlier
    one's names), in a scratch working directory."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_example"}
    for line, code in python_blocks(page.read_text()):
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)


@pytest.mark.parametrize("text", TEXTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_repository_paths_exist(text):
    missing = sorted({path for path in QUOTED_PATH.findall(text.read_text())
                      if not (ROOT / path.rstrip(".")).exists()})
    assert not missing, f"{text.name} names files that are not in the repository: {missing}"


def test_the_readme_is_short_and_keeps_its_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    assert "bash scripts/setup.sh && .venv/bin/python -m revkernels.bench --quick" in readme
    assert "bash scripts/setup.sh && bash scripts/test.sh" in readme
