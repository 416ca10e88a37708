import os
import random

import torch

# Without a GPU the Triton kernels run under the Triton interpreter, which must be chosen before
# any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Tests compare against references within tight tolerances; keep the CPU thread count fixed so a
# 2-core CI machine and a workstation take the same reduction orders.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def random_seed():
    """A fresh random seed for every test (inputs differ run to run), printed so a failure can be
    replayed with REVKERNELS_TEST_SEED=<seed>."""
    seed = int(os.environ.get("REVKERNELS_TEST_SEED", random.SystemRandom().randrange(2**31)))
    torch.manual_seed(seed)
    print(f"seed={seed}")
    return seed


@pytest.fixture
def fresh_dynamo():
    """Dynamo without the graphs other tests compiled (reset before and after the test): the compiled
    engine's steps are shared by every run with the same compile options, so graphs left by earlier
    tests count towards a test's recompile limit, past which its blocks would run eagerly."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
