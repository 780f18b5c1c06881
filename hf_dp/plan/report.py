"""How a run's frozen plan is shown: the WARNING line at ``train()`` start, and ``DPTrainer.dp_summary()``."""

from __future__ import annotations

import logging
from typing import Any

from .privacy_plan import DPPlan

logger = logging.getLogger("hf_dp")

__all__ = ["log_plan", "plan_summary"]


def plan_summary(plan: DPPlan, *, steps_taken: int, epsilon: float) -> dict[str, Any]:
    """The privacy settings of ``plan`` (what :func:`log_plan` shows), plus the steps taken and epsilon spent."""
    return {
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "expected_batch_size": plan.expected_batch_size,
        "num_examples": plan.num_examples,
        "steps": plan.num_steps,
        "delta": plan.delta,
        "target_epsilon": plan.target_epsilon,
        "accountant": plan.accountant,
        "max_grad_norm": plan.max_grad_norm,
        "clipping_mode": plan.clipping_mode,
        "clipping_style": plan.clipping_style,
        "clipping_fn": plan.clipping_fn,
        "secure_mode": plan.secure_mode,
        "noise_mechanism": plan.noise_mechanism,
        "noise_bands": plan.noise_bands,
        "steps_taken": steps_taken,
        "epsilon": epsilon,
    }


def log_plan(plan: DPPlan, *, steps_taken: int, fixed_noise_seed: bool) -> None:
    """One WARNING line with the run's privacy settings and the steps already spent (and one more with a fixed
    ``noise_seed``, which voids the guarantee)."""
    target = "none (fixed sigma)" if plan.target_epsilon is None else f"{plan.target_epsilon:g}"
    adaptive = ""
    if plan.adaptive_clipping:
        adaptive = (
            f" (adaptive: quantile {plan.target_unclipped_quantile:g}; gradient sigma "
            f"{plan.gradient_noise_multiplier:.4g}, count sigma {plan.count_noise_multiplier:.4g})"
        )
    if plan.banded:
        adaptive += (
            f"; banded correlated noise, b={plan.noise_bands}: cyclic Poisson sampling (q is the rate of the sampled "
            f"part), epsilon after T steps is DP-SGD's of ceil(T / {plan.noise_bands}) steps"
        )
    logger.warning(
        "hf_dp: DP training with sigma=%.4g, q=%.4g (L=%d of N=%d %ss), %d steps, delta=%.3g, target epsilon=%s "
        "(%s accountant), C=%g%s, clipping=%s%s. Spent so far: %d steps.",
        plan.noise_multiplier,
        plan.sample_rate,
        plan.expected_batch_size,
        plan.num_examples,
        plan.unit_name,
        plan.num_steps,
        plan.delta,
        target,
        plan.accountant.upper(),
        plan.max_grad_norm,
        adaptive,
        plan.clipping_mode,
        ", secure_mode" if plan.secure_mode else "",
        steps_taken,
    )
    if fixed_noise_seed:
        logger.warning("hf_dp: `noise_seed` is set: the noise is reproducible by anyone who knows it (tests only).")
