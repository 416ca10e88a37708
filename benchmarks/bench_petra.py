"""PETRA distributed-runtime throughput against single-process reversible backprop.

The implementation is `revkernels/bench/petra.py` (`python -m revkernels.bench.petra`, and the `petra`
part of `python -m revkernels.bench`); this entry point runs it from a checkout with the same flags,
writing under benchmarks/results unless --out says otherwise.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from revkernels.bench.petra import main

if __name__ == "__main__":
    sys.exit(main(default_out=os.path.join(HERE, "results")))
