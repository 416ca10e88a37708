"""PETRA tests run tiny models: one torch thread each (on a busy machine a thread pool's waits cost
more than these ops; the distributed tests' processes set their own)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
