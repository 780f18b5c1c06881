"""Quantile-adaptive clipping: the pure math of Andrew, Thakkar, McMahan & Ramaswamy (2021), "Differentially Private
Learning with Adaptive Clipping" (NeurIPS 2021, arXiv:1905.03871).

Mechanism. Instead of a fixed clipping norm ``C``, each step also privately estimates which fraction of the
sampled units had a gradient norm of at most ``C``, and moves ``C`` geometrically towards the target quantile
``gamma`` of the norms:

* centred count: ``s = sum_i (1[||g_i|| <= C] - 1/2)`` over the units of the (Poisson-sampled) batch;
* release ``s + N(0, sigma_b^2)``, together with the noisy clipped gradient sum (noise ``sigma_grad * C``);
* noisy fraction unclipped: ``b = (s + noise) / m + 1/2``, with ``m`` the *expected* batch size (the real batch size
  is private under Poisson sampling);
* geometric update: ``C <- C * exp(-eta_C * (b - gamma))``; ``C`` shrinks while more than ``gamma`` of the norms are
  below it and grows otherwise, so it tracks the ``gamma`` quantile of the norms.

Sensitivity 1/2. Under add/remove-one neighbours, one unit changes the uncentred count ``sum_i 1[.]`` by 0 or 1, a
sensitivity of 1. Each centred term ``1[.] - 1/2`` is ``+1/2`` or ``-1/2`` whatever the unit's norm, so adding or
removing a unit moves the centred sum by exactly ``1/2`` in absolute value: the sensitivity halves, and the same
noise buys twice the signal-to-noise ratio. (``m / 2`` is added back only after the noise, from public ``m``.)

One Gaussian mechanism. On the same Poisson sample, the step releases the pair (clipped gradient sum + ``N(0,
sigma_grad^2 C^2 I)``, centred count + ``N(0, sigma_b^2)``). Divide each coordinate by its noise std: the pair becomes a
Gaussian mechanism with identity covariance whose one-unit change is ``Delta = (g / (sigma_grad C), +-1 / (2
sigma_b))`` with ``||g|| <= C``, hence ``||Delta||^2 <= (1 / sigma_grad)^2 + (1 / (2 sigma_b))^2``. The privacy loss
of a Gaussian with independent unit noise depends on the shift only through ``||Delta||`` (rotate it onto one axis;
the other coordinates then cancel in the likelihood ratio), for the subsampled mixture as well, since the mixture
``(1 - q) N(0, I) + q N(Delta, I)`` rotates with it. Choosing

    ``(1 / sigma_grad)^2 + (1 / (2 sigma_b))^2 = 1 / sigma^2``

(:func:`gradient_noise_multiplier`) makes the joint release exactly the Poisson-subsampled Gaussian mechanism of
noise multiplier ``sigma``, so the accountant keeps ``sigma`` and the budget is unchanged (the price is a little more
noise on the gradient). The update of ``C`` is post-processing of released values (the noisy count and the public
``m``, ``gamma``, ``eta_C``), so the next step's ``C`` is public and costs nothing more. Accounting with
``sigma_grad`` alone would under-state epsilon (the count's release would be unaccounted).

Andrew et al. recommend ``sigma_b = m / 20`` (:func:`default_count_noise_multiplier`), ``eta_C = 0.2`` and
``gamma = 0.5``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "QuantileClipping",
    "centered_unclipped_count",
    "default_count_noise_multiplier",
    "gradient_noise_multiplier",
    "update_clipping_norm",
]


def _real(name: str, value: object) -> float:
    """``value`` as a float; `ValueError` naming ``name`` for anything that is not a real number (bools included)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__}).")
    return float(value)


def _positive_finite(name: str, value: object) -> float:
    x = _real(name, value)
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value!r}.")
    return x


@dataclass(frozen=True)
class QuantileClipping:
    """Settings of quantile-adaptive clipping (Andrew et al. 2021).

    Args:
        target_quantile (`float`): gamma in (0, 1), the quantile of the per-unit gradient norms that the clipping norm
            tracks (0.5: the median).
        learning_rate (`float`): eta_C > 0, the step of the geometric update ``C <- C exp(-eta_C (b - gamma))``
            (the paper uses 0.2).
        count_noise_multiplier (`float`): sigma_b > 0, the std of the Gaussian noise added to the centred count sum
            (whose sensitivity is 1/2). Must exceed ``sigma / 2`` for the run's noise multiplier ``sigma`` (see
            :func:`gradient_noise_multiplier`); :func:`default_count_noise_multiplier` gives the paper's ``m / 20``.

    Raises:
        ValueError: for a value out of range or not a real number.
    """

    target_quantile: float
    learning_rate: float
    count_noise_multiplier: float

    def __post_init__(self) -> None:
        gamma = _real("target_quantile", self.target_quantile)
        if not 0 < gamma < 1:
            raise ValueError(
                f"`target_quantile` must be strictly between 0 and 1 (the quantile of the gradient norms that the "
                f"clipping norm tracks, e.g. 0.5 for the median), got {self.target_quantile!r}."
            )
        eta = _real("learning_rate", self.learning_rate)
        if not (eta > 0 and math.isfinite(eta)):
            raise ValueError(
                f"`learning_rate` (eta_C of the geometric update of the clipping norm) must be a finite number > 0 "
                f"(Andrew et al. use 0.2), got {self.learning_rate!r}."
            )
        sigma_b = _real("count_noise_multiplier", self.count_noise_multiplier)
        if not (sigma_b > 0 and math.isfinite(sigma_b)):
            raise ValueError(
                f"`count_noise_multiplier` (sigma_b, the std of the noise on the centred count) must be a finite "
                f"number > 0 (Andrew et al. recommend expected_batch_size / 20), got {self.count_noise_multiplier!r}."
            )


def default_count_noise_multiplier(expected_batch_size: float, noise_multiplier: float | None = None) -> float:
    """Andrew et al.'s recommended count noise ``sigma_b = m / 20`` for an expected batch size ``m`` (the noise on
    the fraction ``b`` then has std 1/20, whatever the batch size), and at least ``sigma`` when ``noise_multiplier``
    is given: a small batch (``m / 20 <= sigma / 2``) would otherwise leave the gradient no share of the budget;
    with ``sigma_b = sigma`` the gradient's noise is ``sigma / sqrt(3/4)``, 15% more.

    Raises:
        ValueError: unless ``expected_batch_size`` is a finite number > 0.
    """
    m = _positive_finite("expected_batch_size", expected_batch_size)
    if noise_multiplier is None:
        return m / 20.0
    return max(m / 20.0, float(noise_multiplier))


def gradient_noise_multiplier(noise_multiplier: float, count_noise_multiplier: float) -> float:
    """The gradient's noise multiplier ``sigma_grad = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)``.

    With it, the gradient (sensitivity ``C``, noise std ``sigma_grad * C``) and the centred count (sensitivity 1/2,
    noise std ``sigma_b``) released together on the same Poisson sample are exactly one Gaussian mechanism of noise
    multiplier ``sigma`` (see the module docstring), so the accountant keeps ``sigma``.

    Args:
        noise_multiplier (`float`): sigma, the run's noise multiplier (the one the accountant uses), > 0.
        count_noise_multiplier (`float`): sigma_b, the std of the count's noise; must exceed ``sigma / 2``.

    Returns:
        `float`: sigma_grad >= sigma.

    Raises:
        ValueError: for ``sigma = 0`` (no privacy guarantee to share), a value out of range, or ``2 sigma_b <= sigma``
            (the count alone would spend the whole budget).

    Example:
        ```python
        >>> round(gradient_noise_multiplier(1.0, 12.8), 6)  # m = 256 with the default sigma_b
        1.000764
        ```
    """
    sigma = _real("noise_multiplier", noise_multiplier)
    if sigma == 0:
        raise ValueError(
            "`noise_multiplier` is 0: training without noise has no privacy guarantee, and adaptive clipping (which "
            "shares the noise budget between the gradient and the count) makes no sense there. Use a fixed clipping "
            "norm, or set a privacy budget (a noise multiplier > 0)."
        )
    if not (sigma > 0 and math.isfinite(sigma)):
        raise ValueError(f"`noise_multiplier` must be a finite number > 0, got {noise_multiplier!r}.")
    sigma_b = _positive_finite("count_noise_multiplier", count_noise_multiplier)
    ratio = sigma / (2 * sigma_b)
    if ratio >= 1:
        raise ValueError(
            f"`count_noise_multiplier`={sigma_b:g} is too small for the noise multiplier sigma={sigma:g}: the count "
            f"(sensitivity 1/2) alone would spend the whole budget, since 2 * count_noise_multiplier = {2 * sigma_b:g} "
            f"<= sigma. Raise `count_noise_multiplier` above sigma / 2 = {sigma / 2:g} (the default is "
            "expected_batch_size / 20), or lower the budget's sigma (a larger epsilon, fewer steps or a smaller "
            "sample rate)."
        )
    # sigma / sqrt(1 - (sigma / (2 sigma_b))^2): the same value as the formula above, without cancellation.
    return sigma / math.sqrt((1 - ratio) * (1 + ratio))


def centered_unclipped_count(norms: torch.Tensor, clip: float | torch.Tensor) -> torch.Tensor:
    """``sum_i (1[norm_i <= C] - 1/2)`` over the units of a micro-batch, before any noise.

    Args:
        norms (`torch.Tensor`): the units' unclipped gradient norms (any shape; every entry is one unit). A non-finite
            norm (nan, inf) counts as clipped (indicator 0).
        clip (`float` or `torch.Tensor`): the clipping norm ``C`` of this step (a 0-dim tensor may live on the
            device, so that no host synchronisation is needed).

    Returns:
        `torch.Tensor`: a 0-dim float32 tensor on ``norms.device`` (computed there, without a host sync). Summing it
        over the micro-batches of a logical batch gives the centred count of the batch.
    """
    values = norms.detach().to(torch.float32)
    if isinstance(clip, torch.Tensor):
        clip = clip.detach().to(torch.float32)
        # A 0-dim CPU tensor enters a device op as a scalar; anything else must live with the norms.
        if clip.device != values.device and not (clip.dim() == 0 and clip.device.type == "cpu"):
            clip = clip.to(values.device)
    # nan <= C is False; inf <= C is False for any finite C; isfinite also guards an infinite C.
    unclipped = (values <= clip) & torch.isfinite(values)
    return (unclipped.to(torch.float32) - 0.5).sum(dtype=torch.float32)


def update_clipping_norm(
    clip: float, noisy_centered_count: float, expected_batch_size: float, cfg: QuantileClipping
) -> float:
    """One geometric step of the clipping norm: ``b = noisy_centered_count / m + 1/2`` (the noisy fraction of the
    batch left unclipped), then ``C * exp(-eta_C * (b - gamma))``.

    This is post-processing of the released noisy count: it costs no privacy.

    Args:
        clip (`float`): the current clipping norm ``C`` > 0.
        noisy_centered_count (`float`): the centred count of the whole logical batch plus its ``N(0, sigma_b^2)``
            noise.
        expected_batch_size (`float`): ``m = q * N``, the expected (public) batch size, not the realised one.
        cfg (`QuantileClipping`): gamma and eta_C.

    Returns:
        `float`: the next clipping norm.

    Raises:
        ValueError: for a non-positive or non-finite ``clip`` or ``expected_batch_size``, a non-finite count, or an
            update that leaves the positive floats (a count far outside ``[-m/2, m/2]``).
    """
    c = _positive_finite("clip", clip)
    m = _positive_finite("expected_batch_size", expected_batch_size)
    count = _real("noisy_centered_count", noisy_centered_count)
    if not math.isfinite(count):
        raise ValueError(f"`noisy_centered_count` must be finite, got {noisy_centered_count!r}.")
    b = count / m + 0.5
    exponent = -cfg.learning_rate * (b - cfg.target_quantile)
    try:
        new = c * math.exp(exponent)
    except OverflowError:
        new = math.inf
    if not (new > 0 and math.isfinite(new)):
        raise ValueError(
            f"The clipping norm update C={c:g} * exp({exponent:g}) leaves the positive floats: the noisy count "
            f"{count:g} is far outside [-m/2, m/2] for expected_batch_size m={m:g}. Pass the centred count of the "
            "whole logical batch and the expected batch size of the Poisson sampler."
        )
    return new
