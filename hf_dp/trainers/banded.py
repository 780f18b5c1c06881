"""The trainer side of banded correlated noise (``noise_mechanism="banded-toeplitz"``): the noise sources of a start,
the strategy, and the refusals of a run that cannot continue the mechanism it began.

The gradients get row ``t`` of ``C^{-1} Z`` at step ``t`` (:class:`~hf_dp.step.bandmf.noise.CorrelatedNoiseSource`
over the run's secret :class:`~hf_dp.step.noise.NoiseSource`); fp16's dropped count, released with them, is noised
from another stream of the same secret (never the gradients' standard normals), with independent noise at every step:
each unit's participation then changes the released rows ``t .. t+b-1`` of ``C G`` by a column of norm at most 1 (in
units of sigma C) *or* the count of step ``t`` by at most 1 (in units of sigma), never both (an overflowed example's
gradient is dropped), so the amplified analysis of the gradients covers the pair. Adaptive clipping is refused by the
arguments.

The noise state (the last ``b - 1`` rows of ``C^{-1} Z``) is a secret like the seed that regenerates it: neither is
ever written. A resumed run, or a later ``train()`` call, can continue the mechanism only where the seed is known to
the process, i.e. a fixed ``noise_seed`` (tests): the source then replays the steps already taken from the base
stream. Otherwise it refuses, saying what to do (a new ``output_dir``, or continuing with DP-SGD, whose accounting
counts the banded steps taken as DP-SGD steps at ``q_part``: an over-count).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..step.bandmf.noise import CorrelatedNoiseSource
from ..step.bandmf.strategy import BandedToeplitzStrategy, optimize_banded_toeplitz
from ..step.noise import NoiseSource

__all__ = ["banded_strategy", "check_banded_continuation", "check_banded_plan", "noise_streams"]

BANDED = "banded-toeplitz"


def banded_strategy(plan: Any) -> BandedToeplitzStrategy:
    """The strategy of ``plan``: ``noise_bands`` bands optimized for the prefix sums of its ``num_steps`` steps
    (cached in the process: the same plan gives the same object)."""
    return optimize_banded_toeplitz(plan.num_steps, plan.noise_bands)


def noise_streams(
    plan: Any, base: NoiseSource, counts: Callable[[], NoiseSource]
) -> tuple[Any, NoiseSource | None, BandedToeplitzStrategy | None]:
    """``(gradient noise, count noise, strategy)`` of one start, from the run's secret ``base`` source.

    DP-SGD, and banded noise with one band (exactly DP-SGD): ``base``, no separate count stream. ``b > 1``: a
    :class:`CorrelatedNoiseSource` over ``base`` for the gradients, and ``counts()`` (another stream of the same
    secret, no process's gradient stream) for the counts released with them.
    """
    if plan.noise_mechanism != BANDED:
        return base, None, None
    strategy = banded_strategy(plan)
    if plan.noise_bands == 1:
        return base, None, strategy
    return CorrelatedNoiseSource(base, strategy), counts(), strategy


def check_banded_continuation(args: Any, callback: Any, *, resuming: bool) -> None:
    """Before the plan of a ``train()`` call whose run already took noisy steps: refuse a banded mechanism it cannot
    continue exactly, and set ``callback.bands`` (how the run's own steps are accounted).

    Raises:
        ValueError: banded noise after steps of another mechanism or band count, without a fixed ``noise_seed`` (the
            noise state is gone), or with draws not aligned with the steps (``ignore_data_skip``, steps the ledger has
            beyond the checkpoint).
    """
    saved = callback.plan or {}
    saved_bands = int(saved.get("noise_bands", 1)) if saved.get("noise_mechanism") == BANDED else 1
    if callback.steps == 0:
        callback.bands = 1
        return
    if args.noise_mechanism != BANDED:
        callback.bands = 1  # the banded steps taken count as DP-SGD steps at q_part: an over-count
        return
    what = "resume" if resuming else "continue (a later train() call)"
    if saved_bands != args.noise_bands or saved.get("noise_mechanism") != BANDED:
        raise ValueError(
            f"hf_dp: cannot {what} this run with `noise_mechanism='banded-toeplitz'`, "
            f"`noise_bands={args.noise_bands}`: "
            f"its {callback.steps} noisy steps were taken with another mechanism or band count "
            f"({saved.get('noise_mechanism', 'unknown')}, b = {saved_bands}), and a banded mechanism's accounting "
            "covers only its own steps. Keep the run's settings, or start a new run in a new `output_dir`."
        )
    if args.noise_seed is None:
        raise ValueError(
            f"hf_dp: cannot {what} a run with banded correlated noise ({callback.steps} steps taken): its noise state "
            "(the last b - 1 rows of C^-1 Z) and the secret seed that regenerates it are never written anywhere (they "
            "would let anyone remove the noise), so the next steps cannot add the noise its guarantee assumes. Start a "
            "new run in a new `output_dir`, or continue this one with `noise_mechanism='dp-sgd'` (the banded steps "
            "taken are then accounted as DP-SGD steps at their sample rate: an over-count)."
        )
    if resuming and callback.draw_offset != 0:
        raise ValueError(
            "hf_dp: cannot resume this banded run: its cyclic Poisson draws would no longer follow its steps "
            "(`ignore_data_skip=True`, or the ledger records steps after the checkpoint), so a unit could be sampled "
            "twice within b steps. Resume without `ignore_data_skip`, from the run's last checkpoint."
        )
    callback.bands = int(args.noise_bands)


def check_banded_plan(plan: Any, callback: Any) -> None:
    """After the plan: a banded run that continues must keep the sigma and q of its steps (one mechanism).

    Raises:
        ValueError: the plan's sigma or sample rate differs from those of the steps taken.
    """
    if plan.noise_mechanism != BANDED or callback.steps == 0 or not callback.history:
        return
    sigma, rate = float(callback.history[-1][0]), float(callback.history[-1][1])
    if (sigma, rate) != (float(plan.noise_multiplier), float(plan.sample_rate)):
        raise ValueError(
            f"hf_dp: this banded run's steps were taken at sigma={sigma:g}, q_part={rate:g}, the new plan has "
            f"sigma={plan.noise_multiplier:g}, q_part={plan.sample_rate:g}: correlated noise cannot change its scale "
            "or sampling mid-run. Keep the schedule (`max_steps`/`num_train_epochs`, the batch, `target_epsilon` or "
            "`noise_multiplier`), or start a new run in a new `output_dir`."
        )
