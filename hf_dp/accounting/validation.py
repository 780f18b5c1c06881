"""Argument checks shared by the accounting functions (ValueError naming the argument)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

__all__ = [
    "check_delta",
    "check_noise_multiplier",
    "check_sample_rate",
    "check_segments",
    "check_steps",
    "check_target_epsilon",
]


def check_delta(delta: float) -> None:
    if not (_real(delta) and 0 < delta < 1):
        raise ValueError(f"`delta` must be in (0, 1), got {delta}.")


def check_sample_rate(sample_rate: float) -> None:
    if not (_real(sample_rate) and 0 < sample_rate <= 1):
        raise ValueError(f"`sample_rate` must be in (0, 1], got {sample_rate}.")


def check_steps(steps: int) -> None:
    if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"`steps` must be a non-negative integer, got {steps!r}.")


def check_noise_multiplier(noise_multiplier: float) -> None:
    """A finite sigma >= 0 (an infinite one states no mechanism a step can run, and has no accounting)."""
    if not (_real(noise_multiplier) and math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"`noise_multiplier` must be a finite number >= 0, got {noise_multiplier}.")


def check_target_epsilon(target_epsilon: float) -> None:
    if not (_real(target_epsilon) and target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"`target_epsilon` must be a finite number > 0, got {target_epsilon}.")


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_segments(segments: Sequence, name: str = "segments") -> list[tuple[float, float, int]]:
    """Check a history of ``(noise_multiplier, sample_rate, steps)`` segments; return it as a list of tuples."""
    checked = []
    for i, segment in enumerate(segments):
        try:
            sigma, q, steps = segment
        except (TypeError, ValueError):
            raise ValueError(
                f"`{name}[{i}]` must be a (noise_multiplier, sample_rate, steps) triple, got {segment!r}."
            ) from None
        try:
            check_noise_multiplier(sigma)
            check_sample_rate(q)
            check_steps(steps)
        except ValueError as err:
            raise ValueError(f"`{name}[{i}]`={segment!r}: {err}") from None
        checked.append((float(sigma), float(q), int(steps)))
    return checked
