"""The privacy settings of one ``train()`` call, resolved from the arguments, the data and the privacy already spent.

The plan is frozen when ``train()`` starts (DESIGN §6 rule 21): the clipper, the noise, the accountant and the card read
the plan, never the arguments. A change to the arguments' DP fields while the run goes on (a callback that lowers
``per_sample_max_grad_norm`` at step 1) would otherwise make one part of the mechanism use a setting the others do not
know about; :meth:`DPPlan.check_unchanged` compares a snapshot of those fields, taken with the plan, with the arguments
at every optimizer step (a tuple compare on the host) and raises :class:`FrozenSettingsError` before the next noisy
step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..accounting import banded_participations
from ..accounting import noise_multiplier as calibrate_noise_multiplier
from ..accounting.methods import segments_epsilon
from ..argument_checks import check_finite
from ..arguments import DPArgumentsMixin
from ..step.adaptive_clipping import QuantileClipping, default_count_noise_multiplier, gradient_noise_multiplier

__all__ = ["FROZEN_FIELDS", "DPPlan", "FrozenSettingsError", "resolve_plan", "settings_snapshot"]

#: Fields of the training arguments that the run's privacy depends on besides the DP fields of ``DPArgumentsMixin``
#: (the sample rate and the schedule, the loss scale policy). A change to any of them during ``train()`` is an error.
_SCHEDULE_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_steps",
    "num_train_epochs",
    "fp16",
    "bf16",
)


#: The argument fields frozen for a run: every DP field, then the schedule fields.
FROZEN_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys((*(f.name for f in dataclasses.fields(DPArgumentsMixin)), *_SCHEDULE_FIELDS))
)


def _freeze(value: Any) -> Any:
    """A comparable, immutable copy of an argument value (lists, e.g. parsed clipping groups, become tuples)."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def settings_snapshot(args) -> tuple[Any, ...]:
    """The values of :data:`FROZEN_FIELDS` in ``args`` (missing fields as ``None``), as one tuple."""
    return tuple(_freeze(getattr(args, name, None)) for name in FROZEN_FIELDS)


class FrozenSettingsError(RuntimeError):
    """A privacy setting of the arguments changed while ``train()`` was running."""


@dataclass(frozen=True)
class DPPlan:
    """What DP-SGD does in this run: ``L`` examples expected per logical batch out of ``N``, sample rate
    ``q = L / N``, ``num_steps`` noisy steps in the schedule, noise multiplier ``sigma``, for ``(epsilon, delta)``;
    clipping at ``C = max_grad_norm`` with ``clipping_mode``/``clipping_style``/``clipping_fn``; the headline and the
    logged accountants; Poisson sampling or not; the loss scale (``"fp16"``: the noised overflow policy; ``"bf16"``;
    ``None``: fp32)."""

    num_examples: int
    expected_batch_size: int
    sample_rate: float
    delta: float
    num_steps: int
    noise_multiplier: float
    target_epsilon: float | None
    accountant: str
    max_grad_norm: float = 0.1
    clipping_mode: str = "bk-mixopt"
    clipping_style: Any = "all-layer"
    clipping_fn: str = "abadi"
    automatic_clipping_gamma: float = 0.01
    epsilon_accountants: tuple[str, ...] = ()
    poisson_sampling: bool = True
    secure_mode: bool = False
    loss_scale: str | None = None
    #: ``"example"``, or ``"user"``: then ``num_examples`` and ``expected_batch_size`` count users (of ``num_rows``
    #: rows).
    privacy_unit: str = "example"
    user_column: str | None = None
    max_examples_per_user: int | None = None
    num_rows: int | None = None
    #: Quantile-adaptive clipping (:mod:`hf_dp.step.adaptive_clipping`): ``max_grad_norm`` is then the starting C.
    adaptive_clipping: bool = False
    target_unclipped_quantile: float = 0.5
    clipping_norm_lr: float = 0.2
    count_noise_multiplier: float | None = None
    #: The noise multiplier of the gradient: ``noise_multiplier`` (the accountant's), or larger with adaptive
    #: clipping, whose count takes its share of the budget.
    gradient_noise_multiplier: float | None = None
    #: The gradient noise: ``"dp-sgd"``, or ``"banded-toeplitz"`` with ``noise_bands`` bands (cyclic Poisson
    #: sampling: ``sample_rate`` is then the rate of a part, ``b L / N``, and epsilon after T steps is DP-SGD's for
    #: ``ceil(T / b)`` steps at ``(noise_multiplier, sample_rate)``).
    noise_mechanism: str = "dp-sgd"
    noise_bands: int = 1
    #: :func:`settings_snapshot` of the arguments the plan was resolved from (kept in memory only: never saved).
    settings: tuple[Any, ...] = field(default=(), repr=False, compare=False)

    def saved(self) -> dict[str, Any]:
        """The plan as written with checkpoints (no secret in it), to reuse the same sigma on an unchanged resume."""
        saved = asdict(self)
        del saved["settings"]  # holds every DP argument, `noise_seed` included: never written
        return saved

    @property
    def banded(self) -> bool:
        """Whether the gradient noise is correlated across steps (banded matrix factorization)."""
        return self.noise_mechanism == "banded-toeplitz"

    @property
    def steps_per_epoch(self) -> int:
        """Logical batches in one pass over the data: ``floor(1 / q)``, ``q = L / N`` (also with cyclic sampling)."""
        return max(1, math.floor(1 / (self.expected_batch_size / self.num_examples)))

    @property
    def unit_name(self) -> str:
        """How messages and the card call the unit: "example" or "user"."""
        return "user" if self.privacy_unit == "user" else "example"

    @property
    def quantile_clipping(self) -> QuantileClipping | None:
        """The adaptive clipping settings, or ``None`` for a fixed clipping norm."""
        if not self.adaptive_clipping:
            return None
        return QuantileClipping(self.target_unclipped_quantile, self.clipping_norm_lr, self.count_noise_multiplier)

    def clipping_kwargs(self) -> dict[str, Any]:
        """The clipping policy keyword arguments of :class:`~hf_dp.BookKeepingClipper` for this plan."""
        style = self.clipping_style
        if isinstance(style, tuple):  # frozen groups of parameter-name patterns: the engine takes lists
            style = [list(group) for group in style]
        kwargs: dict[str, Any] = {"clipping_style": style, "clipping_fn": self.clipping_fn}
        if self.clipping_fn == "automatic":
            kwargs["gamma"] = self.automatic_clipping_gamma
        return kwargs

    def check_unchanged(self, args, *, step: int | None = None) -> None:
        """Raise :class:`FrozenSettingsError` if a frozen field of ``args`` differs from its value when the plan was
        resolved (cheap: one tuple compare; the field-by-field search runs only on a difference)."""
        if not self.settings:
            return
        now = settings_snapshot(args)
        if now == self.settings:
            return
        changed = [
            f"`{name}` {before!r} -> {after!r}"
            for name, before, after in zip(FROZEN_FIELDS, self.settings, now, strict=True)
            if before != after
        ]
        where = f" (noticed at optimizer step {step})" if step is not None else ""
        raise FrozenSettingsError(
            f"hf_dp: privacy settings of the arguments changed while train() was running{where}: {', '.join(changed)}. "
            "The clipping norm, the noise, the sample rate and the accountant of a run are fixed when train() starts "
            "(the clipper, the noise and the accountant all use those values), so a change during the run would "
            "either be ignored or make the stated (epsilon, delta) false. Restore the arguments, or stop and start "
            "a new train() call (or resume from a checkpoint) with the new settings: the privacy spent so far is "
            "kept and the new settings are accounted as a new segment."
        )


def _same_schedule(saved: dict[str, Any], plan: dict[str, Any]) -> bool:
    keys = ("num_examples", "expected_batch_size", "delta", "num_steps", "target_epsilon", "accountant")
    return all(saved.get(k) == plan[k] for k in keys) and saved.get("noise_multiplier") is not None


def resolve_plan(
    args,
    num_examples: int,
    *,
    world_size: int,
    past: Sequence[Sequence[float]] = (),
    saved: dict[str, Any] | None = None,
    steps_done: int = 0,
    num_rows: int | None = None,
) -> DPPlan:
    """Resolve the plan for ``args`` on a training set of ``num_examples`` privacy units.

    Args:
        args (`DPTrainingArguments`): the run's arguments (read, never modified).
        num_examples (`int`): ``N``, the privacy units of the training set (its rows, or its users with
            ``privacy_unit="user"``).
        world_size (`int`): number of data-parallel processes.
        past (`Sequence`): ``(sigma, q, steps)`` segments already spent (resume, or an earlier ``train()`` call).
        saved (`dict`, *optional*): the plan saved with the checkpoint being resumed; its sigma is reused when the
            schedule is unchanged, so that an interrupted run and an uninterrupted one add the same noise.
        steps_done (`int`): steps of this schedule already taken (the checkpoint's global step).
        num_rows (`int`, *optional*): rows of the training set, with ``privacy_unit="user"``.

    Raises:
        ValueError: an expected batch larger than the data set, ``delta >= 1/N``, or a budget no noise reaches.
    """
    by_user = getattr(args, "privacy_unit", "example") == "user"
    unit = "user" if by_user else "example"
    expected_batch_size = _expected_batch_size(args, num_examples, world_size, unit)
    bands = _bands(args, num_examples, expected_batch_size, unit)
    rate = expected_batch_size / num_examples
    sample_rate = rate if bands == 1 else expected_batch_size * bands / num_examples  # q_part = b L / N: cyclic
    delta = _delta(args, num_examples, unit)
    num_steps = args.max_steps if args.max_steps and args.max_steps > 0 else math.ceil(args.num_train_epochs / rate)
    if bands > num_steps:
        raise ValueError(
            f"`noise_bands={bands}` is more bands than the {num_steps} planned steps: the banded noise is optimized "
            "for the run's steps. Use at most as many bands as steps (`noise_bands`), or more steps."
        )
    draft = {
        "num_examples": num_examples,
        "expected_batch_size": expected_batch_size,
        "sample_rate": sample_rate,
        "delta": delta,
        "num_steps": num_steps,
        "target_epsilon": args.target_epsilon,
        "accountant": args.accountant,
    }
    sigma = _noise_multiplier(args, draft, past=past, saved=saved, steps_done=steps_done, bands=bands)
    adaptive = _adaptive_settings(args, sigma, expected_batch_size)
    return DPPlan(
        noise_multiplier=sigma,
        **draft,
        **_mechanism_settings(args),
        **_unit_settings(args, by_user, num_rows),
        **adaptive,
        noise_mechanism=getattr(args, "noise_mechanism", "dp-sgd"),
        noise_bands=bands,
        settings=settings_snapshot(args),
    )


def _expected_batch_size(args, num_examples: int, world_size: int, unit: str) -> int:
    """``L``, the privacy units expected in a logical batch, which must not exceed the ``N`` of the training set."""
    expected_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    if expected_batch_size > num_examples:
        raise ValueError(
            f"The expected logical batch ({expected_batch_size} {unit}s = per_device_train_batch_size x "
            f"gradient_accumulation_steps x world_size) is larger than the training set ({num_examples} {unit}s). "
            "Lower `per_device_train_batch_size` or `gradient_accumulation_steps`."
        )
    return expected_batch_size


def _bands(args, num_examples: int, expected_batch_size: int, unit: str) -> int:
    """``b`` (1 for DP-SGD); with cyclic Poisson sampling every part must hold at least the expected batch."""
    if getattr(args, "noise_mechanism", "dp-sgd") != "banded-toeplitz":
        return 1
    bands = int(args.noise_bands)
    if bands * expected_batch_size > num_examples:
        raise ValueError(
            f"`noise_bands={bands}` with an expected batch of {expected_batch_size} {unit}s needs b L = "
            f"{bands * expected_batch_size} <= N = {num_examples} {unit}s: cyclic Poisson sampling splits the "
            f"training set into b parts and samples one part per step at rate b L / N "
            f"= {bands * expected_batch_size / num_examples:g}, which must not exceed 1. Use fewer bands "
            "(`noise_bands`) or a smaller batch."
        )
    return bands


def _delta(args, num_examples: int, unit: str) -> float:
    """The delta of the guarantee: `target_delta`, or 1/(2N) when unset; a delta of 1/N or more is refused."""
    delta = args.target_delta if args.target_delta is not None else 1 / (2 * num_examples)
    if delta >= 1 / num_examples:
        raise ValueError(
            f"`target_delta`={delta:g} is not below 1/N = {1 / num_examples:g} (N = {num_examples} {unit}s): a "
            f"mechanism that publishes one random {unit}'s data in full meets this delta, so the guarantee would mean "
            "little. Set `target_delta` well below 1/N, or leave it unset for 1/(2N)."
        )
    return delta


def _noise_multiplier(
    args,
    draft: dict[str, Any],
    *,
    past: Sequence[Sequence[float]],
    saved: dict[str, Any] | None,
    steps_done: int,
    bands: int = 1,
) -> float:
    """The plan's sigma: the one given, the saved plan's on a resume with the same schedule, or else calibrated so
    that the ``past`` segments (as accounted) and the steps still to take together spend `target_epsilon`; with
    ``bands`` > 1 the steps to take count as their participations, ``ceil(T / b) - ceil(steps_done / b)``.

    Raises:
        ValueError: if no noise reaches the budget, or the accountant cannot state the epsilon of the whole plan.
    """
    sample_rate, delta, num_steps = draft["sample_rate"], draft["delta"], draft["num_steps"]
    remaining = banded_participations(num_steps, bands) - banded_participations(min(steps_done, num_steps), bands)
    if args.noise_multiplier is not None:
        check_finite("noise_multiplier", args.noise_multiplier, "a noise multiplier (e.g. 1.0)", zero=True)
        sigma = float(args.noise_multiplier)
    elif saved and _same_schedule(saved, draft) and saved.get("noise_bands", 1) == bands:
        sigma = float(saved["noise_multiplier"])
    else:
        sigma = calibrate_noise_multiplier(
            args.target_epsilon,
            delta,
            sample_rate,
            max(remaining, 1),
            accountant=args.accountant,
            past=[tuple(segment) for segment in past],
        )
    if sigma > 0:  # the accountant must be able to state the epsilon of the whole plan: fail now, not at a log step
        segments_epsilon([*map(tuple, past), (sigma, sample_rate, max(remaining, 0))], delta, args.accountant)
    return float(sigma)


def _mechanism_settings(args) -> dict[str, Any]:
    """The plan's clipping, sampling, noise-source, loss-scale and logged-accountant fields, as in the arguments
    (checked again: the arguments may have been edited after they were built)."""
    check_finite("per_sample_max_grad_norm", args.per_sample_max_grad_norm, "a clipping norm (e.g. 1.0)")
    return {
        "max_grad_norm": float(args.per_sample_max_grad_norm),
        "clipping_mode": args.clipping_mode,
        "clipping_style": _freeze(args.clipping_style),
        "clipping_fn": args.clipping_fn,
        "automatic_clipping_gamma": float(args.automatic_clipping_gamma),
        "epsilon_accountants": tuple(args.epsilon_accountants),
        "poisson_sampling": bool(args.poisson_sampling),
        "secure_mode": bool(args.secure_mode),
        "loss_scale": "fp16" if getattr(args, "fp16", False) else ("bf16" if getattr(args, "bf16", False) else None),
    }


def _unit_settings(args, by_user: bool, num_rows: int | None) -> dict[str, Any]:
    """The plan's privacy-unit fields: the user column and its bounds with ``privacy_unit="user"``, else `None`."""
    return {
        "privacy_unit": "user" if by_user else "example",
        "user_column": args.user_column if by_user else None,
        "max_examples_per_user": args.max_examples_per_user if by_user else None,
        "num_rows": num_rows if by_user else None,
    }


def _adaptive_settings(args, sigma: float, expected_batch_size: int) -> dict[str, Any]:
    """The plan's adaptive-clipping fields: the count's noise and the gradient's noise multiplier that together
    spend the privacy of ``sigma`` (one Gaussian mechanism:
    :func:`~hf_dp.step.adaptive_clipping.gradient_noise_multiplier`).
    """
    if not getattr(args, "adaptive_clipping", False):
        return {"gradient_noise_multiplier": sigma}

    count_sigma = args.count_noise_multiplier
    if count_sigma is None:
        count_sigma = default_count_noise_multiplier(expected_batch_size, sigma)
    config = QuantileClipping(float(args.target_unclipped_quantile), float(args.clipping_norm_lr), float(count_sigma))
    return {
        "adaptive_clipping": True,
        "target_unclipped_quantile": config.target_quantile,
        "clipping_norm_lr": config.learning_rate,
        "count_noise_multiplier": config.count_noise_multiplier,
        "gradient_noise_multiplier": gradient_noise_multiplier(sigma, config.count_noise_multiplier),
    }
