import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

NORMS = {
    "torch": lambda: nn.RMSNorm(4, eps=1e-5),
    "torch-eps-none": lambda: nn.RMSNorm(4),
    "llama": lambda: LlamaRMSNorm(4, eps=1e-6),
    "t5": lambda: T5LayerNorm(4, eps=1e-6),
    "gemma": lambda: GemmaRMSNorm(4, eps=1e-6),
}


class Net(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = norm

    def forward(self, x):
        return self.norm(self.fc(x) + 0.5)


def loss_fn(model, batch):
    return (model(batch["x"]) ** 3).sum((1, 2))


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt"])
@pytest.mark.parametrize("kind", sorted(NORMS))
def test_rms_norms(float64, mode, kind):
    torch.manual_seed(0)
    net = Net(NORMS[kind]())
    with torch.no_grad():
        net.norm.weight.add_(torch.randn_like(net.norm.weight) * 0.5)
    batches = [{"x": torch.randn(5, 6, 4)}, {"x": torch.randn(2, 6, 4)}]
    clipper = check_clipper(net, batches, loss_fn, mode=mode)
    assert clipper.rules_used["norm"] == "RMSNormRule"
