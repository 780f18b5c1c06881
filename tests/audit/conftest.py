import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny audit models gain nothing from intra-op threads, and spinning threads crawl on a busy machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
