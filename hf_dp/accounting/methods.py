"""The accountants by name: each maps a history of ``(noise_multiplier, sample_rate, steps)`` segments and a
``delta`` to an epsilon. An invalid name's error lists this registry's keys."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .analysis.gdp import clt_mu, gdp_epsilon
from .analysis.prv import prv_epsilon_bounds
from .analysis.rdp import rdp_to_epsilon, subsampled_gaussian_rdp

__all__ = ["ACCOUNTANTS", "Segment", "check_accountant", "segments_epsilon"]

Segment = tuple[float, float, int]


def _rdp(segments: Sequence[Segment], delta: float) -> float:
    total = 0.0
    for sigma, q, steps in segments:
        total = total + subsampled_gaussian_rdp(noise_multiplier=sigma, sample_rate=q, steps=steps)
    if isinstance(total, float):
        return 0.0
    return rdp_to_epsilon(total, delta)[0]


def _gdp(segments: Sequence[Segment], delta: float) -> float:
    return gdp_epsilon(clt_mu(segments), delta)


def _prv(segments: Sequence[Segment], delta: float) -> float:
    return prv_epsilon_bounds(segments, delta)[2]  # the upper bound


#: name -> epsilon(segments, delta)
ACCOUNTANTS: dict[str, Callable[[Sequence[Segment], float], float]] = {"rdp": _rdp, "gdp": _gdp, "prv": _prv}


def check_accountant(name: str) -> None:
    if name not in ACCOUNTANTS:
        raise ValueError(f"Unknown accountant {name!r}. Choose one of {sorted(ACCOUNTANTS)} (`accountant`).")


def segments_epsilon(segments: Sequence[Segment], delta: float, accountant: str) -> float:
    """Epsilon of a composition of segments; ``inf`` as soon as one segment with steps has ``sigma = 0``."""
    check_accountant(accountant)
    active = [(float(s), float(q), int(n)) for s, q, n in segments if n > 0 and q > 0]
    if not active:
        return 0.0
    if any(s == 0 for s, _, _ in active):
        return math.inf
    return float(ACCOUNTANTS[accountant](active, delta))
