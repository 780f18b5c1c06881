"""Parameters used more than once: the norm is ||G1 + G2||, with exact cross terms."""

import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn


class TiedLM(nn.Module):
    def __init__(self, vocab=9, d=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


class Twice(nn.Module):
    """One layer and one LayerNorm applied three times (ALBERT-style)."""

    def __init__(self, d=4):
        super().__init__()
        self.layer = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        for _ in range(3):
            x = self.norm(torch.tanh(self.layer(x)) + x)
        return x


def lm_loss(model, batch):
    logits = model(batch["ids"])
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["ids"], reduction="none").sum(1)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "per-sample", "ghost"])
@pytest.mark.parametrize("seq", [5, 40])
def test_tied_embedding_and_head(float64, mode, seq):
    torch.manual_seed(0)
    batches = [{"ids": torch.randint(0, 9, (4, seq))}, {"ids": torch.randint(0, 9, (3, seq))}]
    check_clipper(TiedLM(), batches, lm_loss, mode=mode)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "ghost"])
def test_module_called_several_times(float64, mode):
    torch.manual_seed(0)
    batches = [{"x": torch.randn(5, 6, 4)}, {"x": torch.randn(2, 6, 4)}]
    check_clipper(Twice(), batches, lambda m, b: (m(b["x"]) ** 3).sum((1, 2)), mode=mode)


def test_root_sum_square_would_be_wrong(float64):
    """Guard the test itself: the cross term is not negligible here."""
    torch.manual_seed(0)
    model = TiedLM().double()
    ids = torch.randint(0, 9, (3, 5))
    loss = lm_loss(model, {"ids": ids})
    emb_out = []
    h = model.emb.register_forward_hook(lambda m, i, o: emb_out.append(o))
    loss = lm_loss(model, {"ids": ids})
    h.remove()
    g_total = torch.autograd.grad(loss[0], model.emb.weight, retain_graph=True)[0]
    g_emb_use = torch.autograd.grad(loss[0], emb_out[0], retain_graph=True)[0][0]
    emb_part = torch.zeros_like(model.emb.weight).index_add_(0, ids[0], g_emb_use)
    head_part = g_total - emb_part
    rss = (emb_part.norm() ** 2 + head_part.norm() ** 2).sqrt()
    assert abs(float(rss - g_total.norm())) > 1e-3 * float(g_total.norm())
