"""Rényi DP of the Poisson-subsampled Gaussian mechanism and its conversion to (epsilon, delta).

* RDP of one step at order ``a`` (Mironov, Talwar & Zhang 2019, "Rényi DP of the Sampled Gaussian Mechanism"):
  ``rdp(a) = log(A_a) / (a - 1)`` with ``A_a = E_{z ~ mu_0}[(mu(z) / mu_0(z))^a]`` and
  ``mu = (1 - q) mu_0 + q mu_1``. For integer ``a`` the binomial expansion is finite (sec. 3.3); for fractional ``a``
  the two-sided series with Gaussian tail terms (sec. 3.4) converges quickly. With ``q = 1`` it is ``a / (2 sigma^2)``.
* RDP composes additively over steps and over segments with different ``(sigma, q)``.
* Conversion (Balle et al. 2020, Thm. 21; Canonne, Kamath & Steinke 2020, Prop. 12):
  ``eps = rdp(a) + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1)``, minimised over the orders.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from scipy import special

__all__ = ["DEFAULT_ORDERS", "rdp_to_epsilon", "subsampled_gaussian_rdp"]

#: The orders of Opacus and dp-accounting (1.1 ... 10.9, 11 ... 63, and large orders for tiny deltas).
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    sorted({1 + x / 10 for x in range(1, 100)} | set(range(11, 64)) | {80, 96, 128, 192, 256, 384, 512, 1024})
)


def _log_add(x: float, y: float) -> float:
    return float(np.logaddexp(x, y))


def _log_sub(x: float, y: float) -> float:
    """``log(e^x - e^y)`` for ``x >= y``."""
    if y == -math.inf:
        return x
    if x <= y:
        return -math.inf
    return x + math.log(-math.expm1(y - x))


def _log_a_integer(q: float, sigma: float, order: int) -> float:
    """``log A_a`` for integer ``a``: ``A_a = sum_k C(a, k) q^k (1-q)^(a-k) exp((k^2 - k) / (2 sigma^2))``."""
    k = np.arange(order + 1, dtype=np.float64)
    log_binom = special.gammaln(order + 1) - special.gammaln(k + 1) - special.gammaln(order - k + 1)
    terms = log_binom + k * math.log(q) + (order - k) * math.log1p(-q) + (k * k - k) / (2 * sigma**2)
    return float(special.logsumexp(terms))


def _log_a_fractional(q: float, sigma: float, order: float) -> float:
    """``log A_a`` for fractional ``a``: the series of Mironov et al. (2019, sec. 3.4), split at
    ``z0 = sigma^2 log(1/q - 1) + 1/2`` into two sums whose Gaussian tail factors make the terms vanish."""
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    pos, neg = [-math.inf, -math.inf], [-math.inf, -math.inf]
    i = 0
    while True:
        binom = special.binom(order, i)
        log_binom = math.log(abs(binom))
        j = order - i
        first = (
            log_binom
            + i * math.log(q)
            + j * math.log1p(-q)
            + (i * i - i) / (2 * sigma**2)
            + math.log(0.5)
            + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        )
        second = (
            log_binom
            + j * math.log(q)
            + i * math.log1p(-q)
            + (j * j - j) / (2 * sigma**2)
            + math.log(0.5)
            + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        )
        target = pos if binom > 0 else neg
        target[0] = _log_add(target[0], first)
        target[1] = _log_add(target[1], second)
        i += 1
        if max(first, second) < -30 and i > order:
            break
    return _log_add(_log_sub(pos[0], neg[0]), _log_sub(pos[1], neg[1]))


def _log_erfc(x: float) -> float:
    return float(special.log_ndtr(-x * math.sqrt(2))) + math.log(2)


@lru_cache(maxsize=4096)
def _rdp_one_step(q: float, sigma: float, order: float) -> float:
    if q == 1.0:
        return order / (2 * sigma**2)
    if float(order).is_integer():
        log_a = _log_a_integer(q, sigma, int(order))
    else:
        log_a = _log_a_fractional(q, sigma, float(order))
    return log_a / (order - 1)


def subsampled_gaussian_rdp(
    *, noise_multiplier: float, sample_rate: float, steps: int, orders: Sequence[float] = DEFAULT_ORDERS
) -> np.ndarray:
    """RDP at each order after ``steps`` steps of the Poisson-subsampled Gaussian mechanism."""
    if steps == 0 or sample_rate == 0:
        return np.zeros(len(orders))
    if noise_multiplier == 0:
        return np.full(len(orders), np.inf)
    one = np.array([_rdp_one_step(float(sample_rate), float(noise_multiplier), float(a)) for a in orders])
    return one * steps


def rdp_to_epsilon(rdp: np.ndarray, delta: float, orders: Sequence[float] = DEFAULT_ORDERS) -> tuple[float, float]:
    """``(epsilon, best order)`` from RDP values, by the improved conversion."""
    orders_arr = np.asarray(orders, dtype=np.float64)
    rdp = np.asarray(rdp, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = rdp + np.log1p(-1 / orders_arr) - (math.log(delta) + np.log(orders_arr)) / (orders_arr - 1)
    # Where even the KL bound gives delta (delta^2 + expm1(-rdp) > 0), epsilon 0 suffices.
    eps = np.where(delta**2 + np.expm1(-rdp) > 0, 0.0, eps)
    eps = np.where(np.isnan(eps), np.inf, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), float(orders_arr[best])
