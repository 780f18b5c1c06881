"""Gaussian DP by the central limit theorem (Bu, Dong, Long & Su 2020; Dong, Roth & Su 2022).

After ``S`` steps of the Poisson-subsampled Gaussian mechanism, the composition is approximately ``mu``-GDP with
``mu = q sqrt(S (exp(1 / sigma^2) - 1))``; ``mu``-GDP gives
``delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)``, which is solved for ``eps``.

This is an approximation, not a bound: for small ``S`` or large ``q`` it can underestimate epsilon
(Gopi, Lee & Wutschitz 2021 show cases). Use it for comparison, not for a guarantee.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from scipy import optimize, special, stats

__all__ = ["clt_mu", "gdp_delta", "gdp_epsilon"]


def clt_mu(segments: Sequence[tuple[float, float, int]]) -> float:
    """``mu`` of the composition of ``(noise_multiplier, sample_rate, steps)`` segments (mu^2 adds up)."""
    total = 0.0
    for sigma, q, steps in segments:
        if steps == 0:
            continue
        if sigma == 0 or 1 / sigma**2 > 700:  # exp overflows: no privacy worth the name
            return math.inf
        total += q**2 * steps * math.expm1(1 / sigma**2)
    return math.sqrt(total)


def gdp_delta(mu: float, eps: float) -> float:
    """``delta`` of a ``mu``-GDP mechanism at ``eps``."""
    # e^eps Phi(x) in log space: e^eps overflows long before the product does.
    return float(stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps + special.log_ndtr(-eps / mu - mu / 2)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """Smallest ``eps`` with ``delta(eps) <= delta`` for a ``mu``-GDP mechanism."""
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gdp_delta(mu, 0.0) <= delta:
        return 0.0
    high = 1.0
    while gdp_delta(mu, high) > delta:
        high *= 2
        if high > 1e6:
            return math.inf
    return float(optimize.brentq(lambda e: gdp_delta(mu, e) - delta, 0.0, high, xtol=1e-12, rtol=1e-12))
