"""PEFT DoRA (``LoraConfig(use_dora=True)``, issue 27 B): the magnitude vector and the normalised direction (the
weight norm detached, as peft computes it) exact against the float64 per-example oracle in every clipping mode, on
GPT-2 (``Conv1D``, ``fan_in_fan_out``) and Llama, and through ``DPTrainer`` with the first-step self-check on.

``DoraLinearLayer`` calls ``lora_B(lora_A(eye))`` for the weight norm (a use without the batch dimension, detached):
the engine covers the adapted layer with the torch.func fallback, which re-runs peft's own forward per example.
"""

import pytest
import torch
from helpers.models import causal_batches, causal_loss, gpt2, llama
from helpers.oracle import check_clipper
from helpers.trainer import ToyDataset, check_exact_update, one_example_loss
from peft import LoraConfig, get_peft_model

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]


def _moved(model):
    """lora_B starts at zero and the magnitude at the weight norm: move both so every factor is exercised."""
    for name, p in model.named_parameters():
        if "lora_B" in name or "lora_magnitude_vector" in name:
            with torch.no_grad():
                p.add_(torch.randn_like(p) * 0.1)
    return model


def gpt2_dora(**kw):
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_dropout=0.0, use_dora=True, **kw
    )
    return _moved(get_peft_model(gpt2(), cfg))


def llama_dora():
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0, use_dora=True
    )
    return _moved(get_peft_model(llama(), cfg))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("factory", [gpt2_dora, llama_dora], ids=["gpt2-conv1d", "llama"])
def test_dora_is_exact(float64, factory, mode):
    torch.manual_seed(0)
    model = factory()
    magnitudes = [n for n, p in model.named_parameters() if "lora_magnitude_vector" in n and p.requires_grad]
    assert magnitudes
    clipper = check_clipper(model, causal_batches(), causal_loss, mode=mode)
    assert any("lora_magnitude_vector" in name or name.endswith(("c_attn", "q_proj")) for name in clipper.rules_used)


def test_dora_through_the_trainer_is_exact(float64, tmp_dir):
    """The three names, the self-check on: one SGD step is the clipped mean of the per-example gradients."""
    torch.manual_seed(0)
    model = gpt2_dora()
    trainer = check_exact_update(model, ToyDataset(8), one_example_loss, tmp_dir, dp_self_check=True)
    assert trainer.loss_type == "causal_lm"
