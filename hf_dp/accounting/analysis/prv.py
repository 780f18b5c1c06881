"""Privacy random variables (PRV; Gopi, Lee & Wutschitz 2021), also called privacy loss distributions (PLD), composed
numerically with Google's ``dp-accounting`` (its PMF class, FFT self-composition and tail truncation).

Why the reported epsilon is an upper bound:

1. Dominating pairs. Under add/remove neighbours one step of the Poisson-subsampled Gaussian mechanism is dominated by
   ``P = (1-q) N(0, s^2) + q N(-1, s^2)`` against ``Q = N(0, s^2)`` ("remove") and by ``N(0, s^2)`` against
   ``(1-q) N(0, s^2) + q N(1, s^2)`` ("add"); the two are not symmetric for ``q < 1`` (Zhu, Dong & Wang 2022). Each
   direction is composed on its own and the larger epsilon is reported, as dp-accounting's ``PLDAccountant`` does.
2. Discretisation. The pessimistic connect-the-dots PMF on the grid ``h Z`` (Doroshenko, Ghazi, Kamath, Kumar &
   Manurangsi 2022) has a hockey-stick curve >= the true one at every epsilon, for any ``h``, and this survives
   composition. Mass cut off (noise beyond ``e^-50`` per step, composed tails beyond ``1e-15``) is moved to the
   infinite privacy loss, and rounding noise that makes a mass negative is clipped to 0; both only raise delta. The
   grid ``h`` trades tightness for time; it never makes the number smaller than the truth.
3. Floating point. The one-step curve ``delta(eps)`` is evaluated in closed form without cancellation
   (:func:`step_hockey_stick`; dp-accounting's own loses ~1e-16 absolute, which the PMF's second differences turn into
   ~1e-16 / h of spurious mass per point, and ``steps`` times that after composition), so the one-step mass is 1 to
   ~1e-16; a grid is refused when the one-step mass errors, times the steps, exceed ``PRV_MASS_TOLERANCE``.
   Composition is by FFT in float64, whose zero-mean rounding noise grows with the steps (at 1e6 steps it reaches
   ~1e-10, a few % of delta = 1e-8). It shows as negative masses; epsilon is taken at ``delta`` minus twice the
   negative mass in the tail (weighted as in delta), which covers noise of either sign. A composition whose noise
   exceeds ``delta / 4`` is refused with a `ValueError` (e.g. 1e6 steps at delta = 1e-9): use RDP there.

Error budget (tightness): within ``PRV_REFINE_RTOL`` = 0.5% of the tight value, so that calibrating with this
accountant does not add noise the user does not need, and far inside the 2% we test against dp-accounting's PLD and
Opacus's PRV. A fixed absolute budget (Opacus and prv-accountant use ``eps_error = 0.01`` with a mesh shrinking like
``1 / sqrt(steps)``) is loose for small epsilons and slow for long runs; here the grid is found by refinement: start
at the power of two below 4x the per-step privacy-loss scale ``q sqrt(exp(1 / sigma^2) - 1)`` (at most ``2^-6``),
and halve ``h`` until a halving improves epsilon by less than 0.5% (the discretisation error shrinks at least
linearly in ``h``, so what is left is about that last change). "add" is refined only while it is the larger of the
two. The refinement runs on the history with every segment's steps rounded up to a power of two, so a history that
grows one step at a time re-chooses ``h`` only when a count crosses a power of two, later calls cost one FFT, and
every result is a pure function of the arguments. When the grid limits (``PRV_MAX_STEP_POINTS`` points for one step,
``PRV_MAX_COMPOSED_POINTS`` after composition) stop the refinement first, the result is still an upper bound and a
warning says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from .prv_step import connect_the_dots, step_hockey_stick

__all__ = [
    "connect_the_dots",
    "pmf_epsilon",
    "prv_discretisation",
    "prv_epsilon",
    "prv_epsilon_at",
    "step_hockey_stick",
]

logger = logging.getLogger(__name__)

#: Refinement stops when halving the grid improves epsilon by less than this fraction.
PRV_REFINE_RTOL = 5e-3
#: Coarsest grid the refinement starts from.
PRV_MAX_INTERVAL = 2.0**-6
#: Largest single-step PMF (points) and composed PMF (points) we build.
PRV_MAX_STEP_POINTS = 2**20
PRV_MAX_COMPOSED_POINTS = 2**22
#: Largest total probability mass error after composition (sum over segments of steps * |mass - 1|).
PRV_MASS_TOLERANCE = 1e-3
#: Mass dropped from the tails of each composition (moved to the infinite loss, which is pessimistic).
_TAIL_MASS_TRUNCATION = 1e-15
_DIRECTIONS = ("remove", "add")

Segment = tuple[float, float, int]


class GridRefused(Exception):
    """A discretisation grid exceeds the size limits or loses precision (internal: the caller picks another)."""


class NoisyComposition(GridRefused):
    """The float64 FFT noise of a composition is too large against delta (a coarser grid does not help)."""


def _dp_accounting():
    try:
        from dp_accounting.pld import common, pld_pmf, privacy_loss_mechanism
    except ImportError as err:  # pragma: no cover - a declared dependency
        raise ImportError("The 'prv' accountant needs `dp-accounting`: pip install dp-accounting") from err
    return common, pld_pmf, privacy_loss_mechanism


def _dense(pmf) -> tuple[np.ndarray, float, np.ndarray]:
    """``(probabilities, infinity mass, losses)`` of a dp-accounting PMF (it has no public accessors for them)."""
    dense = pmf.to_dense_pmf()
    probs = np.asarray(dense._probs)
    losses = (dense._lower_loss + np.arange(len(probs))) * dense._discretization
    return probs, float(dense._infinity_mass), losses


@lru_cache(maxsize=16)
def _step_pmf(sigma: float, q: float, interval: float, direction: str):
    """Pessimistic connect-the-dots PMF of one step on the grid ``interval`` (dp-accounting's range and PMF class),
    and the absolute error of its total mass."""
    _, pld_pmf, mechanism = _dp_accounting()
    adjacency = mechanism.AdjacencyType.REMOVE if direction == "remove" else mechanism.AdjacencyType.ADD
    bounds = mechanism.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency).connect_dots_bounds()
    lower = math.floor(bounds.epsilon_lower / interval)
    upper = math.ceil(bounds.epsilon_upper / interval)
    if upper - lower + 1 > PRV_MAX_STEP_POINTS:
        raise GridRefused(f"{upper - lower + 1} points for one step")
    if upper - lower < 2:
        upper = lower + 2  # the formula needs three points
    delta, excess = step_hockey_stick(sigma, q, np.arange(lower, upper + 1) * interval, direction)
    probs, infinity_mass = connect_the_dots(interval, lower, delta, excess)
    pmf = pld_pmf.DensePLDPmf(interval, lower, probs, infinity_mass, pessimistic_estimate=True)
    return pmf, abs(math.fsum(probs) + infinity_mass - 1.0)


def _check_composable(segments: Sequence[Segment], interval: float, direction: str) -> None:
    """Refuse a grid whose composition would be too large or too imprecise, before building it."""
    common, _, _ = _dp_accounting()
    points, mass_error = 0, 0.0
    for sigma, q, steps in segments:
        pmf, error = _step_pmf(sigma, q, interval, direction)
        mass_error += steps * error
        probs = _dense(pmf)[0]
        lower, upper = common.compute_self_convolve_bounds(probs, steps, _TAIL_MASS_TRUNCATION)
        points += max(upper - lower + 1, len(probs))
    if points > PRV_MAX_COMPOSED_POINTS:
        raise GridRefused(f"{points} points after composition")
    if mass_error > PRV_MASS_TOLERANCE:
        raise GridRefused(f"probability mass off by {mass_error:.2g} after composition")


@lru_cache(maxsize=8)
def _composed(segments: tuple[Segment, ...], interval: float, direction: str):
    """PMF of the composition of ``segments``; the prefix of a growing history comes from the cache."""
    sigma, q, steps = segments[-1]
    pmf, _ = _step_pmf(sigma, q, interval, direction)
    last = pmf.self_compose(steps, tail_mass_truncation=_TAIL_MASS_TRUNCATION)
    if len(segments) == 1:
        return last
    return _composed(segments[:-1], interval, direction).compose(last, tail_mass_truncation=_TAIL_MASS_TRUNCATION)


def pmf_epsilon(pmf, delta: float) -> float:
    """Smallest ``eps >= 0`` with ``delta(eps) <= delta`` for a dp-accounting PMF: the same quantity as its
    ``get_epsilon_for_delta``, which walks the losses down from the top in a Python loop (seconds for the million
    points of a long run, and ``exp(-loss)`` overflows below -709), computed with suffix sums instead.

    On the grid ``l_i = l_0 + i h``, for ``l_(i-1) < eps <= l_i``: ``delta(eps) = U_i - e^(eps - l_i) W_i`` with
    ``U_i = m_inf + sum_(j >= i) p_j`` and ``W_i = sum_(j >= i) p_j e^-(l_j - l_i)`` (a recursion
    ``W_i = p_i + e^-h W_(i+1)``, so no exponent is positive), hence ``eps = l_i + log((U_i - delta) / W_i)`` on the
    highest interval whose lower end still has ``delta(l_(i-1)) > delta``.
    """
    from scipy.signal import lfilter

    probs, infinity_mass, losses = _dense(pmf)
    if infinity_mass > delta:
        return math.inf
    if len(probs) == 0:
        return 0.0
    decay = math.exp(-pmf.to_dense_pmf()._discretization)
    upper = infinity_mass + np.cumsum(probs[::-1])[::-1]
    weighted = lfilter([1.0], [1.0, -decay], probs[::-1])[::-1]
    above = np.flatnonzero(upper - decay * weighted > delta)  # delta(l_(i-1)) > delta
    i = int(above[-1]) if above.size else 0
    if upper[i] <= delta or weighted[i] <= 0:
        return 0.0
    return max(0.0, float(losses[i] + math.log((upper[i] - delta) / weighted[i])))


def _canonical(segments: Sequence[Segment]) -> tuple[Segment, ...]:
    """Active segments, with equal neighbours merged (composition does not depend on where a segment is cut)."""
    merged: list[list] = []
    for sigma, q, steps in segments:
        if steps <= 0 or q <= 0:
            continue
        if merged and merged[-1][0] == sigma and merged[-1][1] == q:
            merged[-1][2] += int(steps)
        else:
            merged.append([float(sigma), float(q), int(steps)])
    return tuple((s, q, n) for s, q, n in merged)


def _directions(segments: Sequence[Segment]) -> tuple[str, ...]:
    # Without subsampling the two directions have the same privacy loss distribution.
    return ("remove",) if all(q == 1.0 for _, q, _ in segments) else _DIRECTIONS


def _direction_epsilon(
    segments: tuple[Segment, ...], delta: float, interval: float, direction: str, check: bool = True
) -> float:
    if check:
        _check_composable(segments, interval, direction)
    composed = _composed(segments, interval, direction)
    epsilon = pmf_epsilon(composed, delta)
    if not math.isfinite(epsilon):
        return epsilon
    # FFT rounding noise (zero-mean, ~steps * 1e-16 per Fourier coefficient) shows as negative masses. Whatever it
    # adds to delta(eps) is covered by asking for delta minus twice the noise seen below zero in the tail.
    probs, _, losses = _dense(composed)
    tail = (losses > epsilon) & (probs < 0)
    noise = float(np.dot(-np.expm1(epsilon - losses[tail]), -probs[tail]))
    if noise == 0.0:
        return epsilon
    if 2 * noise > delta / 2:
        raise NoisyComposition(f"rounding noise {noise:.2g} in the composition, above delta / 4")
    return pmf_epsilon(composed, delta - 2 * noise)


def prv_epsilon_at(segments: Sequence[Segment], delta: float, interval: float) -> float:
    """Upper bound on epsilon at ``delta`` for the composition of ``(sigma, q, steps)`` segments, on the grid
    ``interval`` in both directions (any grid gives an upper bound; a finer one a tighter bound).

    Raises:
        GridRefused: when the grid exceeds the size limits or loses precision (see the module docstring).
    """
    segments = _canonical(segments)
    if not segments:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in segments):
        return math.inf
    return max(_direction_epsilon(segments, delta, interval, d) for d in _directions(segments))


def _loss_scale(sigma: float, q: float) -> float:
    """Standard deviation of one step's privacy loss for small ``q`` (``q`` times the chi-square divergence's root)."""
    if 1 / sigma**2 > 700:
        return math.inf
    return (q if q < 1 else 1.0) * math.sqrt(math.expm1(1 / sigma**2))


def _round_up(steps: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, steps))))


def _refine_direction(
    segments: tuple[Segment, ...], delta: float, direction: str, enough: float = -math.inf
) -> tuple[float, float]:
    """``(grid, epsilon)`` for one direction: the coarsest usable grid below 4x the loss scale, halved while that
    improves epsilon by at least ``PRV_REFINE_RTOL`` and epsilon is above ``enough``."""
    scale = min(_loss_scale(sigma, q) for sigma, q, _ in segments)
    interval = 2.0 ** math.floor(math.log2(min(PRV_MAX_INTERVAL, 4 * scale)))
    while True:  # coarsen until the grid is usable (huge epsilons need a coarse grid)
        try:
            best = _direction_epsilon(segments, delta, interval, direction)
            break
        except NoisyComposition:
            raise  # a coarser grid does not help
        except GridRefused:
            interval *= 2
            if interval > 2.0**10:
                raise ValueError(
                    f"The 'prv' accountant cannot discretise {list(segments)} within its limits. Use "
                    '`accountant="rdp"` for this setting.'
                ) from None
    while best > enough and best > 0 and math.isfinite(best):
        try:
            finer = _direction_epsilon(segments, delta, interval / 2, direction)
        except GridRefused as err:
            logger.warning(
                "PRV accountant: %s stopped the refinement at h=%g (%s direction) for %s, delta=%g; epsilon %.6g "
                "is an upper bound but may be looser than the %.1f%% target.",
                err,
                interval,
                direction,
                list(segments),
                delta,
                best,
                100 * PRV_REFINE_RTOL,
            )
            break
        improved = finer < best * (1 - PRV_REFINE_RTOL)
        if finer < best:
            best, interval = finer, interval / 2
        if not improved:
            break
    return interval, best


@lru_cache(maxsize=256)
def _refine(segments: tuple[Segment, ...], delta: float) -> tuple[float, ...]:
    """Grid per direction. The "add" direction is usually far below "remove"; it is refined only while it is the
    larger one, since only the maximum is reported."""
    intervals, largest = [], -math.inf
    for direction in _directions(segments):
        interval, epsilon = _refine_direction(segments, delta, direction, enough=largest)
        intervals.append(interval)
        largest = max(largest, epsilon)
    return tuple(intervals)


def prv_discretisation(segments: Sequence[Segment], delta: float) -> dict[str, float]:
    """The grid ``h`` per direction used for ``segments``: refined on the history with each segment's steps rounded
    up to a power of two (see the module docstring), so it changes only when a count crosses a power of two.

    Raises:
        NoisyComposition: when float64 cannot compose the history precisely enough for ``delta``.
    """
    segments = _canonical(segments)
    rounded = tuple((sigma, q, _round_up(steps)) for sigma, q, steps in segments)
    return dict(zip(_directions(segments), _refine(rounded, float(delta)), strict=True))


def prv_epsilon(segments: Sequence[Segment], delta: float) -> float:
    """Upper bound on epsilon at ``delta`` after the ``(noise_multiplier, sample_rate, steps)`` segments, within about
    0.5% of the tight value (see the module docstring).

    Raises:
        ValueError: when float64 cannot compose the history precisely enough for ``delta`` (e.g. 1e6 steps at
            ``delta = 1e-9``); RDP still can.

    Example:
        ```python
        >>> round(prv_epsilon([(1.0, 0.01, 1000)], 1e-5), 2)  # RDP gives 2.10
        1.83
        ```
    """
    segments = _canonical(segments)
    if not segments:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in segments):
        return math.inf
    try:
        intervals = prv_discretisation(segments, delta)
        # The rounded-up history (at least as many steps in every segment) passed the checks on these grids.
        return max(_direction_epsilon(segments, delta, h, d, check=False) for d, h in intervals.items())
    except GridRefused as err:
        raise _imprecise(segments, delta, err) from None


def _imprecise(segments: Sequence[Segment], delta: float, err: Exception) -> ValueError:
    return ValueError(
        f"The 'prv' accountant cannot compose {list(segments)} precisely enough for delta={delta:g} in float64 "
        f'({err}). Use `accountant="rdp"` for this setting, or a larger delta.'
    )
