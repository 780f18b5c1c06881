import pytest
import torch
from helpers.models import causal_batches, causal_loss, gpt2_prefix
from helpers.oracle import check_clipper


@pytest.mark.parametrize("projection", [False, True])
def test_prefix_encoder(float64, projection):
    torch.manual_seed(0)
    model = gpt2_prefix(projection)
    model.eval()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("prompt_encoder" in n for n in trainable)
    check_clipper(model, causal_batches(), causal_loss, mode="bk-mixopt")
