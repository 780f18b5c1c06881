import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn


class Net2d(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, **kw)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).mean((2, 3))
        return self.fc(h)


class Net1d(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, **kw)

    def forward(self, x):
        return self.conv(x)


def loss_fn(model, batch):
    out = model(batch["x"])
    return (out**2).reshape(out.shape[0], -1).sum(1)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt"])
@pytest.mark.parametrize("kw", [{}, {"stride": 2, "padding": 1}, {"dilation": 2, "padding": "same"}])
def test_conv2d(float64, mode, kw):
    torch.manual_seed(0)
    check_clipper(Net2d(**kw), [{"x": torch.randn(4, 3, 8, 8)}, {"x": torch.randn(3, 3, 8, 8)}], loss_fn, mode=mode)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt"])
@pytest.mark.parametrize("kw", [{}, {"stride": 2, "padding": 2, "bias": False}])
def test_conv1d(float64, mode, kw):
    torch.manual_seed(0)
    check_clipper(Net1d(**kw), [{"x": torch.randn(5, 3, 10)}], loss_fn, mode=mode)


def test_grouped_conv_uses_fallback(float64):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2))
    clipper = check_clipper(
        net, [{"x": torch.randn(4, 4, 6, 6)}], lambda m, b: (m(b["x"]) ** 2).sum((1, 2, 3)), mode="bk"
    )
    assert clipper.rules_used["0"] == "FallbackRule"
