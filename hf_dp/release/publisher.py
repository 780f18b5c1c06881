"""What a DP trainer writes when it saves or pushes: the released state and metrics, and the DP model card.

Every file a DP trainer writes about its training passes here (the trainers' ``save_metrics``, ``save_state``,
``create_model_card``, ``save_model`` and hub uploads are one-line delegations): the log history and metrics pass the
filter of :mod:`hf_dp.release.filter`, and every folder that receives weights gets the "Differential privacy" card
section of that moment (:mod:`hf_dp.release.model_card`), its epsilon plot, and hf_dp's tags. The privacy ledger
(:mod:`hf_dp.ledger`) writes only the (sigma, q) of each step, never a statistic of the data.

The functions take the trainer (any :class:`~hf_dp.trainers.mixin.DPTrainerMixin`) and read its frozen plan, its
privacy record (``dp_callback``) and its log history; they never change what the trainer trains with.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from .epsilon_plot import plot_epsilon_curve
from .eval_overlap import eval_card_fields, training_metric_prefixes, withheld_metric_prefixes
from .filter import released_log_history, unreleased_log_keys
from .model_card import DPModelCardData, card_tags, render_dp_section, write_dp_model_card
from .model_saves import attach_dp_card

__all__ = [
    "EPSILON_PLOT",
    "card_data",
    "clipping_details",
    "create_released_model_card",
    "release_after_train",
    "write_dp_card",
]

#: The epsilon-vs-step plot written next to the model card (when matplotlib is installed).
EPSILON_PLOT = "epsilon.png"


def create_released_model_card(trainer: Any, create: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """``create(*args, **kwargs)`` (``Trainer.create_model_card``) run on the released log history only, so that the
    Trainer's results table holds no un-noised statistic; ``tags`` made a list (hf_dp's are added with the card)."""
    tags = kwargs.pop("tags", None)
    kwargs["tags"] = [tags] if isinstance(tags, str) else list(tags or [])
    history = trainer.state.log_history
    withheld = withheld_metric_prefixes(trainer)
    trainer.state.log_history = released_log_history(history, trainer.args.publish_training_metrics, withheld)
    try:
        create(*args, **kwargs)
    finally:
        trainer.state.log_history = history


def write_dp_card(trainer: Any, output_dir: str) -> None:
    """The DP section of ``output_dir/README.md`` and hf_dp's tags: `differential-privacy` only with a finite
    epsilon; without one (noise multiplier 0) the card says there is no guarantee, and there is no plot."""
    points = [(h["step"], h["epsilon"]) for h in trainer.state.log_history if "epsilon" in h and "step" in h]
    plot = None
    if (
        points
        and all(math.isfinite(eps) for _, eps in points)
        and plot_epsilon_curve(points, os.path.join(output_dir, EPSILON_PLOT), accountant=trainer.dp_plan.accountant)
    ):
        plot = EPSILON_PLOT
    section = trainer.dp_model_card_section(epsilon_plot=plot)
    write_dp_model_card(output_dir, section, tags=card_tags(trainer.epsilon()))


def release_after_train(trainer: Any) -> None:
    """At the end of ``train()`` (also when it was interrupted): the DP card of that moment into ``output_dir`` (a later
    ``model.save_pretrained(output_dir)``, or PEFT's own card update, keeps it), and on the model's own saves
    (:mod:`hf_dp.release.model_saves`). Nothing when no noisy step was ever taken."""
    if trainer.dp_callback.steps == 0:
        return
    write_dp_card(trainer, trainer.args.output_dir)
    attach_dp_card(trainer.model, trainer.dp_model_card_section(), card_tags(trainer.epsilon()))


def dp_card_section(trainer: Any, epsilon_plot: str | None = None) -> str:
    """The "Differential privacy" section of the model card, for the privacy spent so far."""
    return render_dp_section(card_data(trainer, epsilon_plot=epsilon_plot))


def card_data(trainer: Any, epsilon_plot: str | None = None) -> DPModelCardData:
    """What the card states: the frozen plan, the privacy record (every step that ran, segment by segment), the
    optimizer, the published metrics, the audit and the evaluation data."""
    plan, callback = trainer.dp_plan, trainer.dp_callback
    names = sorted({plan.accountant, *plan.epsilon_accountants})
    published = []
    if trainer.args.publish_training_metrics:
        published = unreleased_log_keys(trainer.state.log_history, training_metric_prefixes(trainer))
    return DPModelCardData(
        epsilons={name: callback.epsilon(name) for name in names},
        accountant=plan.accountant,
        delta=plan.delta,
        segments=[tuple(s) for s in callback.spent_history] or [(plan.noise_multiplier, plan.sample_rate, 0)],
        expected_batch_size=plan.expected_batch_size,
        num_examples=plan.num_examples,
        max_grad_norm=plan.max_grad_norm,
        clipping_mode=plan.clipping_mode,
        clipping_details=clipping_details(plan),
        poisson_sampling=plan.poisson_sampling,
        optimizer=_optimizer_name(trainer),
        secure_mode=plan.secure_mode,
        fixed_noise_seed=trainer.args.noise_seed is not None,
        published_training_metrics=published,
        audit=trainer.dp_audit_result,
        epsilon_plot=epsilon_plot,
        user_column=plan.user_column,
        max_examples_per_user=plan.max_examples_per_user,
        num_rows=plan.num_rows,
        adaptive_clipping=_adaptive_fields(plan, callback.clip_norms),
        earlier_steps=callback.carried_steps,
        not_covered=list(callback.not_covered),
        banded_noise=_banded_fields(trainer),
        **eval_card_fields(trainer),
    )


def clipping_details(plan: Any) -> str | None:
    """The card's row on the clipping policy (none for all-layer Abadi clipping, the default)."""
    if plan.clipping_style == "all-layer" and plan.clipping_fn == "abadi":
        return None
    style = plan.clipping_style if isinstance(plan.clipping_style, str) else f"{len(plan.clipping_style)} groups"
    fn = (
        "Abadi (min(1, C_g / norm))"
        if plan.clipping_fn == "abadi"
        else (f"automatic (C_g / (norm + {plan.automatic_clipping_gamma:g}))")
    )
    return f"{style}, each of the G groups clipped at C_g = C / sqrt(G); {fn}"


def _adaptive_fields(plan: Any, clip_norms: list[float]) -> dict[str, Any] | None:
    if not plan.adaptive_clipping:
        return None
    return {
        "target_quantile": plan.target_unclipped_quantile,
        "learning_rate": plan.clipping_norm_lr,
        "count_noise_multiplier": plan.count_noise_multiplier,
        "gradient_noise_multiplier": plan.gradient_noise_multiplier,
        "clip_norms": list(clip_norms),
    }


def _banded_fields(trainer: Any) -> dict[str, Any] | None:
    """The card's fields of banded correlated noise (none for DP-SGD): the public strategy of the run (built at
    ``train()``; its numbers only, never the noise state)."""
    plan = trainer.dp_plan
    if plan.noise_mechanism != "banded-toeplitz":
        return None
    parameters = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    fields = {"bands": plan.noise_bands, "state_bytes": (plan.noise_bands - 1) * parameters * 4}
    strategy = getattr(trainer, "_banded_strategy", None)
    if strategy is not None:
        fields.update(
            workload=strategy.workload,
            optimized_steps=strategy.steps,
            sensitivity=strategy.sensitivity(1),
            error=strategy.error,
            dpsgd_error=strategy.dpsgd_error,
        )
    return fields


def _optimizer_name(trainer: Any) -> str:
    optimizer = trainer.optimizer
    while optimizer is not None and hasattr(optimizer, "optimizer"):  # accelerate's AcceleratedOptimizer wrapper
        optimizer = optimizer.optimizer
    return type(optimizer).__name__ if optimizer is not None else str(trainer.args.optim)
