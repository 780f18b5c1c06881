import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and on a loaded 2-core machine the 2 threads that
    tests/conftest.py sets make each step ~100x slower (thread contention on millisecond ops)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
