import pytest
from helpers.distributed import reset_accelerate_state


@pytest.fixture
def single_process():
    """A test that builds a trainer in this process, between tests that launch two (accelerate's state is global)."""
    reset_accelerate_state()
    yield
    reset_accelerate_state()
