"""Accounting follows what happened (issue 16): resume paths, changed settings, repeated train(), no replayed draw."""

import copy
import os

import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args
from transformers import TrainerCallback

from hf_dp import DPTrainer
from hf_dp.accounting import epsilon as accounting_epsilon

dp_accounting = pytest.importorskip("dp_accounting")


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class UsedBatches(DPTrainer):
    """Records the examples of every micro-batch a training step actually used (the DataLoader may collate ahead)."""

    used: list

    def training_step(self, model, inputs, num_items_in_batch=None):
        if "input_ids" in inputs:
            self.used.append(sorted(tuple(row) for row in inputs["input_ids"].tolist()))
        return super().training_step(model, inputs, num_items_in_batch)


def rdp_reference(segments, delta):
    from hf_dp.accounting.analysis.rdp import DEFAULT_ORDERS

    ref = dp_accounting.rdp.RdpAccountant(orders=list(DEFAULT_ORDERS))
    for sigma, q, steps in segments:
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        ref.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return ref.get_epsilon(delta)


def test_resume_with_a_fixed_noise_seed_is_bit_identical(tmp_dir):
    common = dict(max_steps=6, save_strategy="steps", save_steps=3, noise_seed=11)
    dataset = ToyDataset(40)
    torch.manual_seed(0)
    init = gpt2().state_dict()

    def model():
        m = gpt2()
        m.load_state_dict(copy.deepcopy(init))
        return m

    full = DPTrainer(
        model=model(), args=dp_args(os.path.join(tmp_dir, "a"), **common), train_dataset=dataset, data_collator=collate
    )
    full.train()
    part_dir = os.path.join(tmp_dir, "b")
    first = DPTrainer(
        model=model(),
        args=dp_args(part_dir, **common),
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[StopAt(3)],
    )
    first.train()
    resumed = DPTrainer(model=model(), args=dp_args(part_dir, **common), train_dataset=dataset, data_collator=collate)
    resumed.train(resume_from_checkpoint=True)
    for (name, a), b in zip(resumed.model.state_dict().items(), full.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.dp_callback.history == full.dp_callback.history == [[1.0, 0.2, 6]]


@pytest.mark.parametrize("restore_callback_states", [True, False])
def test_resume_with_changed_sigma_and_batch_accounts_both_segments(tmp_dir, restore_callback_states):
    """sigma 2 -> 1.5 and L 8 -> 16 after step 3: epsilon is the composition of both segments (dp-accounting)."""
    dataset = ToyDataset(40)
    common = dict(save_strategy="steps", save_steps=3, restore_callback_states_from_checkpoint=restore_callback_states)
    first = DPTrainer(
        model=gpt2(),
        args=dp_args(tmp_dir, max_steps=6, noise_multiplier=2.0, **common),
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[StopAt(3)],
    )
    first.train()
    args = dp_args(tmp_dir, max_steps=6, noise_multiplier=1.5, per_device_train_batch_size=8, **common)
    resumed = DPTrainer(model=gpt2(), args=args, train_dataset=dataset, data_collator=collate)
    resumed.train(resume_from_checkpoint=True)
    segments = [(2.0, 0.2, 3), (1.5, 0.4, 3)]
    assert [tuple(s) for s in resumed.dp_callback.history] == segments
    expected = rdp_reference(segments, 1 / 80)
    assert resumed.state.log_history[-1]["epsilon"] == pytest.approx(expected, rel=1e-3)
    assert resumed.epsilon() > accounting_epsilon(2.0, 0.2, 6, 1 / 80)  # what the old accounting would have said


def test_resume_recalibrates_the_rest_of_the_budget(tmp_dir):
    """target_epsilon with a larger batch after the resume: sigma of the rest is calibrated given the spent privacy."""
    dataset = ToyDataset(40)
    common = dict(save_strategy="steps", save_steps=3, noise_multiplier=None, target_epsilon=4.0, max_steps=6)
    first = DPTrainer(
        model=gpt2(),
        args=dp_args(tmp_dir, **common),
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[StopAt(3)],
    )
    first.train()
    resumed = DPTrainer(
        model=gpt2(),
        args=dp_args(tmp_dir, per_device_train_batch_size=8, **common),
        train_dataset=dataset,
        data_collator=collate,
    )
    resumed.train(resume_from_checkpoint=True)
    (s1, q1, n1), (s2, q2, n2) = resumed.dp_callback.history
    assert (q1, n1, q2, n2) == (0.2, 3, 0.4, 3) and s2 != s1
    assert resumed.epsilon() <= 4.0
    assert rdp_reference([(s1, q1, n1), (s2 * 0.97, q2, n2)], 1 / 80) > 4.0  # and not much more noise than needed


def test_resume_on_another_training_set_is_refused(tmp_dir):
    common = dict(save_strategy="steps", save_steps=2, max_steps=4)
    DPTrainer(
        model=gpt2(),
        args=dp_args(tmp_dir, **common),
        train_dataset=ToyDataset(40),
        data_collator=collate,
        callbacks=[StopAt(2)],
    ).train()
    other = DPTrainer(
        model=gpt2(), args=dp_args(tmp_dir, **common), train_dataset=ToyDataset(48), data_collator=collate
    )
    with pytest.raises(ValueError, match="N=40"):
        other.train(resume_from_checkpoint=True)


def test_second_train_draws_fresh_batches_and_accounts_all_steps(tmp_dir):
    args = dp_args(tmp_dir, max_steps=5, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    UsedBatches.used = []
    trainer = UsedBatches(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate)
    trainer.train()
    first = list(UsedBatches.used)
    trainer.train()
    second = UsedBatches.used[len(first) :]
    assert len(first) == len(second) == 5
    assert not any(b in first for b in second if b)  # no logical batch replayed
    assert trainer.dp_callback.steps == 10
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(accounting_epsilon(1.0, 0.2, 10, 1 / 80))


@pytest.mark.parametrize("noise_seed", [0, None])
def test_ignore_data_skip_never_replays(tmp_dir, noise_seed):
    common = dict(
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        noise_seed=noise_seed,
    )
    dataset = ToyDataset(40)
    UsedBatches.used = []
    UsedBatches(
        model=gpt2(),
        args=dp_args(tmp_dir, **common),
        train_dataset=dataset,
        data_collator=collate,
        callbacks=[StopAt(2)],
    ).train()
    before = list(UsedBatches.used)
    resumed = UsedBatches(
        model=gpt2(),
        args=dp_args(tmp_dir, ignore_data_skip=True, **common),
        train_dataset=dataset,
        data_collator=collate,
    )
    resumed.train(resume_from_checkpoint=True)
    after = UsedBatches.used[len(before) :]
    assert len(before) == 2 and len(after) == 2
    assert not any(b in before for b in after)
    assert resumed.dp_callback.steps == 4
