"""The DP step with banded correlated noise (issue 41): the gradients get row t of C^-1 Z times w sigma C at step t
(computed here in float64 from the base stream's standard normals, by forward substitution), and fp16's dropped count
gets independent noise from another stream, never the gradients' normals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from hf_dp.step.bandmf import CorrelatedNoiseSource, optimize_banded_toeplitz
from hf_dp.step.dp_step import DPStep, DPStepSettings
from hf_dp.step.noise import NoiseSource


class StepRecord:
    steps = 0


def expected_rows(seed: int, shapes, coefficients, steps: int) -> list[list[np.ndarray]]:
    """Rows 0..steps-1 of C^-1 Z in float64: w_t = (z_t - sum_{k>=1} c_k w_{t-k}) / c_0."""
    base = NoiseSource(seed)
    rows: list[list[np.ndarray]] = []
    for t in range(steps):
        z = [n.double().numpy() for n in base.normal(step=t, shapes=shapes, std=1.0, device="cpu", dtype=torch.float32)]
        w = [zi.copy() for zi in z]
        for k in range(1, len(coefficients)):
            if t - k >= 0:
                w = [wi - coefficients[k] * prev for wi, prev in zip(w, rows[t - k], strict=True)]
        rows.append([wi / coefficients[0] for wi in w])
    return rows


@pytest.mark.parametrize("bands", [2, 4])
def test_step_t_adds_row_t_of_c_inverse_z_and_the_count_its_own_noise(bands):
    model = nn.Linear(3, 2)
    strategy = optimize_banded_toeplitz(12, bands)
    sigma, clip, batch = 0.7, 0.5, 4
    record = StepRecord()
    step = DPStep(
        DPStepSettings(noise_multiplier=sigma, sample_rate=0.1, expected_batch_size=batch, max_grad_norm=clip),
        noise=CorrelatedNoiseSource(NoiseSource(21), strategy),
        count_noise=NoiseSource(21, stream=-1),
        record=record,
        clipper=type("Clipper", (), {"model": model})(),
    )
    shapes = [p.shape for p in model.parameters()]
    rows = expected_rows(21, shapes, strategy.coefficients, 7)
    std = sigma * clip / batch  # w sigma C, w = 1 / L
    for t in range(7):
        record.steps = t
        grads = [torch.zeros(s) for s in shapes]
        dropped = torch.zeros(())
        step.add_noise(grads, dropped)
        for g, row in zip(grads, rows[t], strict=True):
            np.testing.assert_allclose(g.double().numpy(), std * row, rtol=1e-5, atol=1e-7)
        count = NoiseSource(21, stream=-1).normal(step=t, shapes=[()], std=sigma, device="cpu", dtype=torch.float32)
        assert torch.equal(dropped, count[0])
        joint = NoiseSource(21).normal(step=t, shapes=[*shapes, ()], std=1.0, device="cpu", dtype=torch.float32)
        assert not torch.isclose(dropped / sigma, joint[-1]).item()  # not the base stream's draw for the count


def test_the_noise_state_is_b_minus_1_rows_of_the_trainable_parameters():
    model = nn.Linear(5, 3)
    strategy = optimize_banded_toeplitz(10, 3)
    source = CorrelatedNoiseSource(NoiseSource(1), strategy)
    record = StepRecord()
    step = DPStep(
        DPStepSettings(noise_multiplier=1.0, sample_rate=0.1, expected_batch_size=2, max_grad_norm=1.0),
        noise=source,
        count_noise=NoiseSource(1, stream=-1),
        record=record,
        clipper=type("Clipper", (), {"model": model})(),
    )
    for t in range(4):
        record.steps = t
        step.add_noise([torch.zeros_like(p) for p in model.parameters()])
    assert source.memory_bytes == 2 * sum(p.numel() for p in model.parameters()) * 4


def test_fp16_banded_run_noises_gradients_correlated_and_the_dropped_count_from_its_own_stream(tmp_dir, monkeypatch):
    from helpers.models import gpt2
    from helpers.trainer import ToyDataset, collate, dp_args
    from test_fp16 import with_cpu_fp16

    from hf_dp import DPTrainer

    calls = []
    original = DPStep._add

    def spy(self, source, targets, stds):
        calls.append((source, [tuple(t.shape) for t in targets], list(stds)))
        return original(self, source, targets, stds)

    monkeypatch.setattr(DPStep, "_add", spy)
    args = dp_args(tmp_dir, fp16=True, max_steps=4, noise_mechanism="banded-toeplitz", noise_bands=2)
    trainer = with_cpu_fp16(
        DPTrainer(model=gpt2(), args=args, train_dataset=ToyDataset(40), data_collator=collate), init_scale=2.0**8
    )
    trainer.train()
    assert trainer.dp_callback.steps == 4
    trainable = [tuple(p.shape) for p in trainer.model.parameters() if p.requires_grad]
    gradient_calls, count_calls = calls[0::2], calls[1::2]
    assert len(gradient_calls) == len(count_calls) == 4
    for (grad_source, grad_shapes, grad_stds), (count_source, count_shapes, count_stds) in zip(
        gradient_calls, count_calls, strict=True
    ):
        assert isinstance(grad_source, CorrelatedNoiseSource) and grad_shapes == trainable
        assert isinstance(count_source, NoiseSource) and count_source.stream == -1 and count_shapes == [(1,)]
        assert count_stds == [1.0]  # sigma of the dropped count (in units of examples)
        assert grad_stds[0] == pytest.approx(2.0**8 / 8 * 1.0 * 0.1, rel=1e-6)  # w sigma C with w = K / L
