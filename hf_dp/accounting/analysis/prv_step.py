"""One step of the Poisson-subsampled Gaussian mechanism as a pessimistic connect-the-dots PMF: its hockey-stick
curve in closed form, without cancellation, and Algorithm 1 of Doroshenko, Ghazi, Kamath, Kumar & Manurangsi (2022).
Used by :mod:`.prv`, which composes the PMFs."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["connect_the_dots", "step_hockey_stick"]


def _log_t(u: np.ndarray, q: float) -> np.ndarray:
    """``log(e^u - (1 - q))`` for ``e^u > 1 - q``: through ``expm1`` (exact near ``u = 0``) unless it overflows."""
    big = u > 700
    out = np.empty_like(u)
    with np.errstate(divide="ignore"):  # -inf exactly at the boundary e^u = 1 - q: t = 0, a limit the formulas take
        out[~big] = np.log(np.expm1(u[~big]) + q)
    out[big] = u[big] + np.log1p(-(1 - q) * np.exp(-u[big]))
    return out


def step_hockey_stick(sigma: float, q: float, epsilons: np.ndarray, direction: str) -> tuple[np.ndarray, np.ndarray]:
    """``delta(eps)`` of one step of the Poisson-subsampled Gaussian mechanism (sensitivity 1), in closed form, and its
    excess over ``1 - e^eps``.

    ``delta`` is dp-accounting's ``GaussianPrivacyLoss.get_delta_for_epsilon``, written without subtracting two terms
    close to 1. The connect-the-dots PMF takes second differences of these values over the grid, which turns absolute
    errors of ``1e-16`` into mass errors of ``1e-16 / h`` per point; and for ``eps < 0``, where ``delta`` is close to
    ``1 - e^eps``, only the excess ``g = delta - (1 - e^eps)`` (small and accurate) matters, because ``1 - e^eps`` has
    zero second differences in the connect-the-dots formula. With ``x`` the point where the privacy loss equals
    ``eps``, ``Phi`` the normal CDF and ``Psi = 1 - Phi``:

    * remove (``P = (1-q) N(0, s^2) + q N(-1, s^2)``, ``Q = N(0, s^2)``): ``t = e^eps - (1 - q)``,
      ``x = -s^2 log(t / q) - 1/2``, ``delta = q Phi((x + 1) / s) - t Phi(x / s)``,
      ``g = t Psi(x / s) - q Psi((x + 1) / s)``; ``delta = 1 - e^eps``, ``g = 0`` when ``t <= 0``.
    * add (``P = N(0, s^2)``, ``Q = (1-q) N(0, s^2) + q N(1, s^2)``): ``t = e^-eps - (1 - q)``,
      ``x = s^2 log(t / q) + 1/2``, ``delta = e^eps (t Phi(x / s) - q Phi((x - 1) / s))``,
      ``g = e^eps (q Psi((x - 1) / s) - t Psi(x / s))``; ``delta = 0`` when ``t <= 0``.

    Returns:
        `tuple[np.ndarray, np.ndarray]`: ``(delta, g)`` at each epsilon; ``g`` only where ``eps <= 0`` (0 elsewhere).
    """
    from scipy.special import log_ndtr, ndtr

    epsilons = np.asarray(epsilons, dtype=np.float64)
    delta, excess = np.zeros_like(epsilons), np.zeros_like(epsilons)
    # Products t * Phi(z) go through logs: t overflows for large |eps| (tiny sigma) while Phi(z) underflows.
    if direction == "remove":
        inside = epsilons > math.log1p(-q) if q < 1 else np.ones_like(epsilons, dtype=bool)
        eps = epsilons[inside]
        log_t = _log_t(eps, q)
        x = -(sigma**2) * (log_t - math.log(q)) - 0.5
        delta[inside] = q * ndtr((x + 1) / sigma) - np.exp(log_t + log_ndtr(x / sigma))
        low = eps <= 0  # the excess is only used at eps <= 0 (see connect_the_dots)
        excess[np.flatnonzero(inside)[low]] = np.exp(log_t[low] + log_ndtr(-x[low] / sigma)) - q * ndtr(
            -(x[low] + 1) / sigma
        )
        delta[~inside] = -np.expm1(epsilons[~inside])
    else:
        inside = epsilons < -math.log1p(-q) if q < 1 else np.ones_like(epsilons, dtype=bool)
        eps = epsilons[inside]
        log_t = _log_t(-eps, q)
        x = sigma**2 * (log_t - math.log(q)) + 0.5
        delta[inside] = np.exp(eps + log_t + log_ndtr(x / sigma)) - q * np.exp(eps + log_ndtr((x - 1) / sigma))
        low = eps <= 0
        excess[np.flatnonzero(inside)[low]] = q * np.exp(eps[low] + log_ndtr(-(x[low] - 1) / sigma)) - np.exp(
            eps[low] + log_t[low] + log_ndtr(-x[low] / sigma)
        )
    return np.clip(delta, 0.0, 1.0), excess


def connect_the_dots(interval: float, lower: int, delta: np.ndarray, excess: np.ndarray) -> tuple[np.ndarray, float]:
    """Pessimistic connect-the-dots PMF (Doroshenko et al. 2022, Algorithm 1; dp-accounting's
    ``create_pmf_pessimistic_connect_dots_fixed_gap``) on the losses ``(lower + i) * interval``.

    With ``d = interval`` and ``C(v)_i = ((v[i+1] - v[i]) - e^d (v[i] - v[i-1])) / (e^d - 1)``, the interior masses are
    ``C(delta)``. ``C(1 - e^eps) = 0``, so where the stencil lies at ``eps <= 0`` we use ``C(g)`` (same value, no
    cancellation); likewise the first mass ``1 - delta_1 + (delta_2 - delta_1) / (e^d - 1)`` equals
    ``(g_2 - g_1) / (e^d - 1) - g_1``. Rounding noise that makes a mass negative is clipped to 0 (more mass, which only
    raises delta).

    Returns:
        `tuple[np.ndarray, float]`: the masses, and the mass at infinite loss (``delta`` at the last point).
    """
    grow = math.expm1(interval)
    losses = (lower + np.arange(len(delta))) * interval
    probs = np.empty_like(delta)
    low = losses[1:-1] + interval <= 0  # stencils i-1, i, i+1 all at eps <= 0
    d_delta, d_excess = np.diff(delta), np.diff(excess)
    probs[1:-1] = np.where(
        low,
        (d_excess[1:] - d_excess[:-1] * math.exp(interval)) / grow,
        (d_delta[1:] - d_delta[:-1] * math.exp(interval)) / grow,
    )
    if losses[1] <= 0:
        probs[0] = d_excess[0] / grow - excess[0]
    else:
        probs[0] = 1 - delta[0] + d_delta[0] / grow
    probs[-1] = d_delta[-1] / math.expm1(-interval)
    return np.maximum(probs, 0.0), float(delta[-1])
