"""The banded Toeplitz strategy: its sensitivity against a brute force over participation patterns, its error against
a dense float64 computation, the optimizer against perturbations and DP-SGD, caching and refusals."""

import itertools
import math

import numpy as np
import pytest

from hf_dp.step.bandmf import MAX_SCHEDULE_STEPS, BandedToeplitzStrategy, banded_sensitivity, optimize_banded_toeplitz


def dense(coefficients, n):
    matrix = np.zeros((n, n))
    for k, value in enumerate(coefficients):
        matrix += np.diag(np.full(n - k, float(value)), -k)
    return matrix


def dense_workload(n, momentum=0.0, learning_rates=None):
    """A[t, r]: the change of theta_t per unit of gradient at step r, from SGD's update rules run on unit vectors."""
    eta = np.ones(n) if learning_rates is None else np.asarray(learning_rates, dtype=np.float64)
    workload = np.zeros((n, n))
    for r in range(n):
        buffer, theta = 0.0, 0.0
        for t in range(n):
            buffer = momentum * buffer + (1.0 if t == r else 0.0)
            theta += eta[t] * buffer
            workload[t, r] = theta
    return workload


def dense_rmse(coefficients, n, momentum=0.0, learning_rates=None):
    c = np.asarray(coefficients, dtype=np.float64)
    product = np.linalg.solve(dense(c, n).T, dense_workload(n, momentum, learning_rates).T).T  # A C^{-1}
    column = max(np.linalg.norm(dense(c, n), axis=0))
    return column * math.sqrt(np.sum(product**2) / n)


def brute_force_sensitivity(matrix, separation, participations):
    """max ||C u|| over u in {-1, 0, 1}^n supported on at most ``participations`` steps pairwise >= ``separation``
    apart; and the upper bound max over the same supports of sum_{s,t} |(C^T C)_{st}| (equal when the columns of a
    support are orthogonal, which is then the exact sensitivity for gradients of any direction)."""
    n = matrix.shape[0]
    gram = matrix.T @ matrix
    best_lower, best_upper = 0.0, 0.0
    for size in range(1, participations + 1):
        for support in itertools.combinations(range(n), size):
            if any(b - a < separation for a, b in itertools.pairwise(support)):
                continue
            block = gram[np.ix_(support, support)]
            best_upper = max(best_upper, float(np.abs(block).sum()))
            for signs in itertools.product((-1.0, 1.0), repeat=size - 1):
                u = np.array((1.0, *signs))
                best_lower = max(best_lower, float(u @ block @ u))
    return math.sqrt(best_lower), math.sqrt(best_upper)


@pytest.mark.parametrize(("steps", "bands"), [(12, 1), (12, 2), (11, 3), (10, 4), (7, 4)])
@pytest.mark.parametrize("extra", [0, 1])
def test_sensitivity_against_brute_force(steps, bands, extra):
    rng = np.random.default_rng(steps * 10 + bands)
    coefficients = rng.standard_normal(bands)
    coefficients[0] = abs(coefficients[0]) + 0.1
    coefficients /= np.linalg.norm(coefficients)
    separation = bands + extra
    matrix = dense(coefficients, steps)
    for participations in (1, 2, 3, 5):
        lower, upper = brute_force_sensitivity(matrix, separation, participations)
        ours = banded_sensitivity(coefficients, steps, participations, separation)
        assert ours == pytest.approx(lower, rel=1e-12) and ours == pytest.approx(upper, rel=1e-12)


def test_sensitivity_below_the_bands_is_refused():
    with pytest.raises(ValueError, match="min_separation"):
        banded_sensitivity([0.8, 0.6], 10, 2, min_separation=1)


@pytest.mark.parametrize(
    ("steps", "bands", "kwargs"),
    [
        (48, 4, {}),
        (40, 6, {"momentum": 0.9}),
        (36, 3, {"learning_rates": list(np.linspace(1.0, 0.05, 36))}),
        (30, 5, {"momentum": 0.5, "learning_rates": [min(1.0, (t + 1) / 5) for t in range(30)]}),
    ],
)
def test_error_against_dense_and_local_optimum(steps, bands, kwargs):
    strategy = optimize_banded_toeplitz(steps, bands, **kwargs)
    assert strategy.bands == bands and strategy.sensitivity() == pytest.approx(1.0)
    assert strategy.error == pytest.approx(dense_rmse(strategy.coefficients, steps, **kwargs), rel=1e-10)
    assert strategy.dpsgd_error == pytest.approx(dense_rmse([1.0], steps, **kwargs), rel=1e-10)
    assert strategy.error < strategy.dpsgd_error
    rng = np.random.default_rng(0)
    c = np.array(strategy.coefficients)
    for scale in (1e-2, 1e-3):
        for _ in range(10):
            assert dense_rmse(c + scale * rng.standard_normal(bands), steps, **kwargs) >= strategy.error * (1 - 1e-9)
    for _ in range(10):  # other banded coefficients (random, positive first)
        other = rng.standard_normal(bands)
        other[0] = abs(other[0])
        assert dense_rmse(other, steps, **kwargs) >= strategy.error


def test_more_bands_never_worse_and_one_band_is_dp_sgd():
    errors = [optimize_banded_toeplitz(200, b).error for b in (1, 2, 4, 8, 16)]
    assert errors[0] == pytest.approx(dense_rmse([1.0], 200))  # one band: the identity, DP-SGD
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in itertools.pairwise(errors))


def test_cached_and_deterministic():
    first = optimize_banded_toeplitz(300, 8, momentum=0.9)
    assert optimize_banded_toeplitz(300, 8, momentum=0.9) is first
    assert optimize_banded_toeplitz(300, 8, learning_rates=[0.1] * 300) is optimize_banded_toeplitz(300, 8)
    assert optimize_banded_toeplitz(300, 8, momentum=0.9, learning_rates=[0.1] * 300).workload == first.workload
    assert first.workload == "momentum 0.9, prefix-sum" and optimize_banded_toeplitz(300, 8).workload == "prefix-sum"


def test_refusals():
    with pytest.raises(ValueError, match="bands"):
        optimize_banded_toeplitz(4, 5)
    with pytest.raises(ValueError, match="momentum"):
        optimize_banded_toeplitz(10, 2, momentum=1.0)
    with pytest.raises(ValueError, match="learning_rates"):
        optimize_banded_toeplitz(10, 2, learning_rates=[0.1] * 9)
    with pytest.raises(ValueError, match="learning_rates=None"):
        optimize_banded_toeplitz(MAX_SCHEDULE_STEPS + 1, 2, learning_rates=np.linspace(1, 0.1, MAX_SCHEDULE_STEPS + 1))
    with pytest.raises(ValueError, match="unit L2 norm"):
        BandedToeplitzStrategy((1.0, 0.5), steps=10, workload="x", error=1.0, dpsgd_error=1.0)
    with pytest.raises(ValueError, match="grow without bound"):  # 0.6 - 0.8 x: root 0.75, w_t grows like (4/3)^t
        BandedToeplitzStrategy((0.6, -0.8), steps=10, workload="x", error=1.0, dpsgd_error=1.0)
