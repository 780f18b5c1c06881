"""fp16 end to end on CPU (torch 2.13: fp16 autocast and GradScaler("cpu")): K-scaled clipping, and a loss scale
that backs off on the noised count of overflowed examples (hf_dp.step.loss_scale)."""

import copy

import pytest
import torch
from helpers.models import gpt2
from helpers.trainer import ToyDataset, collate, dp_args, sgd_step_args

from hf_dp import DPTrainer
from hf_dp.step.loss_scale import NoisedOverflowScalePolicy


def with_cpu_fp16(trainer: DPTrainer, init_scale: float) -> DPTrainer:
    """What accelerate sets up for fp16 on a GPU (autocast + GradScaler), on the CPU."""
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return trainer


def one_step(model, tmp_dir, **overrides):
    args = sgd_step_args(tmp_dir, per_sample_max_grad_norm=0.05, **overrides)
    return DPTrainer(model=model, args=args, train_dataset=ToyDataset(8), data_collator=collate)


def test_fp16_update_matches_fp32_where_nothing_overflows(tmp_dir):
    torch.manual_seed(0)
    base = gpt2()
    fp32, fp16 = copy.deepcopy(base), copy.deepcopy(base)
    one_step(fp32, f"{tmp_dir}/a").train()
    trainer = with_cpu_fp16(one_step(fp16, f"{tmp_dir}/b", fp16=True), init_scale=2.0**10)
    trainer.train()
    assert trainer.dp_step.loss_scaling.policy.scale == 2.0**10  # nothing overflowed: no back-off
    for (name, p0), p32, p16 in zip(base.named_parameters(), fp32.parameters(), fp16.parameters(), strict=True):
        d32, d16 = (p32 - p0).detach(), (p16 - p0).detach()
        assert float((d16 - d32).norm()) <= 0.02 * float(d32.norm()) + 1e-6, name


def test_forced_overflow_backs_off_and_training_recovers(tmp_dir, monkeypatch):
    counts = []
    original = NoisedOverflowScalePolicy.update

    def spy(policy, noised):
        counts.append((policy.scale, noised))
        return original(policy, noised)

    monkeypatch.setattr(NoisedOverflowScalePolicy, "update", spy)
    torch.manual_seed(0)
    model = gpt2()
    args = dp_args(
        tmp_dir,
        fp16=True,
        noise_multiplier=0.1,
        max_steps=14,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        per_sample_max_grad_norm=1.0,
    )
    trainer = with_cpu_fp16(
        DPTrainer(model=model, args=args, train_dataset=ToyDataset(40), data_collator=collate), init_scale=2.0**26
    )
    trainer.train()
    scales = [s for s, _ in counts]
    assert counts[0][1] > 1  # the first steps drop (nearly) every example, and the noised count says so
    assert scales[0] == 2.0**26 and scales[-1] <= 2.0**26 / 2**5  # backed off step after step
    assert all(n <= 1 for _, n in counts[-3:])  # recovered: the last steps keep their examples
    assert trainer.dp_callback.steps == 14  # every step counted, none skipped


@pytest.mark.parametrize("noised,expected", [(0.5, 1024.0), (5.0, 512.0)])
def test_policy_backs_off_above_the_threshold_only(noised, expected):
    policy = NoisedOverflowScalePolicy(scale=1024.0, threshold=NoisedOverflowScalePolicy.threshold_for(1.0, 64))
    assert policy.threshold == 3.0
    assert policy.update(noised) == expected


def test_policy_grows_after_quiet_steps():
    policy = NoisedOverflowScalePolicy(scale=8.0, threshold=1.0, growth_interval=3)
    assert [policy.update(0.0) for _ in range(3)] == [8.0, 8.0, 16.0]
