import logging

import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn

from hf_dp import BookKeepingClipper, UnsupportedModuleError


class ScaleShift(nn.Module):
    """A module with raw parameters and no closed-form rule."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x, *, power=2):
        return torch.sin(x * self.scale) ** power + self.shift


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.custom = ScaleShift(3)

    def forward(self, x):
        return self.custom(self.fc(x), power=3)


def loss_fn(model, batch):
    return (model(batch["x"]) ** 2).sum((1, 2))


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost"])
def test_fallback_matches_oracle(float64, mode, caplog):
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING):
        check_clipper(Net(), [{"x": torch.randn(5, 4, 3)}, {"x": torch.randn(2, 4, 3)}], loss_fn, mode=mode)


def test_fallback_can_be_refused():
    with pytest.raises(UnsupportedModuleError, match="custom"):
        BookKeepingClipper(Net(), max_grad_norm=1.0, allow_fallback=False)
