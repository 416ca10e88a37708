"""Device facts the Triton launch configurations depend on."""
import functools

import torch


@functools.lru_cache(maxsize=None)
def _sm_count_of(index):
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device):
    """Streaming multiprocessors of CUDA `device` (a torch.device; index None: the current one)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())
