"""The expected squared error of a workload under a banded Toeplitz strategy, and its gradient, in float64.

Notation: ``C`` is the ``n x n`` lower-triangular Toeplitz matrix with first column ``(c_0, ..., c_{b-1}, 0, ...)``
and ``A`` the workload (the released quantities as linear maps of the gradient sums). With noise ``C^{-1} Z``
(``Z`` i.i.d. N(0, 1)) the workload's noise is ``A C^{-1} Z`` and its expected squared error is
``||A C^{-1}||_F^2``.

Every lower-triangular Toeplitz matrix is the power series of its first column: products are products of series and
the inverse is the inverse series. The Toeplitz workloads here are series ``1 / den``:

* prefix sums (SGD at a constant learning rate): ``den = 1 - x``;
* SGD with momentum ``beta`` (``m_t = beta m_{t-1} + g_t``, ``theta_t = theta_{t-1} - eta m_t``, torch's SGD with
  ``dampening=0``): ``den = (1 - x)(1 - beta x)``.

So ``A C^{-1}`` is the Toeplitz matrix of ``e = 1 / (den * c)``, computed by one linear recursion (``lfilter``) in
``O(n (b + 2))``, and ``||A C^{-1}||_F^2 = sum_k (n - k) e_k^2``. A learning rate per step ``eta_s`` makes ``A`` not
Toeplitz: ``A[t, r] = sum_{s=r}^{t} eta_s f_{s-r}`` with ``f = 1 / (den_momentum * c)``; its norm is summed over the
``n^2 / 2`` entries by blocks of rows (``O(n^2)``).

Gradients are adjoint: for ``e = T(p)^{-1} e_0``, ``dE/dp_j = -sum_t v_t e_{t-j}`` with ``v = T(p)^{-T} dE/de`` (the
same recursion run backwards in time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy.signal import lfilter

__all__ = ["ErrorTerm", "dense_schedule_error", "impulse_response", "series_gradient", "toeplitz_error"]

#: ``(series) -> (squared error, its gradient with respect to the series)``.
ErrorTerm = Callable[[np.ndarray], tuple[float, np.ndarray]]

_ROW_BLOCK = 256


def impulse_response(polynomial: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` terms of the power series ``1 / polynomial`` (the first column of its Toeplitz inverse)."""
    unit = np.zeros(n)
    unit[0] = 1.0
    return lfilter([1.0], polynomial, unit)


def series_gradient(polynomial: np.ndarray, series: np.ndarray, grad_series: np.ndarray) -> np.ndarray:
    """``dE/dpolynomial`` for ``series = 1 / polynomial`` (``n`` terms), given ``dE/dseries``."""
    n = series.shape[0]
    adjoint = lfilter([1.0], polynomial, grad_series[::-1])[::-1]
    return -np.array([adjoint[j:] @ series[: n - j] for j in range(polynomial.shape[0])])


def toeplitz_error(series: np.ndarray) -> tuple[float, np.ndarray]:
    """``||T(series)||_F^2 = sum_k (n - k) series_k^2`` and its gradient."""
    weights = np.arange(series.shape[0], 0, -1, dtype=np.float64)
    return float(weights @ series**2), 2.0 * weights * series


def dense_schedule_error(learning_rates: Sequence[float]) -> ErrorTerm:
    """The error term of a per-step learning rate: ``sum_{r <= t} (sum_{s=r}^{t} eta_s f_{s-r})^2`` over the series
    ``f`` of the momentum filter times ``C^{-1}``, and its gradient (blocks of rows: memory ``O(256 n)``)."""
    eta = np.asarray(learning_rates, dtype=np.float64)
    n = eta.shape[0]
    # eta_at[r, k] = eta_{r + k} (0 past the end): row r of the Hankel matrix of eta, built per block.
    padded = np.concatenate([eta, np.zeros(n)])

    def term(series: np.ndarray) -> tuple[float, np.ndarray]:
        total = 0.0
        grad = np.zeros(n)
        for start in range(0, n, _ROW_BLOCK):
            rows = np.arange(start, min(start + _ROW_BLOCK, n))
            eta_at = padded[rows[:, None] + np.arange(n)[None, :]]
            partial = np.cumsum(eta_at * series[None, :], axis=1)  # P[r, t - r]; zero-weight tail adds nothing
            valid = np.arange(n)[None, :] < (n - rows)[:, None]
            partial = np.where(valid, partial, 0.0)
            total += float(np.sum(partial**2))
            back = np.cumsum((2.0 * partial)[:, ::-1], axis=1)[:, ::-1]
            grad += np.sum(eta_at * back, axis=0)
        return total, grad

    return term
