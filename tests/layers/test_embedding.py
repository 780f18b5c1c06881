import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn

from hf_dp import BookKeepingClipper, UnsupportedModuleError


class Net(nn.Module):
    def __init__(self, padding_idx=None, num=7):
        super().__init__()
        self.emb = nn.Embedding(num, 4, padding_idx=padding_idx)
        self.fc = nn.Linear(4, 3)

    def forward(self, ids):
        return self.fc(torch.tanh(self.emb(ids)))


def loss_fn(model, batch):
    return (model(batch["ids"]) ** 2).sum((1, 2))


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_repeated_ids_and_padding(float64, mode, padding_idx):
    torch.manual_seed(0)
    # Small vocabulary: every example repeats ids; id 0 is the padding id when padding_idx=0.
    ids1 = torch.tensor([[1, 1, 2, 0, 0], [3, 4, 3, 3, 0], [5, 6, 5, 1, 1], [2, 2, 2, 2, 2]])
    ids2 = torch.randint(0, 7, (3, 5))
    check_clipper(Net(padding_idx), [{"ids": ids1}, {"ids": ids2}], loss_fn, mode=mode)


def test_padding_row_gets_no_update(float64):
    torch.manual_seed(0)
    net = Net(padding_idx=0).double()
    clipper = BookKeepingClipper(net, max_grad_norm=0.5)
    clipper.backward(loss_fn(net, {"ids": torch.tensor([[0, 1, 0], [2, 0, 0]])}))
    assert torch.count_nonzero(net.emb.weight.grad[0]) == 0
    assert torch.count_nonzero(net.emb.weight.grad[1]) > 0


@pytest.mark.parametrize("kwargs", [{"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}])
def test_unsupported_embedding_options_raise(kwargs):
    net = nn.Sequential(nn.Embedding(5, 3, **kwargs))
    with pytest.raises(UnsupportedModuleError, match="Embedding `0`"):
        BookKeepingClipper(net, max_grad_norm=1.0)


def test_batch_one_position_ids_are_expanded(float64):
    """A [1, T] lookup added to a [B, T, d] tensor (HF position ids) is expanded to the batch."""

    class PosNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(7, 4)
            self.pos = nn.Embedding(6, 4)
            self.fc = nn.Linear(4, 2)

        def forward(self, input_ids):
            pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
            return self.fc(torch.tanh(self.tok(input_ids) + self.pos(pos)))

    def pos_loss(model, batch):
        return (model(input_ids=batch["input_ids"]) ** 2).sum((1, 2))

    ids = torch.randint(0, 7, (4, 6))
    check_clipper(PosNet(), [{"input_ids": ids}], pos_loss, mode="bk")


class Broadcast(nn.Module):
    """A layer applied to a ``[1, T, d]`` activation shared by the batch, then broadcast against it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return x * self.fc(torch.ones(1, x.shape[1], 3))


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost"])
def test_shared_activation_is_expanded_exactly(float64, mode):
    """A [1, T, d] output proven equal for every example is expanded to the batch: its gradient is per example."""
    torch.manual_seed(0)
    clipper = check_clipper(
        Broadcast(), [{"x": torch.randn(4, 5, 3)}], lambda m, b: (m(b["x"]) ** 2).sum((1, 2)), mode=mode
    )
    assert clipper.rules_used["fc"] == "LinearRule"


def test_shared_activation_reduced_over_batch_is_refused(float64):
    """A [1, T, d] output whose use is not a broadcast over the batch cannot be expanded: refused, not guessed."""

    class Reduced(Broadcast):
        def forward(self, x):
            return x + self.fc(torch.ones(1, x.shape[1], 3)).sum(0)  # sums over its size-1 dimension

    net = Reduced().double()
    clipper = BookKeepingClipper(net, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match="fc"):
        clipper.backward((net(torch.randn(4, 5, 3)) ** 2).sum((1, 2)))
