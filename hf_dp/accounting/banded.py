"""Accounting of BandMF (banded matrix-factorization noise) under cyclic Poisson sampling, by the amplified analysis
of Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023 ("(Amplified) Banded Matrix Factorization",
arXiv:2306.08153, Thm. 4), through the existing RDP and PRV accountants.

The rule. Let ``C`` be lower-triangular and ``b``-banded (column ``t`` non-zero in rows ``t .. t+b-1`` only) with
every column norm at most 1, the noise of step ``t`` be ``sigma * C_clip * (C^{-1} Z)_t``, and the sampling be
cyclic Poisson: each unit belongs to one of ``b`` parts, and at step ``t`` each unit of part ``t mod b`` is in the
batch independently with probability ``q_part``, no other unit is. Then the run is as private as DP-SGD with noise
multiplier ``sigma`` and sample rate ``q_part`` for ``ceil(T / b)`` steps (``T`` the noisy steps run): a unit can take
part at most once in each window of ``b`` steps, and its windows touch disjoint rows of ``C G + Z``.

Conditions this module relies on (the callers check them):

* ``q_part`` is the rate of the part (expected batch ``q_part * N / b``), not the overall ``L / N``;
* the part of each unit is drawn independently and uniformly at random (jax_privacy's ``PartitionType.INDEPENDENT``),
  so that adding or removing a unit leaves the other units' parts unchanged: our accountants use add/remove
  neighbours, and an equal split of a shuffled dataset is only valid for replace-one / zero-out;
* the noise multiplier is the same at every step (a change mid-run straddles the rows of a window);
* ``C`` has column norms at most 1 (:class:`~hf_dp.step.bandmf.BandedToeplitzStrategy` normalizes to exactly 1).

With ``b = 1`` it is DP-SGD's own accounting, number for number.

Verified against jax_privacy (google-deepmind/jax_privacy, commit 8967688; read to learn, no code taken):
``jax_privacy/accounting.py: amplified_bandmf_event`` (``dpsgd_event`` of the part's ``sampling_prob`` composed
``math.ceil(iterations / num_bands)`` times, noise multiplier for a strategy of maximum column norm one) and
``jax_privacy/batch_selection.py: CyclicPoissonSampling`` (part ``i % cycle_length`` at iteration ``i``; the
``INDEPENDENT`` partition for add/remove adjacency).

Without amplification (every unit in a known set of steps, e.g. epochs of a shuffled order, at least ``b`` apart, at
most ``k`` times) the release ``C G + Z`` is one Gaussian mechanism of sensitivity
:func:`~hf_dp.step.bandmf.banded_sensitivity`: :func:`epsilon_banded_unamplified`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .functional import epsilon, noise_multiplier
from .methods import Segment
from .validation import check_noise_multiplier, check_sample_rate, check_steps

__all__ = [
    "banded_participations",
    "banded_segments",
    "epsilon_banded",
    "epsilon_banded_unamplified",
    "sigma_for_banded",
]


def _check_bands(bands: int) -> int:
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise ValueError(f"`bands` must be an integer >= 1, got {bands!r}.")
    return bands


def banded_participations(steps_run: int, bands: int) -> int:
    """``ceil(steps_run / bands)``: the most steps a unit of the first part can be sampled in, under cyclic sampling
    with ``bands`` parts, over ``steps_run`` steps (every unit: at most this many)."""
    check_steps(steps_run)
    return -(-steps_run // _check_bands(bands))


def banded_segments(noise_multiplier: float, sample_rate: float, steps_run: int, bands: int) -> list[Segment]:
    """The DP-SGD history equivalent to ``steps_run`` BandMF steps: ``[(sigma, q_part, ceil(steps_run / bands))]``
    (empty for no step), to compose with other segments in any accountant."""
    check_noise_multiplier(noise_multiplier)
    check_sample_rate(sample_rate)
    rounds = banded_participations(steps_run, bands)
    return [(float(noise_multiplier), float(sample_rate), rounds)] if rounds else []


def epsilon_banded(
    noise_multiplier: float, sample_rate: float, steps_run: int, bands: int, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon after ``steps_run`` BandMF steps with ``bands`` bands under cyclic Poisson sampling.

    Args:
        noise_multiplier (`float`): sigma, the noise std over the clipping norm for a strategy of column norm 1.
        sample_rate (`float`): ``q_part``, the probability that a unit of the step's part is in its batch.
        steps_run (`int`): the noisy steps run.
        bands (`int`): ``b``; 1 is DP-SGD.
        delta (`float`): target delta.
        accountant (`str`, *optional*, defaults to `"rdp"`): as in :func:`~hf_dp.accounting.epsilon`.

    Returns:
        `float`: the epsilon of DP-SGD at ``(sigma, q_part)`` over ``ceil(steps_run / bands)`` steps.

    Example:
        ```python
        >>> epsilon_banded(1.0, 0.04, 1000, 4, 1e-5) == epsilon(1.0, 0.04, 250, 1e-5)
        True
        ```
    """
    return epsilon(noise_multiplier, sample_rate, banded_participations(steps_run, bands), delta, accountant)


def sigma_for_banded(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    total_steps: int,
    bands: int,
    accountant: str = "rdp",
    *,
    past: Sequence[Segment] = (),
) -> float:
    """The noise multiplier of :func:`~hf_dp.accounting.noise_multiplier` for the ``ceil(total_steps / bands)``
    DP-SGD steps equivalent to ``total_steps`` BandMF steps at the part's rate ``sample_rate``, after ``past``
    (DP-SGD-equivalent segments, e.g. :func:`banded_segments` of earlier runs). ``epsilon_banded`` of the result is
    at most ``target_epsilon``."""
    rounds = banded_participations(total_steps, bands)
    return noise_multiplier(target_epsilon, delta, sample_rate, rounds, accountant, past=past)


def epsilon_banded_unamplified(
    noise_multiplier: float, sensitivity: float, delta: float, accountant: str = "rdp"
) -> float:
    """Epsilon of the whole release ``C G + Z`` as one Gaussian mechanism, without amplification by sampling.

    Args:
        noise_multiplier (`float`): sigma (noise std over the clipping norm).
        sensitivity (`float`): of ``C G`` for clip norm 1 over the participation patterns allowed, e.g.
            ``strategy.sensitivity(participations=k, min_separation=m)`` for at most ``k`` participations ``m >= b``
            steps apart.
        delta (`float`): target delta.
        accountant (`str`, *optional*, defaults to `"rdp"`): as in :func:`~hf_dp.accounting.epsilon`.

    Returns:
        `float`: the epsilon of the Gaussian mechanism with noise multiplier ``sigma / sensitivity``.
    """
    check_noise_multiplier(noise_multiplier)
    if not sensitivity > 0:
        raise ValueError(f"`sensitivity` must be > 0, got {sensitivity}.")
    return epsilon(noise_multiplier / sensitivity, 1.0, 1, delta, accountant)
