"""Stateless entry points: epsilon of a run, and the noise multiplier that reaches a target epsilon."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .methods import Segment, check_accountant, check_proven_accountant, segments_epsilon
from .validation import (
    check_delta,
    check_noise_multiplier,
    check_sample_rate,
    check_segments,
    check_steps,
    check_target_epsilon,
)

__all__ = ["CALIBRATION_RTOL", "MAX_NOISE_MULTIPLIER", "epsilon", "noise_multiplier"]

#: Calibration gives up above this noise multiplier.
MAX_NOISE_MULTIPLIER = 1e4
#: Calibration stops when the bracket is this tight (relative); the result is the upper end.
CALIBRATION_RTOL = 1e-3


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp") -> float:
    """Epsilon after ``steps`` steps of DP-SGD with Poisson sampling.

    Args:
        noise_multiplier (`float`): sigma, the noise std divided by the clipping norm (0 means no privacy).
        sample_rate (`float`): q, the probability that an example is in a logical batch.
        steps (`int`): number of noisy updates.
        delta (`float`): target delta.
        accountant (`str`, *optional*, defaults to `"rdp"`): `"rdp"` or `"prv"` (proven upper bounds), or `"gdp"` (a
            central-limit estimate, which can be below the true epsilon).

    Returns:
        `float`: epsilon (`math.inf` for sigma = 0 and steps > 0).

    Raises:
        ValueError: for an argument out of range or an unknown accountant.

    Example:
        ```python
        >>> round(epsilon(1.0, 0.01, 1000, 1e-5, accountant="prv"), 2)
        1.83
        ```
    """
    check_noise_multiplier(noise_multiplier)
    check_sample_rate(sample_rate)
    check_steps(steps)
    check_delta(delta)
    check_accountant(accountant)
    return segments_epsilon([(noise_multiplier, sample_rate, steps)], delta, accountant)


def noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    *,
    past: Sequence[Segment] = (),
) -> float:
    """The smallest noise multiplier (within ``CALIBRATION_RTOL``, rounded up) such that ``steps`` more steps at
    ``sample_rate``, after the privacy already spent in ``past``, end at an epsilon of at most ``target_epsilon``.

    Args:
        target_epsilon (`float`): the epsilon to end at.
        delta (`float`): target delta.
        sample_rate (`float`): q of the steps to come.
        steps (`int`): number of steps to come.
        accountant (`str`, *optional*, defaults to `"rdp"`): one of ``PROVEN_ACCOUNTANTS`` (`"rdp"`, `"prv"`).
        past (`Sequence[tuple[float, float, int]]`, *optional*): ``(noise_multiplier, sample_rate, steps)`` segments
            already spent, e.g. when resuming with changed settings.

    Returns:
        `float`: sigma (0.0 when ``steps`` is 0 and the past is within the target).

    Raises:
        ValueError: for bad arguments, for `accountant="gdp"` (an estimate cannot calibrate), when ``past`` alone
            already reaches the target, or when no noise multiplier up to ``MAX_NOISE_MULTIPLIER`` reaches it.

    Example:
        ```python
        >>> sigma = noise_multiplier(3.0, 1e-5, 0.01, 1000, accountant="prv")
        >>> epsilon(sigma, 0.01, 1000, 1e-5, accountant="prv") <= 3.0
        True
        >>> noise_multiplier(3.0, 1e-5, 0.02, 500, accountant="prv", past=[(sigma, 0.01, 400)]) > 0
        True
        ```
    """
    check_target_epsilon(target_epsilon)
    check_delta(delta)
    check_sample_rate(sample_rate)
    check_steps(steps)
    check_proven_accountant(accountant)
    past = check_segments(past, "past")
    spent = _spent_before(target_epsilon, delta, accountant, past)
    if steps == 0:
        return 0.0
    return _calibrate(target_epsilon, delta, sample_rate, steps, accountant, past, spent)


def _spent_before(target_epsilon: float, delta: float, accountant: str, past: list[Segment]) -> float:
    """The epsilon already spent in ``past`` (0 without one); ``ValueError`` where it reaches the target."""
    spent = segments_epsilon(past, delta, accountant) if past else 0.0
    if spent >= target_epsilon:
        raise ValueError(
            f"The privacy already spent (`past`={past}) is epsilon={spent:.4g} under {accountant!r} at delta={delta}, "
            f"which reaches `target_epsilon`={target_epsilon} before any further step. Raise `target_epsilon` or "
            "train no further."
        )
    return spent


def _calibrate(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str,
    past: list[Segment],
    spent: float,
) -> float:
    """:func:`noise_multiplier` for ``steps`` > 0 once its arguments are checked (``spent``: the epsilon of
    ``past``)."""

    def eps(sigma: float) -> float:
        return segments_epsilon([*past, (sigma, sample_rate, steps)], delta, accountant)

    def fail(target: float) -> ValueError:
        spent_text = f", after the {spent:.4g} already spent in `past`" if past else ""
        return ValueError(
            f"No noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches `target_epsilon`={target} with "
            f"delta={delta}, sample_rate={sample_rate}, steps={steps} under {accountant!r}{spent_text}. Raise "
            "`target_epsilon`, lower the sample rate (smaller batch) or train fewer steps."
        )

    # Start from a cheap guess (the GDP calibration is close for every accountant), then bracket and bisect with
    # the proven accountant itself: the answer only ever comes from it.
    def gdp(sigma: float) -> float:
        return segments_epsilon([*past, (sigma, sample_rate, steps)], delta, "gdp")

    try:
        guess = _bracket_and_bisect(gdp, target_epsilon, 1.0, 2.0, 0.05, fail)
    except ValueError:
        guess = MAX_NOISE_MULTIPLIER / 2
    return _bracket_and_bisect(eps, target_epsilon, guess, 1.1, CALIBRATION_RTOL, fail)


def _bracket_and_bisect(
    eps: Callable[[float], float],
    target: float,
    start: float,
    factor: float,
    rtol: float,
    fail: Callable[[float], ValueError],
) -> float:
    """Smallest sigma (to ``rtol``) with ``eps(sigma) <= target``, for ``eps`` decreasing in sigma. The returned sigma
    is always one at which ``eps(sigma) <= target`` was evaluated."""
    high = start
    while eps(high) > target:
        high *= factor
        if high > MAX_NOISE_MULTIPLIER:
            raise fail(target)
    low = high / factor
    while eps(low) <= target:
        high, low = low, low / factor
        if low < 1e-3:
            return high
    while (high - low) > rtol * high:
        mid = math.sqrt(low * high)
        if eps(mid) <= target:
            high = mid
        else:
            low = mid
    return high
