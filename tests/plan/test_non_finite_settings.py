"""Issue 37: a setting that voids the guarantee is refused before training (an infinite C, a non-finite sigma, ...),
no accounting call loops on it, no card states a guarantee for it; data with nothing to learn is refused too."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args

from hf_dp import DPTrainer, DPTrainingArguments
from hf_dp.accounting import epsilon, noise_multiplier
from hf_dp.release.model_card import DPModelCardData, render_dp_section


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("per_sample_max_grad_norm", math.inf),
        ("per_sample_max_grad_norm", math.nan),
        ("noise_multiplier", math.inf),
        ("noise_multiplier", math.nan),
        ("target_delta", math.nan),
        ("automatic_clipping_gamma", math.inf),
    ],
)
def test_non_finite_settings_are_refused_with_what_to_set(tmp_dir, field, value):
    with pytest.raises(ValueError, match=f"`{field}`") as raised:
        dp_args(tmp_dir, **{field: value})
    if field != "target_delta":
        assert "finite" in str(raised.value) and f"Set `{field}`" in str(raised.value)


@pytest.mark.parametrize(
    "overrides",
    [{"clipping_norm_lr": math.inf}, {"count_noise_multiplier": math.inf}, {"target_unclipped_quantile": math.nan}],
)
def test_non_finite_adaptive_clipping_settings_are_refused(tmp_dir, overrides):
    with pytest.raises(ValueError, match=f"`{next(iter(overrides))}`"):
        dp_args(tmp_dir, adaptive_clipping=True, **overrides)


def test_target_epsilon_inf_is_refused(tmp_dir):
    with pytest.raises(ValueError, match="`target_epsilon` must be a finite number"):
        DPTrainingArguments(output_dir=tmp_dir, target_epsilon=math.inf)


def test_an_infinite_c_set_after_the_arguments_were_built_is_refused_at_train(tmp_dir):
    trainer = DPTrainer(model=gpt2(), args=dp_args(tmp_dir, max_steps=1), train_dataset=ToyDataset(40),
                        data_collator=collate)  # fmt: skip
    trainer.args.per_sample_max_grad_norm = math.inf  # edited after __post_init__ checked it
    with pytest.raises(ValueError, match="`per_sample_max_grad_norm` must be a finite number"):
        trainer.train()


def test_accounting_refuses_non_finite_noise_at_once():
    """`epsilon(noise_multiplier=inf)` looped in the RDP series before: run it in a child with a timeout."""
    code = (
        "from hf_dp.accounting import epsilon\n"
        "for s in (float('inf'), float('nan')):\n"
        "    try:\n"
        "        epsilon(s, sample_rate=0.1, steps=10, delta=1e-5)\n"
        "    except ValueError as e:\n"
        "        assert 'finite' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('accepted')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    with pytest.raises(ValueError, match="finite"):
        noise_multiplier(3.0, 1e-5, 0.1, 10, past=[(math.inf, 0.1, 5)])
    assert math.isfinite(epsilon(1.0, sample_rate=0.1, steps=10, delta=1e-5))


def test_no_card_states_a_guarantee_for_an_infinite_c():
    data = DPModelCardData(
        epsilons={"rdp": 1.0}, accountant="rdp", delta=1e-5, expected_batch_size=8, num_examples=40,
        max_grad_norm=math.inf, clipping_mode="bk-mixopt", poisson_sampling=True, optimizer="AdamW",
        segments=[(1.0, 0.2, 4)],
    )  # fmt: skip
    with pytest.raises(ValueError, match="finite clipping norm"):
        render_dp_section(data)


# ------------------------------------------------------------------------------------------------ nothing to learn
class Ignored(ToyDataset):
    """Every label -100: no token to learn."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        return {**item, "labels": torch.full_like(item["labels"], -100)}


class Empty(ToyDataset):
    """Sequences of length 0."""

    def __getitem__(self, i):
        return {k: v[:0] for k, v in super().__getitem__(i).items()}


def test_every_label_ignored_is_refused_before_training(tmp_dir):
    trainer = DPTrainer(model=gpt2(), args=dp_args(tmp_dir, max_steps=2), train_dataset=Ignored(40),
                        data_collator=collate)  # fmt: skip
    with pytest.raises(ValueError, match="has a target to learn: every label is -100") as raised:
        trainer.train()
    assert "all of the 40 rows" in str(raised.value)
    assert trainer.dp_callback.steps == 0


def test_a_few_ignored_rows_are_fine(tmp_dir):
    class SomeIgnored(ToyDataset):
        def __getitem__(self, i):
            item = super().__getitem__(i)
            return {**item, "labels": torch.full_like(item["labels"], -100)} if i % 2 else item

    trainer = DPTrainer(model=gpt2(), args=dp_args(tmp_dir, max_steps=1), train_dataset=SomeIgnored(40),
                        data_collator=collate)  # fmt: skip
    trainer.train()
    assert trainer.dp_callback.steps == 1


def test_sequences_of_length_zero_are_refused_with_a_clear_message(tmp_dir):
    trainer = DPTrainer(model=gpt2(), args=dp_args(tmp_dir, max_steps=2), train_dataset=Empty(40),
                        data_collator=collate)  # fmt: skip
    with pytest.raises(ValueError, match="have no tokens: every sequence is of length 0 \\(all of the 40 rows"):
        trainer.train()


def test_an_empty_training_set_says_what_to_do(tmp_dir):
    with pytest.raises(ValueError, match="`train_dataset` is empty .* pass the non-empty training set"):
        DPTrainer(model=gpt2(), args=dp_args(tmp_dir), train_dataset=ToyDataset(0), data_collator=collate)
