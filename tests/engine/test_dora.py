"""PEFT DoRA (``LoraConfig(use_dora=True)``, issue 27 B): the magnitude vector and the normalised direction (the
weight norm detached, as peft computes it) exact against the float64 per-example oracle in every clipping mode, on
GPT-2 (``Conv1D``, ``fan_in_fan_out``) and Llama, and through ``DPTrainer`` with the first-step self-check on.

``DoraLinearLayer`` calls ``lora_B(lora_A(eye))`` for the weight norm (a use without the batch dimension, detached):
the engine covers the adapted layer with the torch.func fallback, which re-runs peft's own forward per example.

With ``lora_dropout > 0`` (peft's DoRA example, TRL's default 0.05) peft computes ``lora_B(lora_A(dropout(x)))`` and
the magnitude term on ``dropout(x)``: the fallback's re-run replays the forward's dropout mask, each example its rows
(issue 38, item 4; refused before: "draws different random numbers than its forward pass").
"""

import copy

import pytest
import torch
from helpers.models import causal_batches, causal_loss, gpt2, llama
from helpers.oracle import check_clipper, clip_factors
from helpers.random_oracle import check_clipper_seeded
from helpers.trainer import (
    ToyDataset,
    causal_per_example_loss,
    check_exact_update,
    collate,
    one_example_loss,
    sgd_step_args,
)
from peft import LoraConfig, get_peft_model

from hf_dp import DPTrainer

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]


def _moved(model):
    """lora_B starts at zero and the magnitude at the weight norm: move both so every factor is exercised."""
    for name, p in model.named_parameters():
        if "lora_B" in name or "lora_magnitude_vector" in name:
            with torch.no_grad():
                p.add_(torch.randn_like(p) * 0.1)
    return model


def gpt2_dora(lora_dropout=0.0, **kw):
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["c_attn", "c_fc"],
        fan_in_fan_out=True,
        lora_dropout=lora_dropout,
        use_dora=True,
        **kw,
    )
    return _moved(get_peft_model(gpt2(), cfg))


def llama_dora(lora_dropout=0.0):
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=lora_dropout, use_dora=True
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


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", [0.05, 0.5])
@pytest.mark.parametrize("factory", [gpt2_dora, llama_dora], ids=["gpt2-conv1d", "llama"])
def test_dora_with_lora_dropout_is_exact(float64, factory, p, mode):
    """The oracle's forward pass is plain torch (its own ``F.dropout``) from the engine's seed: on CPU the engine
    draws each mask as torch's dropout does, so both see the same masks; the engine's backward pass leaves torch's
    random stream where its forward pass left it."""
    torch.manual_seed(0)
    model = factory(lora_dropout=p)
    clipper = check_clipper_seeded(model, causal_batches(), causal_loss, mode=mode, masked_dropout=False)
    assert "FallbackRule" in clipper.rules_used.values()


class _Recorder:
    """Hooks on the model: torch's random state and the batch of every outermost training forward pass (the engine's
    probes of layouts run the model again inside the first one, under a frozen random state)."""

    def __init__(self, model):
        self.calls, self.depth = [], 0
        self.handles = [
            model.register_forward_pre_hook(self.enter, with_kwargs=True),
            model.register_forward_hook(self.leave, always_call=True),
        ]

    def enter(self, module, args, kwargs):
        if module.training and self.depth == 0:
            self.calls.append((torch.get_rng_state(), {k: kwargs[k].clone() for k in ("input_ids", "attention_mask")}))
        self.depth += 1

    def leave(self, module, args, output):
        self.depth -= 1

    def remove(self):
        for handle in self.handles:
            handle.remove()


def _train_one_step(model, tmp_dir, clip, self_check=False):
    """The update of one SGD step through ``DPTrainer`` (sigma = 0, q = 1, lr = 1, two micro-batches of 4), and the
    recorded training forward passes (the self-check's own passes among them if it is on)."""
    recorder = _Recorder(model)
    args = sgd_step_args(
        tmp_dir,
        per_sample_max_grad_norm=clip,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        dp_self_check=self_check,
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    trainer = DPTrainer(model=model, args=args, train_dataset=ToyDataset(8), data_collator=collate)
    assert trainer.sample_rate == 1.0
    trainer.train()
    recorder.remove()
    return [p.detach() - b for p, b in zip(trainable, before, strict=True)], recorder.calls


def test_dora_with_lora_dropout_through_the_trainer_is_exact(float64, tmp_dir):
    """One SGD step is minus the clipped mean of per-example autograd gradients of the forward passes the trainer
    ran, each replayed by plain torch on an untouched copy from its recorded random state. A first run records those
    states; the second, with C the median oracle norm, is checked. The first-step self-check (on by default; its
    training-mode pass compares like with like) passes too."""
    torch.manual_seed(0)
    original = gpt2_dora(lora_dropout=0.5)
    _train_one_step(copy.deepcopy(original), tmp_dir, clip=1.0, self_check=True)
    _, calls = _train_one_step(copy.deepcopy(original), tmp_dir, clip=1.0)
    assert [tuple(batch["input_ids"].shape) for _, batch in calls] == [(4, 8), (4, 8)]
    reference = copy.deepcopy(original).train()
    params = [p for p in reference.parameters() if p.requires_grad]
    grads = []
    for state, batch in calls:
        torch.set_rng_state(state)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        losses = causal_per_example_loss(reference, {**batch, "labels": labels})
        grads += [torch.autograd.grad(loss, params, retain_graph=True) for loss in losses]
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
    clip = float(norms.median())
    assert (norms > clip).any() and (norms < clip).any()
    coef = clip_factors(norms, clip)
    expected = [-sum(coef[i] * grads[i][k] for i in range(len(grads))) / len(grads) for k in range(len(params))]
    update, again = _train_one_step(copy.deepcopy(original), tmp_dir, clip=clip)
    assert len(again) == len(calls) and all(torch.equal(a[0], b[0]) for a, b in zip(again, calls, strict=True)), (
        "same draws"
    )
    for actual, e in zip(update, expected, strict=True):
        torch.testing.assert_close(actual, e, rtol=1e-6, atol=1e-10)
