"""Command-line help text taken from module docstrings.

Standard library only: `benchmarks/readme_tables.py` loads this file by path, without importing
torch.
"""
import re


def description(doc):
    """The first paragraph of docstring `doc` joined into one line: an argparse description that
    ends where the paragraph ends, not where its first line does."""
    return " ".join(re.split(r"\n[ \t]*\n", doc.strip(), maxsplit=1)[0].split())
