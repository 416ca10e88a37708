"""Train-step benchmark: standard backprop against reversible training.

The implementation is `revkernels/bench/train.py` (`python -m revkernels.bench.train`, and the `train`
part of `python -m revkernels.bench`); this entry point runs it from a checkout with the same flags,
writing under benchmarks/results unless --out says otherwise.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from revkernels.bench.train import main

if __name__ == "__main__":
    sys.exit(main(default_out=os.path.join(HERE, "results")))
