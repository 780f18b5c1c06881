"""Banded Toeplitz strategies for the matrix-factorization mechanism (BandMF), optimized for a run's workload.

The mechanism (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023, "(Amplified) Banded Matrix
Factorization: A unified approach to private training", arXiv:2306.08153): the noise added at step ``t`` is row ``t``
of ``C^{-1} Z`` times ``sigma * C_clip`` with ``C`` lower-triangular, banded (``c_k = 0`` for ``k >= b``) and
Toeplitz. Equivalently the run releases ``C G + Z`` (``G`` the clipped gradient sums, one row a step) and
post-processes it by ``C^{-1}``.

Sensitivity. Column ``j`` of ``C`` is non-zero in rows ``j .. j+b-1`` only, so two participations ``b`` or more steps
apart touch disjoint rows: ``||C G||_F^2`` is the sum over the participations of (column norm)^2 times the
gradient's squared norm, whatever the gradients' directions. With ``sum c_k^2 = 1`` (our normalization) a
participation costs 1, as in DP-SGD; ``k`` participations at least ``m >= b`` steps apart cost
``sum_{i<k} ||C e_{i m}||^2`` at most (columns near the end are truncated, so norms only fall with ``j``: the pattern
``0, m, 2m, ...`` is the worst). This is :meth:`BandedToeplitzStrategy.sensitivity`.

The strategy minimizes (max column norm)^2 ``* ||A C^{-1}||_F^2`` (the workload's expected squared error per unit of
``sigma^2 C_clip^2``) over ``c_1 .. c_{b-1}`` with ``c_0 = 1`` (the objective does not change with the scale), by
L-BFGS on exact float64 gradients (:mod:`.workload`), from the coefficients of the square root of the workload's
series (for prefix sums ``C = A^{1/2}``, Fichtenberger, Henzinger & Upadhyay 2022, optimal for the max error at
``b = n``; jax_privacy's ``optimize_banded_toeplitz`` starts from the same coefficients). The best of that start, the
optimum and DP-SGD (``C = I``) among those whose recursion is stable is kept, so ``error <= dpsgd_error`` always.

Verified against jax_privacy (google-deepmind/jax_privacy, commit 8967688, read to learn, no code taken):
``jax_privacy/matrix_factorization/toeplitz.py: optimize_banded_toeplitz`` (prefix workload, coefficients returned
with L2 norm 1, valid for any participation pattern whose separation is at least the number of bands) and
``jax_privacy/matrix_factorization/sensitivity.py: get_sensitivity_banded_for_X`` (columns more than ``min_sep``
apart are orthogonal, so the sensitivity is a sum of column norms).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy import optimize

from .workload import ErrorTerm, dense_schedule_error, impulse_response, series_gradient, toeplitz_error

__all__ = ["MAX_SCHEDULE_STEPS", "BandedToeplitzStrategy", "banded_sensitivity", "optimize_banded_toeplitz"]

#: A learning-rate schedule makes the workload dense (``O(n^2)`` per evaluation): refused above this many steps.
MAX_SCHEDULE_STEPS = 4096
_MAX_ITERATIONS = 500


@dataclass(frozen=True)
class BandedToeplitzStrategy:
    """A lower-triangular banded Toeplitz ``C`` with ``sum c_k^2 = 1`` (one participation costs sensitivity 1).

    Args:
        coefficients (`tuple[float, ...]`): ``c_0 .. c_{b-1}``, ``c_0 > 0``, unit L2 norm.
        steps (`int`): the number of steps ``n`` the coefficients were optimized for.
        workload (`str`): what was optimized, e.g. ``"prefix-sum"`` or ``"momentum 0.9, learning-rate schedule"``.
        error (`float`): RMSE of the workload's noise per step in units of ``sigma * C_clip``,
            ``sqrt(||A C^{-1}||_F^2 / n)``.
        dpsgd_error (`float`): the same for ``C = I`` (DP-SGD's noise on the same workload).

    Example:
        ```python
        >>> s = optimize_banded_toeplitz(1000, 8)
        >>> s.bands, s.error < s.dpsgd_error
        (8, True)
        ```
    """

    coefficients: tuple[float, ...]
    steps: int
    workload: str
    error: float
    dpsgd_error: float

    def __post_init__(self) -> None:
        coefficients = np.asarray(self.coefficients, dtype=np.float64)
        if coefficients.ndim != 1 or coefficients.size == 0 or not np.all(np.isfinite(coefficients)):
            raise ValueError(f"`coefficients` must be a non-empty sequence of finite numbers, got {self.coefficients}.")
        if coefficients[0] <= 0 or abs(float(coefficients @ coefficients) - 1.0) > 1e-9:
            raise ValueError(
                "`coefficients` must have c_0 > 0 and unit L2 norm (sensitivity 1 per participation), got "
                f"c_0={coefficients[0]:g}, norm^2={float(coefficients @ coefficients):.12g}."
            )
        if not _stable(coefficients):
            raise ValueError(
                "`coefficients` have a root of sum c_k x^k in the closed unit disc: the "
                "noise recursion w_t = (z_t - sum_j c_j w_{t-j}) / c_0 would grow without bound in floating point. "
                "Use coefficients from `optimize_banded_toeplitz` (their roots lie outside the unit circle)."
            )
        if self.steps < coefficients.size:
            raise ValueError(f"`steps`={self.steps} must be at least the number of bands {coefficients.size}.")

    @property
    def bands(self) -> int:
        """``b``, the number of non-zero diagonals of ``C``."""
        return len(self.coefficients)

    def sensitivity(self, participations: int = 1, min_separation: int | None = None) -> float:
        """L2 sensitivity of ``C G`` (clip norm 1) when a unit takes part ``participations`` times, each two at least
        ``min_separation`` (default ``b``) steps apart, without amplification. See :func:`banded_sensitivity`."""
        return banded_sensitivity(self.coefficients, self.steps, participations, min_separation)


def banded_sensitivity(
    coefficients: Sequence[float], steps: int, participations: int = 1, min_separation: int | None = None
) -> float:
    """The exact L2 sensitivity of ``C G`` for the ``steps x steps`` banded Toeplitz ``C`` of ``coefficients``, over
    every participation pattern with at most ``participations`` steps, each two at least ``min_separation`` apart.

    Columns ``min_separation >= b`` apart are orthogonal, so the squared sensitivity is the largest sum of squared
    column norms over the patterns; norms fall towards the end (truncated columns), so the pattern
    ``0, m, 2m, ...`` attains it. At most ``ceil(steps / m)`` participations fit.

    Raises:
        ValueError: for ``min_separation < b`` (columns then overlap and the bound needs the signs of the overlaps:
            not provided), or a count below 1.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    bands = c.shape[0]
    separation = bands if min_separation is None else int(min_separation)
    if separation < bands:
        raise ValueError(
            f"`min_separation`={separation} is below the number of bands {bands}: participations would share rows of "
            "C and the sensitivity is not the sum of column norms. Use at most `min_separation` bands."
        )
    if participations < 1 or steps < 1:
        raise ValueError(f"`participations` and `steps` must be >= 1, got {participations} and {steps}.")
    count = min(int(participations), -(-int(steps) // separation))
    total = 0.0
    for i in range(count):
        rows = min(bands, steps - i * separation)  # column j = i m keeps rows j .. min(j + b, n) - 1
        total += float(np.sum(c[:rows] ** 2))
    return math.sqrt(total)


def optimize_banded_toeplitz(
    steps: int, bands: int, *, momentum: float = 0.0, learning_rates: Sequence[float] | None = None
) -> BandedToeplitzStrategy:
    """The ``bands``-banded Toeplitz strategy that minimizes the expected squared error of the run's workload.

    Args:
        steps (`int`): ``n``, the number of noisy steps of the run.
        bands (`int`): ``b``, 1 <= b <= steps (``b = 1`` is DP-SGD: coefficients ``(1.0,)``).
        momentum (`float`, *optional*, defaults to 0.0): SGD's momentum ``beta`` in ``[0, 1)`` (``dampening=0``).
        learning_rates (`Sequence[float]`, *optional*): the learning rate of each of the ``n`` steps; `None` or a
            constant sequence is the Toeplitz workload (any ``n``); a schedule is dense, at most
            ``MAX_SCHEDULE_STEPS`` steps.

    Returns:
        `BandedToeplitzStrategy`: the same object for the same arguments within a process (cached). Deterministic.

    Raises:
        ValueError: for arguments out of range, or a schedule longer than ``MAX_SCHEDULE_STEPS``.
    """
    rates = None if learning_rates is None else tuple(float(r) for r in learning_rates)
    _check_arguments(int(steps), int(bands), float(momentum), rates)
    if rates is not None and len(set(rates)) == 1:
        rates = None  # a constant rate scales A: the same optimum
    return _optimize(int(steps), int(bands), float(momentum), rates)


def _check_arguments(steps: int, bands: int, momentum: float, rates: tuple[float, ...] | None) -> None:
    if steps < 1 or not 1 <= bands <= steps:
        raise ValueError(f"`bands` must be in [1, steps] and `steps` >= 1, got bands={bands}, steps={steps}.")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"`momentum` must be in [0, 1), got {momentum}.")
    if rates is None:
        return
    if len(rates) != steps or not all(math.isfinite(r) and r > 0 for r in rates):
        raise ValueError(f"`learning_rates` must hold {steps} finite positive numbers (one a step), got {len(rates)}.")
    if len(set(rates)) > 1 and steps > MAX_SCHEDULE_STEPS:
        raise ValueError(
            f"Optimizing for a learning-rate schedule over {steps} steps needs a dense {steps}x{steps} workload "
            f"(limit {MAX_SCHEDULE_STEPS} steps). Pass `learning_rates=None` to optimize for a constant rate: the "
            "noise is exactly as private, only tuned for the constant-rate workload."
        )


def _workload(steps: int, momentum: float, rates: tuple[float, ...] | None) -> tuple[np.ndarray, ErrorTerm, str]:
    """``(den, error term, name)``: the workload's error is ``term(1 / (den * c))``."""
    momentum_den = np.array([1.0, -momentum]) if momentum else np.array([1.0])
    name = f"momentum {momentum:g}, " if momentum else ""
    if rates is None:
        return np.convolve(momentum_den, [1.0, -1.0]), toeplitz_error, f"{name}prefix-sum" if name else "prefix-sum"
    return momentum_den, dense_schedule_error(rates), f"{name}learning-rate schedule"


def _sqrt_series(bands: int, momentum: float) -> np.ndarray:
    """The first ``bands`` coefficients of ``((1 - x)(1 - beta x))^{-1/2}``."""
    k = np.arange(bands, dtype=np.float64)
    half = np.exp(np.cumsum(np.log(np.maximum(2 * k - 1, 1) / np.maximum(2 * k, 1))))  # binom(2k, k) / 4^k
    return np.convolve(half, half * momentum**k)[:bands]


def _stable(coefficients: np.ndarray) -> bool:
    """Whether every root of ``sum c_k x^k`` lies outside the closed unit disc (no root: ``C`` diagonal)."""
    roots = np.roots(coefficients[::-1]) if coefficients.size > 1 else np.array([])
    return not roots.size or float(np.min(np.abs(roots))) > 1.0


@lru_cache(maxsize=64)
def _optimize(steps: int, bands: int, momentum: float, rates: tuple[float, ...] | None) -> BandedToeplitzStrategy:
    den, term, name = _workload(steps, momentum, rates)
    baseline = term(impulse_response(den, steps))[0]

    def objective(free: np.ndarray) -> tuple[float, np.ndarray]:
        c = np.concatenate([[1.0], free])
        polynomial = np.convolve(den, c)
        series = impulse_response(polynomial, steps)
        error, grad_series = term(series)
        if not np.isfinite(error):
            return math.inf, np.zeros_like(free)
        grad_poly = series_gradient(polynomial, series, grad_series)
        grad_c = np.array([grad_poly[i : i + den.size] @ den for i in range(bands)])
        norm = float(c @ c)
        return norm * error / baseline, (2.0 * c * error + norm * grad_c)[1:] / baseline

    candidates = [np.zeros(bands - 1), _sqrt_series(bands, momentum)[1:]]
    if bands > 1:
        result = optimize.minimize(
            objective,
            candidates[1],
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": _MAX_ITERATIONS, "ftol": 1e-15, "gtol": 1e-12},
        )
        candidates.append(np.asarray(result.x))
    stable = [free for free in candidates if _stable(np.concatenate([[1.0], free]))]  # C^{-1}'s recursion decays
    loss, best = min(((objective(free)[0], free) for free in stable), key=lambda scored: scored[0])
    c = np.concatenate([[1.0], best])
    return BandedToeplitzStrategy(
        coefficients=tuple(float(v) for v in c / math.sqrt(float(c @ c))),
        steps=steps,
        workload=name,
        error=math.sqrt(loss * baseline / steps),
        dpsgd_error=math.sqrt(baseline / steps),
    )
