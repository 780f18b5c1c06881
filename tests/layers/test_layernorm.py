import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn


class Net(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(shape)

    def forward(self, x):
        return self.norm(self.fc(x) * 3 + 1)


def loss_fn(model, batch):
    out = model(batch["x"])
    return (out**3).reshape(out.shape[0], -1).sum(1)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost"])
@pytest.mark.parametrize("shape", [4, (5, 4)])
def test_layernorm(float64, mode, shape):
    torch.manual_seed(0)
    net = Net(shape)
    with torch.no_grad():
        net.norm.weight.add_(torch.randn_like(net.norm.weight))
    batches = [{"x": torch.randn(6, 5, 4)}, {"x": torch.randn(3, 5, 4)}]
    check_clipper(net, batches, loss_fn, mode=mode)
