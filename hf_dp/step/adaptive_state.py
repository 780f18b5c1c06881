"""The trainer's side of quantile-adaptive clipping: the current clipping norm and the step's unclipped count.

Per micro-batch the centred count ``sum_u (1[||g_u|| <= C] - 1/2)`` of its units is added on the device (no host
read); at the optimizer step the trainer noises it with the gradient (``N(0, sigma_count^2)``, from the same secret
stream), sums it over processes, and :meth:`AdaptiveClippingState.update` reads it once (one host sync per optimizer
step, only with adaptive clipping) to set the C of the next step
(:func:`~hf_dp.step.adaptive_clipping.update_clipping_norm`).
The math and the accounting are in :mod:`hf_dp.step.adaptive_clipping`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .adaptive_clipping import QuantileClipping, centered_unclipped_count, update_clipping_norm

__all__ = ["AdaptiveClippingState"]


@dataclass
class AdaptiveClippingState:
    """The clipping norm of the current step and the (un-noised) centred count of its units so far."""

    config: QuantileClipping
    expected_batch_size: int
    clip_norm: float
    count_sum: Tensor

    @classmethod
    def start(
        cls,
        config: QuantileClipping | None,
        *,
        max_grad_norm: float,
        expected_batch_size: int,
        resumed_clip_norm: float | None = None,
        device: torch.device | str = "cpu",
    ) -> AdaptiveClippingState | None:
        """The state of a ``train()`` call: ``None`` without adaptive clipping (``config`` None); C starts at the one
        the previous steps of the run ended with (a resume), else at ``max_grad_norm``."""
        if config is None:
            return None
        clip_norm = float(resumed_clip_norm) if resumed_clip_norm is not None else max_grad_norm
        return cls(config, expected_batch_size, clip_norm, torch.zeros((), dtype=torch.float32, device=device))

    def count(self, norms: Tensor) -> None:
        """Add the centred count of one micro-batch's units (their norms, clipped at the current C)."""
        self.count_sum += centered_unclipped_count(norms, self.clip_norm).to(self.count_sum.device)

    def take_count(self) -> Tensor:
        """The step's count as a ``[1]`` float32 tensor to noise and reduce (the running sum starts again)."""
        count = self.count_sum.reshape(1).clone()
        self.count_sum.zero_()
        return count

    def update(self, noisy_count: Tensor) -> float:
        """Set and return the C of the next step from the step's noised, reduced count (a host read)."""
        self.clip_norm = update_clipping_norm(self.clip_norm, float(noisy_count), self.expected_batch_size, self.config)
        return self.clip_norm
