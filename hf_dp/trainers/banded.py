"""The trainer side of banded correlated noise (``noise_mechanism="banded-toeplitz"``): the noise sources of a start,
the strategy, and the refusals of a run that cannot continue the mechanism it began.

The strategy is optimized for the run's workload (its SGD momentum and learning-rate schedule, or the prefix sums).
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

import torch
from transformers import get_scheduler

from ..step.bandmf.noise import CorrelatedNoiseSource
from ..step.bandmf.strategy import MAX_SCHEDULE_STEPS, BandedToeplitzStrategy, optimize_banded_toeplitz
from ..step.noise import NoiseSource

__all__ = ["banded_strategy", "check_banded_continuation", "check_banded_plan", "noise_streams"]

BANDED = "banded-toeplitz"


def banded_strategy(plan: Any, trainer: Any = None) -> BandedToeplitzStrategy:
    """The strategy of ``plan``: ``noise_bands`` bands optimized for its ``num_steps`` steps (cached in the process:
    the same workload gives the same object). The workload is the prefix sums of the steps (the model after ``t``
    steps of SGD at a constant learning rate), or, when the run's optimizer is plain SGD (``torch.optim.SGD``, no
    dampening, no Nesterov), its momentum and its learning-rate schedule (the schedule only when the Trainer builds it
    and it is positive at every step; a non-constant one over more than ``MAX_SCHEDULE_STEPS`` steps is left out)."""
    steps, bands = plan.num_steps, plan.noise_bands
    momentum = _sgd_momentum(trainer) if trainer is not None else None
    if momentum is None:
        return optimize_banded_toeplitz(steps, bands)
    rates = _learning_rates(trainer, steps)
    if rates is not None and len(set(rates)) > 1 and steps > MAX_SCHEDULE_STEPS:
        rates = None
    return optimize_banded_toeplitz(steps, bands, momentum=momentum, learning_rates=rates)


def _sgd_momentum(trainer: Any) -> float | None:
    """The momentum of the run's optimizer when it is plain SGD, else `None` (the given optimizer, or the one the
    Trainer will build from `optim="sgd"` and `optim_args`)."""
    optimizer = getattr(trainer, "optimizer", None)
    while optimizer is not None and hasattr(optimizer, "optimizer"):  # accelerate's wrapper
        optimizer = optimizer.optimizer
    if optimizer is not None:
        if type(optimizer) is not torch.optim.SGD:
            return None
        groups = optimizer.param_groups
        if any(g.get("dampening", 0) != 0 or g.get("nesterov", False) for g in groups):
            return None
        momenta = {float(g.get("momentum", 0.0)) for g in groups}
        return momenta.pop() if len(momenta) == 1 else None
    args = trainer.args
    if str(getattr(args.optim, "value", args.optim)) != "sgd":
        return None
    parsed = dict(item.split("=", 1) for item in (args.optim_args or "").replace(" ", "").split(",") if "=" in item)
    if float(parsed.get("dampening", 0)) != 0 or parsed.get("nesterov", "false").lower() in ("true", "1", "yes"):
        return None
    return float(parsed.get("momentum", 0.0))


def _learning_rates(trainer: Any, steps: int) -> list[float] | None:
    """The learning rate of every step of the schedule the Trainer will build (`None`: a scheduler given by the
    user, or a rate of 0 at some step, e.g. the first step of a warm-up)."""
    if getattr(trainer, "lr_scheduler", None) is not None:
        return None
    args = trainer.args
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    scheduler = get_scheduler(
        args.lr_scheduler_type,
        optimizer,
        num_warmup_steps=args.get_warmup_steps(steps),
        num_training_steps=steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )
    rates = []
    for _ in range(steps):
        rates.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    return rates if all(rate > 0 for rate in rates) else None


def noise_streams(
    plan: Any, base: NoiseSource, counts: Callable[[], NoiseSource], trainer: Any = None
) -> tuple[Any, NoiseSource | None, BandedToeplitzStrategy | None]:
    """``(gradient noise, count noise, strategy)`` of one start, from the run's secret ``base`` source.

    DP-SGD, and banded noise with one band (exactly DP-SGD): ``base``, no separate count stream. ``b > 1``: a
    :class:`CorrelatedNoiseSource` over ``base`` for the gradients, and ``counts()`` (another stream of the same
    secret, no process's gradient stream) for the counts released with them.
    """
    if plan.noise_mechanism != BANDED:
        return base, None, None
    strategy = banded_strategy(plan, trainer)
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
