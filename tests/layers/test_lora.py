import pytest
import torch
from helpers.oracle import check_clipper
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.proj = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, ids):
        return self.out(torch.tanh(self.proj(self.emb(ids))))


def loss_fn(model, batch):
    return (model(batch["ids"]) ** 2).sum((1, 2))


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt"])
def test_lora_linear_and_embedding(float64, mode):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(Tiny(), LoraConfig(r=2, lora_alpha=4, target_modules=["emb", "proj"], lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name or "lora_embedding_B" in name:
            nn.init.normal_(p, std=0.3)  # B starts at zero in peft; move it so A's gradient is not zero
    ids = torch.tensor([[1, 2, 2, 0], [3, 3, 3, 3], [4, 5, 6, 0], [7, 1, 0, 0]])
    clipper = check_clipper(model, [{"ids": ids}, {"ids": torch.randint(0, 11, (3, 4))}], loss_fn, mode=mode)
    assert "LoraEmbeddingRule" in clipper.rules_used.values()
