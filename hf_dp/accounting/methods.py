"""The accountants by name: each maps a history of ``(noise_multiplier, sample_rate, steps)`` segments and a
``delta`` to an epsilon. An invalid name's error lists this registry's keys.

``PROVEN_ACCOUNTANTS`` are those whose epsilon is a proven upper bound ("rdp"; "prv", the upper end of the numerical
composition): only they may calibrate the noise or give the headline epsilon. "gdp" (central limit theorem) is an
estimate that can be below the true epsilon; it is kept for logging and comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .analysis.gdp import clt_mu, gdp_epsilon
from .analysis.prv import prv_epsilon
from .analysis.rdp import rdp_to_epsilon, subsampled_gaussian_rdp

__all__ = [
    "ACCOUNTANTS",
    "PROVEN_ACCOUNTANTS",
    "Segment",
    "check_accountant",
    "check_proven_accountant",
    "segments_epsilon",
]

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


#: name -> epsilon(segments, delta). Every accountant, including the "gdp" estimate (for logs).
ACCOUNTANTS: dict[str, Callable[[Sequence[Segment], float], float]] = {"rdp": _rdp, "gdp": _gdp, "prv": prv_epsilon}

#: Accountants whose epsilon is a proven upper bound, in the order they are reported (tightest first).
PROVEN_ACCOUNTANTS: tuple[str, ...] = ("prv", "rdp")


def check_accountant(name: str) -> None:
    """Raise `ValueError` unless ``name`` is a key of :data:`ACCOUNTANTS`."""
    if name not in ACCOUNTANTS:
        raise ValueError(f"Unknown accountant {name!r}. Choose one of {sorted(ACCOUNTANTS)} (`accountant`).")


def check_proven_accountant(name: str) -> None:
    """Raise `ValueError` unless ``name`` gives a proven upper bound on epsilon (see :data:`PROVEN_ACCOUNTANTS`).

    Used wherever an accountant calibrates the noise or gives the headline epsilon.

    Raises:
        ValueError: for an unknown name, or for "gdp", whose central-limit estimate can be below the true epsilon.

    Example:
        ```python
        >>> check_proven_accountant("prv")
        >>> check_proven_accountant("gdp")  # ValueError
        ```
    """
    check_accountant(name)
    if name not in PROVEN_ACCOUNTANTS:
        raise ValueError(
            f"`accountant={name!r}` cannot calibrate the noise or give the headline epsilon: GDP is a central-limit "
            "estimate that can under-estimate epsilon (e.g. sigma calibrated to epsilon 3 by GDP at q=0.01, 1000 "
            f"steps, delta=1e-5 has a proven epsilon near 3.9), not a bound. Use one of {list(PROVEN_ACCOUNTANTS)} "
            '(`accountant="prv"` or `accountant="rdp"`); GDP can still be logged as an estimate.'
        )


def segments_epsilon(segments: Sequence[Segment], delta: float, accountant: str) -> float:
    """Epsilon of a composition of segments; ``inf`` as soon as one segment with steps has ``sigma = 0``."""
    check_accountant(accountant)
    active = [(float(s), float(q), int(n)) for s, q, n in segments if n > 0 and q > 0]
    if not active:
        return 0.0
    if any(s == 0 for s, _, _ in active):
        return math.inf
    return float(ACCOUNTANTS[accountant](active, delta))
