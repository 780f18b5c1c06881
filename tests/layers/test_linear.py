import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]


class Net(nn.Module):
    def __init__(self, d_in, d_out, bias=True):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out, bias=bias)
        self.head = nn.Linear(d_out, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)))


def loss_fn(model, batch):
    out = model(batch["x"])
    return (out**2).reshape(out.shape[0], -1).sum(1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(6, 5), (6, 7, 5), (6, 2, 3, 5)])
def test_linear_sequence_shapes(float64, mode, shape):
    torch.manual_seed(0)
    batches = [{"x": torch.randn(*shape)}, {"x": torch.randn(*shape)}]
    check_clipper(Net(5, 4), batches, loss_fn, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_linear_without_bias_and_long_sequence(float64, mode):
    # T = 20 makes 2T^2 > p*d, so bk-mixopt instantiates this layer while bk uses the ghost norm.
    torch.manual_seed(1)
    batches = [{"x": torch.randn(5, 20, 3)}, {"x": torch.randn(4, 20, 3)}]
    check_clipper(Net(3, 3, bias=False), batches, loss_fn, mode=mode)


def test_bias_only_training(float64):
    torch.manual_seed(2)
    net = Net(5, 4)
    net.fc.weight.requires_grad_(False)
    check_clipper(net, [{"x": torch.randn(6, 7, 5)}], loss_fn, mode="bk")
