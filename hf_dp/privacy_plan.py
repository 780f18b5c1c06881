"""The privacy settings of one ``train()`` call, resolved from the arguments, the data and the privacy already spent."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .accounting import noise_multiplier as calibrate_noise_multiplier
from .accounting.methods import segments_epsilon

__all__ = ["DPPlan", "resolve_plan"]


@dataclass(frozen=True)
class DPPlan:
    """What DP-SGD does in this run: ``L`` examples expected per logical batch out of ``N``, sample rate
    ``q = L / N``, ``num_steps`` noisy steps in the schedule, noise multiplier ``sigma``, for ``(epsilon, delta)``."""

    num_examples: int
    expected_batch_size: int
    sample_rate: float
    delta: float
    num_steps: int
    noise_multiplier: float
    target_epsilon: float | None
    accountant: str

    def saved(self) -> dict[str, Any]:
        """The plan as written with checkpoints (no secret in it), to reuse the same sigma on an unchanged resume."""
        return asdict(self)


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
) -> DPPlan:
    """Resolve the plan for ``args`` on a training set of ``num_examples``.

    Args:
        args (`DPTrainingArguments`): the run's arguments (read, never modified).
        num_examples (`int`): ``N``.
        world_size (`int`): number of data-parallel processes.
        past (`Sequence`): ``(sigma, q, steps)`` segments already spent (resume, or an earlier ``train()`` call).
        saved (`dict`, *optional*): the plan saved with the checkpoint being resumed; its sigma is reused when the
            schedule is unchanged, so that an interrupted run and an uninterrupted one add the same noise.
        steps_done (`int`): steps of this schedule already taken (the checkpoint's global step).

    Raises:
        ValueError: an expected batch larger than the data set, ``delta >= 1/N``, or a budget no noise reaches.
    """
    expected_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * world_size
    if expected_batch_size > num_examples:
        raise ValueError(
            f"The expected logical batch ({expected_batch_size} = per_device_train_batch_size x "
            f"gradient_accumulation_steps x world_size) is larger than the training set ({num_examples}). Lower "
            "`per_device_train_batch_size` or `gradient_accumulation_steps`."
        )
    sample_rate = expected_batch_size / num_examples
    delta = args.target_delta if args.target_delta is not None else 1 / (2 * num_examples)
    if delta >= 1 / num_examples:
        raise ValueError(
            f"`target_delta`={delta:g} is not below 1/N = {1 / num_examples:g}: a mechanism that publishes one random "
            "training example in full meets this delta, so the guarantee would mean little. Set `target_delta` well "
            "below 1/N, or leave it unset for 1/(2N)."
        )
    num_steps = (
        args.max_steps if args.max_steps and args.max_steps > 0 else math.ceil(args.num_train_epochs / sample_rate)
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
    if args.noise_multiplier is not None:
        sigma = float(args.noise_multiplier)
    elif saved and _same_schedule(saved, draft):
        sigma = float(saved["noise_multiplier"])
    else:
        remaining = max(num_steps - steps_done, 1)
        sigma = calibrate_noise_multiplier(
            args.target_epsilon,
            delta,
            sample_rate,
            remaining,
            accountant=args.accountant,
            past=[tuple(segment) for segment in past],
        )
    if sigma > 0:  # the accountant must be able to state the epsilon of the whole plan: fail now, not at a log step
        segments_epsilon(
            [*map(tuple, past), (sigma, sample_rate, max(num_steps - steps_done, 0))], delta, args.accountant
        )
    return DPPlan(noise_multiplier=float(sigma), **draft)
