import logging

import numpy as np
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


class NumpyNoise(nn.Module):
    """Own parameters and a draw from numpy's global stream in its forward (as SpecAugment's masks are drawn): the
    fallback's per-example re-run would draw other numbers than the forward pass did."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))

    def forward(self, x):
        if not self.training:  # as SpecAugment: masks in training only
            return torch.sin(x * self.scale)
        keep = torch.from_numpy(np.random.rand(*x.shape) > 0.3).to(x.dtype)
        return torch.sin(x * self.scale) * keep


def test_fallback_refuses_a_module_that_draws_from_numpy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), NumpyNoise(3))
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    np.random.seed(7)
    x = torch.randn(4, 2, 3)
    with pytest.raises(UnsupportedModuleError, match="`numpy`.*requires_grad_\\(False\\)"):
        clipper.backward((model(x) ** 2).sum((1, 2)))
    clipper.remove()
    # what the refusal's advice says: frozen, the draws happen once (in the forward pass) and nothing is refused
    model[1].scale.requires_grad_(False)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    clipper.backward((model(x) ** 2).sum((1, 2)))
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()
