"""Whole tiny HF models: norms and accumulated clipped sums against the float64 per-example oracle."""

import pytest
import torch
from models import MODEL_MATRIX
from oracle import check_clipper


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt"])
@pytest.mark.parametrize("name", sorted(MODEL_MATRIX))
def test_model_matches_oracle(float64, name, mode):
    factory, batches, loss_fn = MODEL_MATRIX[name]
    torch.manual_seed(0)
    model = factory()
    model.eval()  # no dropout; gradients are still enabled
    check_clipper(model, batches(), loss_fn, mode=mode)
