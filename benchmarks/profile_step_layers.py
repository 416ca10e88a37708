"""Where a compiled step call's host time goes, layer by layer (the compiled engine).

The implementation is `revkernels/bench/step_layers.py` (`python -m revkernels.bench.step_layers`);
this entry point runs it from a checkout with the same flags, writing
benchmarks/results/step_layers_<config>_cpu.csv unless --out says otherwise.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from revkernels.bench.step_layers import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_out=os.path.join(HERE, "results")))
