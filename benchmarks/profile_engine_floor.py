"""How close the sequential engine runs, on generic blocks, to the cheapest autograd Function its
design allows (and to the minREV-style stack).

The implementation is `revkernels/bench/engine_floor.py` (`python -m revkernels.bench.engine_floor`);
this entry point runs it from a checkout with the same flags, writing
benchmarks/results/engine_floor_<config>_cpu.csv unless --out says otherwise.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from revkernels.bench.engine_floor import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_out=os.path.join(HERE, "results")))
