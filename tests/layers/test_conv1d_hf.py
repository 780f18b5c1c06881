import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn
from transformers.pytorch_utils import Conv1D


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = Conv1D(6, 4)  # nf=6 outputs, nx=4 inputs: weight is (4, 6)
        self.out = Conv1D(2, 6)

    def forward(self, x):
        return self.out(torch.relu(self.proj(x)))


def loss_fn(model, batch):
    out = model(batch["x"])
    return (out**2).sum((1, 2))


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost"])
@pytest.mark.parametrize("seq", [3, 30])
def test_hf_conv1d(float64, mode, seq):
    torch.manual_seed(0)
    batches = [{"x": torch.randn(5, seq, 4)}, {"x": torch.randn(3, seq, 4)}]
    check_clipper(Net(), batches, loss_fn, mode=mode)
