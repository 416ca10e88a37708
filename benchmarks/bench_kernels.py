"""Kernel benchmark: every fused op against the eager composition it replaces.

The implementation is `revkernels/bench/kernels.py` (`python -m revkernels.bench.kernels`, and the `kernels`
part of `python -m revkernels.bench`); this entry point runs it from a checkout with the same flags,
writing under benchmarks/results unless --out says otherwise.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from revkernels.bench.kernels import main

if __name__ == "__main__":
    sys.exit(main(default_out=os.path.join(HERE, "results")))
