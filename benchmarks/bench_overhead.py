"""Host-overhead benchmark: host-bound and compute-bound train steps, fused ops vs ATen per call.

The implementation is `revkernels/bench/overhead.py` (`python -m revkernels.bench.overhead`, and the `overhead`
part of `python -m revkernels.bench`); this entry point runs it from a checkout with the same flags,
writing under benchmarks/results unless --out says otherwise.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

from revkernels.bench.overhead import main

if __name__ == "__main__":
    sys.exit(main(default_out=os.path.join(HERE, "results")))
