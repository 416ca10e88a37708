"""Attention in compiled CPU graphs: SDPA's flash kernel against its math formula, by sequence length.

The implementation is `revkernels/bench/attention.py` (`python -m revkernels.bench.attention`); this entry
point runs it from a checkout with the same flags, writing under benchmarks/results unless --out says
otherwise.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from revkernels.bench.attention import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_out=os.path.join(HERE, "results")))
