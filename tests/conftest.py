import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "OMP_NUM_THREADS" not in os.environ:  # respect an explicit setting (a loaded machine runs faster on one thread)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture
def float64():
    """Run the test in float64 so that 1e-6 relative agreement is meaningful."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture
def tmp_dir(tmp_path):
    return str(tmp_path)
