"""CorrelatedNoiseSource: the noise over T steps is C^{-1} Z for the dense C of the coefficients (float64, solved
independently), b = 1 is NoiseSource bit for bit, a resume replays or restarts, and the secret stays in memory."""

import pickle

import numpy as np
import pytest
import torch

from hf_dp.step.bandmf import BandedToeplitzStrategy, CorrelatedNoiseSource, optimize_banded_toeplitz
from hf_dp.step.noise import NoiseSource

SHAPES = [(3, 2), (5,)]


def dense_strategy_matrix(coefficients, steps):
    matrix = torch.zeros(steps, steps, dtype=torch.float64)
    for k, value in enumerate(coefficients):
        matrix += torch.diag(torch.full((steps - k,), float(value), dtype=torch.float64), -k)
    return matrix


def base_rows(seed, steps, shapes=SHAPES):
    """Z: row s is the base source's draw at step s (std 1), flattened over the shapes."""
    source = NoiseSource(seed)
    rows = [source.normal(step=s, shapes=shapes, std=1.0, device="cpu", dtype=torch.float64) for s in range(steps)]
    return torch.stack([torch.cat([t.reshape(-1) for t in row]) for row in rows])


def correlated_rows(source, steps, std=1.0, shapes=SHAPES, start=0):
    out = []
    for s in range(start, steps):
        noise = source.normal(step=s, shapes=shapes, std=std, device="cpu", dtype=torch.float64)
        assert [tuple(t.shape) for t in noise] == [tuple(s) for s in shapes]
        out.append(torch.cat([t.reshape(-1) for t in noise]))
    return torch.stack(out)


@pytest.mark.parametrize(("steps", "bands"), [(12, 3), (20, 6), (9, 9)])
def test_noise_over_the_run_is_c_inverse_z(steps, bands):
    strategy = optimize_banded_toeplitz(steps, bands)
    got = correlated_rows(CorrelatedNoiseSource(NoiseSource(7), strategy), steps, std=0.5)
    matrix = dense_strategy_matrix(strategy.coefficients, steps)
    expected = torch.linalg.solve_triangular(matrix, base_rows(7, steps), upper=False) * 0.5
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # and the noise really is correlated: C applied to it gives back the independent rows
    torch.testing.assert_close(matrix @ got / 0.5, base_rows(7, steps), rtol=1e-12, atol=1e-12)


def test_arbitrary_coefficients_and_per_shape_std():
    coefficients = np.array([2.0, -0.7, 0.4, 0.1])
    coefficients /= np.linalg.norm(coefficients)
    strategy = BandedToeplitzStrategy(tuple(coefficients), steps=10, workload="test", error=1.0, dpsgd_error=1.0)
    source = CorrelatedNoiseSource(NoiseSource(3), strategy)
    got = [source.normal(step=s, shapes=SHAPES, std=[1.0, 3.0], device="cpu", dtype=torch.float64) for s in range(10)]
    expected = torch.linalg.solve_triangular(dense_strategy_matrix(coefficients, 10), base_rows(3, 10), upper=False)
    torch.testing.assert_close(torch.stack([g[0].reshape(-1) for g in got]), expected[:, :6])
    torch.testing.assert_close(torch.stack([g[1] for g in got]), 3.0 * expected[:, 6:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_one_band_is_dp_sgd_bit_for_bit(dtype):
    strategy = optimize_banded_toeplitz(50, 1)
    assert strategy.coefficients == (1.0,)
    correlated = CorrelatedNoiseSource(NoiseSource(11), strategy)
    plain = NoiseSource(11)
    for step in (0, 1, 5):
        a = correlated.normal(step=step, shapes=SHAPES, std=[0.3, 2.0], device="cpu", dtype=dtype)
        b = plain.normal(step=step, shapes=SHAPES, std=[0.3, 2.0], device="cpu", dtype=dtype)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == dtype and torch.equal(x, y)


def test_resume_with_fixed_seed_replays_the_uninterrupted_noise():
    strategy = optimize_banded_toeplitz(30, 5)
    uninterrupted = correlated_rows(CorrelatedNoiseSource(NoiseSource(5), strategy), 30)
    resumed = correlated_rows(CorrelatedNoiseSource(NoiseSource(5), strategy), 30, start=17)
    assert torch.equal(resumed, uninterrupted[17:])


def test_resume_with_os_seed_restarts_the_recursion():
    strategy = optimize_banded_toeplitz(30, 4)
    base = NoiseSource(9)
    base.deterministic = False  # as the trainer marks an OS-drawn seed
    resumed = correlated_rows(CorrelatedNoiseSource(base, strategy), 30, start=12)
    # the rows from 12 on are C^{-1} applied to the base rows 12.. alone (a fresh block of C), nothing before
    block = dense_strategy_matrix(strategy.coefficients, 18)
    expected = torch.linalg.solve_triangular(block, base_rows(9, 30)[12:], upper=False)
    torch.testing.assert_close(resumed, expected, rtol=1e-12, atol=1e-12)


def test_same_step_again_and_steps_backwards():
    source = CorrelatedNoiseSource(NoiseSource(1), optimize_banded_toeplitz(10, 3))
    first = source.normal(step=0, shapes=SHAPES, std=1.0, device="cpu", dtype=torch.float64)
    again = source.normal(step=0, shapes=SHAPES, std=1.0, device="cpu", dtype=torch.float64)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))
    source.normal(step=3, shapes=SHAPES, std=1.0, device="cpu", dtype=torch.float64)
    with pytest.raises(ValueError, match="steps must increase"):
        source.normal(step=2, shapes=SHAPES, std=1.0, device="cpu", dtype=torch.float64)
    with pytest.raises(ValueError, match="changed between steps"):
        source.normal(step=4, shapes=[(3, 2)], std=1.0, device="cpu", dtype=torch.float64)


def test_memory_is_bands_minus_one_rows():
    source = CorrelatedNoiseSource(NoiseSource(1), optimize_banded_toeplitz(40, 6))
    assert source.memory_bytes == 0
    for step in range(10):
        source.normal(step=step, shapes=SHAPES, std=1.0, device="cpu", dtype=torch.float32)
    assert source.memory_bytes == 5 * (6 + 5) * 4


def test_secret_is_not_pickled_nor_shown():
    strategy = optimize_banded_toeplitz(20, 4)
    source = CorrelatedNoiseSource(NoiseSource(123456789), strategy)
    source.normal(step=2, shapes=SHAPES, std=1.0, device="cpu", dtype=torch.float32)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(source)
    text = repr(source)
    assert "123456789" not in text and not any(f"{c:.3}" in text for c in strategy.coefficients)
    assert not hasattr(source, "state_dict")
