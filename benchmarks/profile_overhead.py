"""Where a train step of the overhead benchmark spends its host time, by category.

The implementation is `revkernels/bench/host_profile.py` (`python -m revkernels.bench.host_profile`);
this entry point runs it from a checkout with the same flags, writing
benchmarks/results/profile_<config>_<device>.txt unless --out says otherwise.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from revkernels.bench.host_profile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(default_out=os.path.join(HERE, "results")))
