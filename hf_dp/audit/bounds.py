"""The one-run lower bound on epsilon (Steinke, Nasr and Jagielski 2023, "Privacy Auditing with One (1) Training
Run", NeurIPS; arXiv:2305.08846).

Each of ``m`` canaries is included in training independently with probability 1/2. An auditor looks at the trained
model and guesses "in" or "out" for ``r`` of them (abstaining on the rest); ``v`` guesses are right. If training is
(epsilon, delta)-DP, the number of right guesses is stochastically dominated by ``Binomial(r, q)`` with
``q = e^eps / (1 + e^eps)`` (the accuracy of epsilon-randomised response), up to a delta term. For approximate DP
the paper's p-value is (as in the computation published with the paper; the delta term agrees with jax_privacy's
``auditing._one_run_p_value``):

    beta  = P[Binomial(r, q) >= v]
    alpha = max_{i = 1..v} P[v - i <= Binomial(r, q) < v] / i
    p     = min(1, beta + 2 m delta alpha)

is a p-value for the hypothesis "training is (eps, delta)-DP". The lower bound is the largest eps that this p-value
rejects at the chosen significance. The p-value grows with eps (checked numerically over random (m, r, v, delta));
the bisection would stay valid even where it did not, since every eps it reports is one the p-value rejects, and a
run that is eps*-DP is also eps-DP for every eps >= eps*.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import special, stats

__all__ = ["epsilon_lower_bound", "one_run_p_value"]

#: Bisection stops when the bracket is this narrow (in epsilon).
EPS_TOLERANCE = 1e-6
#: Above this, q = e^eps / (1 + e^eps) is 1 in float64: every guess right is certain, so nothing is rejected.
EPS_MAX = 40.0


def _check_counts(m: int, r: int, v: int) -> None:
    for name, value in (("m", m), ("r", r), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"`{name}` must be an integer count, got {type(value).__name__}")
    if not 0 <= v <= r <= m:
        raise ValueError(
            f"Counts must satisfy 0 <= v <= r <= m (v right guesses out of r guesses on m canaries), got m={m}, "
            f"r={r}, v={v}."
        )
    if m < 1:
        raise ValueError(f"`m` (the number of canaries) must be at least 1, got {m}.")


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float, np.floating)) and 0 <= delta <= 1):
        raise ValueError(f"`delta` must be a number in [0, 1], got {delta!r}. Pass the delta of the DP claim.")


def one_run_p_value(m: int, r: int, v: int, *, epsilon: float, delta: float) -> float:
    """P-value of observing ``v`` or more right guesses out of ``r`` if training were (epsilon, delta)-DP.

    Args:
        m (`int`): number of canaries (each included independently with probability 1/2).
        r (`int`): number of guesses (canaries not abstained on).
        v (`int`): number of right guesses.
        epsilon (`float`): epsilon of the hypothesis, >= 0.
        delta (`float`): delta of the hypothesis, in [0, 1].

    Returns:
        `float`: ``min(1, beta + 2 m delta alpha)`` (see the module docstring), in [0, 1].

    Raises:
        ValueError: if the counts are not ``0 <= v <= r <= m``, or ``epsilon < 0``, or ``delta`` is outside [0, 1].

    Example:
        ```python
        >>> one_run_p_value(1000, 100, 100, epsilon=0.0, delta=0.0)  # 100 of 100 right at eps = 0: 2^-100
        7.888609052210118e-31
        ```
    """
    _check_counts(m, r, v)
    _check_delta(delta)
    if not (isinstance(epsilon, (int, float, np.floating)) and epsilon >= 0 and not math.isnan(epsilon)):
        raise ValueError(f"`epsilon` must be a number >= 0, got {epsilon!r}.")
    return _p_value(m, r, v, float(epsilon), float(delta))


def _p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    if v == 0:
        return 1.0  # zero right guesses is always observed
    q = float(special.expit(epsilon))  # e^eps / (1 + e^eps), without overflow
    # P[B >= v] from the regularised incomplete beta function: accurate in the far tail (no 1 - cdf cancellation).
    beta = float(stats.binom.sf(v - 1, r, q))
    if delta == 0:
        return min(1.0, beta)
    # P[v - i <= B < v] = sum_{j=1..i} P[B = v - j]: a cumulative sum of non-negative pmf terms, so no cancellation.
    i = np.arange(1, v + 1)
    cumulative = np.cumsum(stats.binom.pmf(v - i, r, q))
    alpha = float(np.max(cumulative / i))
    return min(1.0, beta + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, significance: float = 0.05) -> float:
    """The largest epsilon that ``v`` right guesses out of ``r`` on ``m`` canaries reject at ``significance``.

    With probability at least ``1 - significance`` (over the canaries' inclusion), a training run that is
    (epsilon, delta)-DP gives a bound at most epsilon. A bound above the claimed epsilon means the claim is false
    (or the run was unlucky, with probability at most ``significance``).

    The p-value is computed in float64 with scipy's binomial tail (incomplete beta) and pmf; epsilon is found by
    bisection, keeping ``p(lo) < significance <= p(hi)``. The bracket's low end is returned: its p-value is below the
    level, so the bound never claims more than the data reject.

    Args:
        m (`int`): number of canaries (each included independently with probability 1/2).
        r (`int`): number of guesses (canaries not abstained on).
        v (`int`): number of right guesses.
        delta (`float`): delta of the DP claim under test, in [0, 1].
        significance (`float`, *optional*, defaults to 0.05): the level of the test, in (0, 1).

    Returns:
        `float`: the lower bound, >= 0; ``0.0`` when even epsilon = 0 cannot be rejected (e.g. guesses at chance).

    Raises:
        ValueError: if the counts are not ``0 <= v <= r <= m``, or ``delta`` or ``significance`` is out of range.

    Example:
        ```python
        >>> from hf_dp.audit import epsilon_lower_bound
        >>> round(epsilon_lower_bound(1000, 100, 100, delta=0.0), 3)  # 100 of 100 right: q^100 = 0.05
        3.493
        >>> epsilon_lower_bound(1000, 100, 50, delta=1e-5)  # at chance
        0.0
        ```
    """
    _check_counts(m, r, v)
    _check_delta(delta)
    if not (isinstance(significance, (int, float, np.floating)) and 0 < significance < 1):
        raise ValueError(f"`significance` must be in (0, 1), got {significance!r} (0.05 is the usual level).")
    delta = float(delta)

    def rejected(eps: float) -> bool:
        return _p_value(m, r, v, eps, delta) < significance

    return _largest_rejected(rejected)


def _largest_rejected(rejected: Callable[[float], bool]) -> float:
    """The largest epsilon that ``rejected`` holds for (true up to some epsilon, false above), by doubling and then
    bisection to :data:`EPS_TOLERANCE`: the bracket's low end, where it holds; 0 where it does not hold at 0,
    :data:`EPS_MAX` where it still holds there."""
    # p >= beta, and beta is the delta = 0 p-value: if even that is not rejected at eps = 0, nothing is.
    if not rejected(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while rejected(hi):
        lo, hi = hi, 2.0 * hi
        if hi > EPS_MAX:  # q == 1.0: beta = P[B >= v] = 1, never rejected; unreachable for v <= r.
            hi = EPS_MAX
            if rejected(hi):
                return EPS_MAX
            break
    while hi - lo > EPS_TOLERANCE:
        mid = 0.5 * (lo + hi)
        if rejected(mid):
            lo = mid
        else:
            hi = mid
    return lo
