"""The DP step as a plain object: an ``nn.Module``, a clipper, a noise source and a record, no Trainer.

Every expected value comes from outside hf_dp's step: clipped sums from the float64 per-example oracle
(:mod:`oracle`), the noise from its statistics or from a second source with the same seed, the steps from a record
that counts the calls it receives.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.oracle import oracle_clipped
from torch import nn

from hf_dp import BookKeepingClipper
from hf_dp.step.adaptive_clipping import QuantileClipping, update_clipping_norm
from hf_dp.step.adaptive_state import AdaptiveClippingState
from hf_dp.step.dp_step import DPStep, DPStepSettings
from hf_dp.step.noise import NoiseSource


class CountingRecord:
    """A privacy record that keeps every call it receives (the test's own step count)."""

    def __init__(self) -> None:
        self.recorded: list[tuple[float, float]] = []
        self.clip_norms: list[tuple[float, float]] = []
        self.clip_norms_used: list[float] = []

    @property
    def steps(self) -> int:
        return len(self.recorded)

    def record_step(self, *, noise_multiplier: float, sample_rate: float, max_grad_norm: float) -> None:
        self.recorded.append((noise_multiplier, sample_rate))
        self.clip_norms_used.append(max_grad_norm)

    def record_clip_norm(self, used: float, next_clip_norm: float) -> None:
        self.clip_norms.append((used, next_clip_norm))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def batches(n: int, rows: int = 5) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(rows, 6, generator=generator, dtype=torch.float64), "y": torch.randint(0, 3, (rows,))}
        for _ in range(n)
    ]


def per_example_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"], reduction="none")


def run_step(step: DPStep, model: nn.Module, micro_batches: list[dict]) -> None:
    """One logical step the way a training loop drives it."""
    for batch in micro_batches:
        step.begin_micro_batch()
        step.prepare(per_example_loss(model, batch)).backward()
        step.accumulate()
    step.privatize()


def settings(**overrides) -> DPStepSettings:
    values = {"noise_multiplier": 0.0, "sample_rate": 0.5, "expected_batch_size": 8, "max_grad_norm": 0.0}
    return DPStepSettings(**{**values, **overrides})


class TestUpdate:
    def test_without_noise_the_gradient_is_the_clipped_sum_over_micro_batches_divided_by_l(self):
        model, data = mlp(), batches(2)
        names, _, expected, c = oracle_clipped(model, data, per_example_loss, None)  # C: the median norm
        record = CountingRecord()
        step = DPStep(
            settings(max_grad_norm=c),
            clipper=BookKeepingClipper(model, max_grad_norm=c),
            noise=NoiseSource(0),
            record=record,
        )
        run_step(step, model, data)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, expected[name] / 8, rtol=1e-9, atol=1e-12, msg=name)
        assert record.recorded == [(0.0, 0.5)]

    def test_noise_is_added_once_with_std_sigma_c_over_l(self):
        model = nn.Linear(200, 100, bias=False).double()
        step = DPStep(
            settings(noise_multiplier=2.0, max_grad_norm=0.5, expected_batch_size=4),
            clipper=BookKeepingClipper(model, max_grad_norm=0.5),
            noise=NoiseSource(7),
            record=CountingRecord(),
        )
        step.begin_micro_batch()
        step.privatize()  # an empty logical batch: the gradient is the noise alone
        noise = model.weight.grad
        expected_std = 2.0 * 0.5 / 4
        assert abs(float(noise.std()) / expected_std - 1) < 0.03  # 20,000 draws: ~0.5% standard error
        assert abs(float(noise.mean())) < 4 * expected_std / math.sqrt(noise.numel())

    def test_the_noise_of_step_s_is_the_sources_draw_for_s(self):
        model = nn.Linear(4, 3).double()
        clipper = BookKeepingClipper(model, max_grad_norm=1.0)
        record = CountingRecord()
        step = DPStep(
            settings(noise_multiplier=1.5, max_grad_norm=1.0), clipper=clipper, noise=NoiseSource(3), record=record
        )
        for s in range(2):
            model.zero_grad(set_to_none=True)
            step.begin_micro_batch()
            step.privatize()
            params = [p for p in model.parameters()]
            expected = NoiseSource(3).normal(
                step=s, shapes=[p.shape for p in params], std=1.5 * 1.0 / 8, device="cpu", dtype=torch.float32
            )
            for p, e in zip(params, expected, strict=True):
                torch.testing.assert_close(p.grad, e.double(), rtol=0, atol=0)
        assert record.steps == 2

    def test_an_empty_logical_batch_still_takes_a_recorded_noisy_step(self):
        model = mlp()
        record = CountingRecord()
        step = DPStep(
            settings(noise_multiplier=1.0, max_grad_norm=1.0),
            clipper=BookKeepingClipper(model, max_grad_norm=1.0),
            noise=NoiseSource(0),
            record=record,
        )
        for _ in range(3):
            step.begin_micro_batch()
            step.privatize()
        assert record.recorded == [(1.0, 0.5)] * 3
        assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.parameters())


class TestAdaptiveClipping:
    def test_the_next_c_follows_the_noised_count_and_reaches_the_clipper(self):
        model, data = mlp(), batches(1, rows=8)
        config = QuantileClipping(target_quantile=0.5, learning_rate=0.2, count_noise_multiplier=1.0)
        adaptive = AdaptiveClippingState.start(config, max_grad_norm=0.05, expected_batch_size=8)
        clipper = BookKeepingClipper(model, max_grad_norm=0.05)
        record = CountingRecord()
        step = DPStep(
            settings(max_grad_norm=0.05, count_noise_multiplier=1.0),  # sigma 0: no noise at all, the count exact
            clipper=clipper,
            noise=NoiseSource(0),
            record=record,
            adaptive=adaptive,
        )
        _, norms, _, _ = oracle_clipped(model, data, per_example_loss, 0.05)
        run_step(step, model, data)
        unclipped = float(((norms[0] <= 0.05).double() - 0.5).sum())  # the centred count, noise 0
        expected = update_clipping_norm(0.05, unclipped, 8, config)
        assert record.clip_norms == [(0.05, pytest.approx(expected))]
        assert clipper.max_grad_norm == pytest.approx(expected) and step.clip_norm == pytest.approx(expected)


class TestSettings:
    @pytest.mark.parametrize(
        "field, value",
        [
            ("max_grad_norm", math.inf),
            ("noise_multiplier", math.nan),
            ("noise_multiplier", math.inf),
            ("max_grad_norm", -1.0),
        ],
    )
    def test_settings_that_void_the_guarantee_are_refused(self, field, value):
        with pytest.raises(ValueError, match=field):
            settings(**{field: value})

    def test_the_gradient_share_defaults_to_sigma(self):
        assert settings(noise_multiplier=1.3).gradient_noise_multiplier == 1.3
