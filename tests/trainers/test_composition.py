"""Issue 39, item 6: `DPTrainerMixin` makes any `Trainer` subclass private (docs/trainer_subclasses.md). Its
constructor takes the subclass's own arguments (unknown ones pass through); a subclass tells hf_dp its per-example loss
with `dp_forward` and `compute_per_example_loss`; a loss that couples examples is refused before any update;
transformers' `compute_loss_func(outputs, labels, num_items_in_batch)` signature works.

Exactness as everywhere: sigma 0, q 1, SGD lr 1, one step: the update is -(1/N) sum_i clip(g_i), with g_i the float64
autograd gradient of example i's loss on its own (a batch of one, no padding), and C the median norm.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers.trainer import ToyDataset, collate, dp_args, one_example_loss, sgd_step_args
from transformers import Trainer, TrainingArguments

from hf_dp import DPArgumentsMixin, DPTrainerMixin


def expected_update(model, examples, loss_fn):
    """-(1/N) sum_i clip(g_i) at the median norm, by one autograd call per example on a copy."""
    reference = copy.deepcopy(model)
    params = [p for p in reference.parameters() if p.requires_grad]
    grads = []
    for example in examples:
        g = torch.autograd.grad(loss_fn(reference, example), params, allow_unused=True)
        grads.append([torch.zeros_like(p) if x is None else x for x, p in zip(g, params, strict=True)])
    norms = torch.stack([torch.sqrt(sum((x**2).sum() for x in gi)) for gi in grads])
    clip = float(norms.median())
    assert (norms > clip).any() and (norms < clip).any()
    coef = (clip / (norms + 1e-6)).clamp(max=1.0)
    n = len(examples)
    return [-sum(coef[i] * grads[i][k] for i in range(n)) / n for k in range(len(params))], clip


def assert_update(model, before, expected):
    after = [p.detach() for p in model.parameters() if p.requires_grad]
    for b, a, e in zip(before, after, expected, strict=True):
        torch.testing.assert_close(a - b, e, rtol=1e-6, atol=1e-10)


# ------------------------------------------------------------------------------------------------ any Trainer subclass
class ExtraArgumentTrainer(Trainer):
    """A Trainer subclass with an argument of its own, before the Trainer's (as TRL's and sentence-transformers')."""

    def __init__(self, model=None, extra=None, args=None, **kwargs):
        self.extra = extra
        super().__init__(model=model, args=args, **kwargs)


@dataclass
class DPExtraArguments(DPArgumentsMixin, TrainingArguments):
    pass


class DPExtraTrainer(DPTrainerMixin, ExtraArgumentTrainer):
    _dp_arguments_class = DPExtraArguments


def test_the_mixin_passes_a_subclass_arguments_through_in_its_own_order(tmp_dir):
    from helpers.models import gpt2

    args = DPExtraArguments(
        output_dir=tmp_dir, report_to="none", per_device_train_batch_size=4, gradient_accumulation_steps=2,
        noise_multiplier=0.0, per_sample_max_grad_norm=1.0, max_steps=1, use_cpu=True, noise_seed=0,
        save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = DPExtraTrainer(gpt2(), "extra-value", args, train_dataset=ToyDataset(8), data_collator=collate)
    assert trainer.extra == "extra-value" and trainer.args is args
    trainer.train()
    assert trainer.dp_callback.steps == 1
    with pytest.raises(TypeError, match="unknown_argument"):
        DPExtraTrainer(gpt2(), args=args, train_dataset=ToyDataset(8), unknown_argument=1)
    with pytest.raises(ValueError, match="model_init"):
        DPExtraTrainer(args=args, train_dataset=ToyDataset(8), model_init=gpt2)


def test_transformers_compute_loss_func_signature(tmp_dir):
    """`compute_loss_func(outputs, labels, num_items_in_batch)` (transformers' signature): called with
    num_items_in_batch=None; a function that normalizes by it to a batch mean is refused with the reason."""
    from helpers.models import gpt2

    from hf_dp import DPTrainer

    def per_example(outputs, labels, num_items_in_batch):
        assert num_items_in_batch is None
        logits = outputs.logits[:, :-1]
        ce = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none")
        return ce.sum(1) / (labels[:, 1:] != -100).sum(1)

    torch.manual_seed(0)
    model = gpt2().double()
    data = ToyDataset(8)
    expected, clip = expected_update(model, [data[i] for i in range(8)], one_example_loss)
    args = sgd_step_args(tmp_dir, per_sample_max_grad_norm=clip)
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    DPTrainer(model=model, args=args, train_dataset=data, data_collator=collate, compute_loss_func=per_example).train()
    assert_update(model, before, expected)

    def batch_mean(outputs, labels, num_items_in_batch=None):
        return per_example(outputs, labels, None).mean()

    args = dp_args(f"{tmp_dir}/m", max_steps=1, dp_self_check=False)  # the self-check refuses it too, in its words
    trainer = DPTrainer(
        model=gpt2(), args=args, train_dataset=data, data_collator=collate, compute_loss_func=batch_mean
    )
    with pytest.raises(ValueError, match="not a batch mean .*num_items_in_batch"):
        trainer.train()
