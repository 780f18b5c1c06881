"""Stateless entry points: epsilon of a run, and the noise multiplier that reaches a target epsilon."""

from __future__ import annotations

import math

from .methods import check_accountant, segments_epsilon
from .validation import check_delta, check_noise_multiplier, check_sample_rate, check_steps, check_target_epsilon

__all__ = ["MAX_NOISE_MULTIPLIER", "epsilon", "noise_multiplier"]

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
        accountant (`str`, *optional*, defaults to `"rdp"`): `"rdp"`, `"gdp"` or `"prv"` (upper bound).

    Returns:
        `float`: epsilon (`math.inf` for sigma = 0 and steps > 0).

    Example:
        ```python
        >>> round(epsilon(1.0, 0.01, 1000, 1e-5), 2)
        ```
    """
    check_noise_multiplier(noise_multiplier)
    check_sample_rate(sample_rate)
    check_steps(steps)
    check_delta(delta)
    check_accountant(accountant)
    return segments_epsilon([(noise_multiplier, sample_rate, steps)], delta, accountant)


def noise_multiplier(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """The smallest noise multiplier (within 0.1%) whose epsilon after ``steps`` steps is at most the target.

    Raises:
        ValueError: for bad arguments, or when no noise multiplier up to ``MAX_NOISE_MULTIPLIER`` reaches the target.
    """
    check_target_epsilon(target_epsilon)
    check_delta(delta)
    check_sample_rate(sample_rate)
    check_steps(steps)
    check_accountant(accountant)
    if steps == 0:
        return 0.0

    def eps(sigma: float) -> float:
        return segments_epsilon([(sigma, sample_rate, steps)], delta, accountant)

    # Start from a cheap guess (the GDP calibration is close for every accountant), then bracket and bisect.
    guess = _bracket_and_bisect(
        lambda s: segments_epsilon([(s, sample_rate, steps)], delta, "gdp"), target_epsilon, 1.0, 2.0, 0.05
    )
    return _bracket_and_bisect(
        eps, target_epsilon, guess, 1.1, CALIBRATION_RTOL, (delta, sample_rate, steps, accountant)
    )


def _bracket_and_bisect(eps, target: float, start: float, factor: float, rtol: float, context=None) -> float:
    """Smallest sigma (to ``rtol``) with ``eps(sigma) <= target``, for ``eps`` decreasing in sigma."""
    high = start
    while eps(high) > target:
        high *= factor
        if high > MAX_NOISE_MULTIPLIER:
            delta, sample_rate, steps, accountant = context or ("?", "?", "?", "gdp")
            raise ValueError(
                f"No noise multiplier up to {MAX_NOISE_MULTIPLIER:g} reaches `target_epsilon`={target} with "
                f"delta={delta}, sample_rate={sample_rate}, steps={steps} under {accountant!r}. Raise "
                "`target_epsilon`, lower the sample rate (smaller batch) or train fewer steps."
            )
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
