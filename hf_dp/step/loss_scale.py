"""The fp16 loss scale under DP: it reacts to overflows through a noised count, at no extra privacy cost.

With fp16, the backward runs on ``K * sum_i loss_i``; an example whose scaled gradient overflows gets weight 0 (which
keeps its contribution within the clipping norm). GradScaler's own policy then never sees an overflow (the clipped sum
stays finite), never backs off, and keeps growing ``K``: a long run would silently drop more and more examples. Backing
off on the raw count of dropped examples would make the released model depend on un-noised data.

Instead the number ``z`` of dropped examples of a logical step is released with Gaussian noise of the same multiplier
as the gradient: ``z~ = z + N(0, sigma^2)``. Each example goes to exactly one of the two releases, either its clipped
gradient (norm <= C) or one count, so the joint per-example contribution ``(clip(g_i) / C, [dropped_i])`` has norm at
most 1 and the pair (noised sum, noised count) is ONE Gaussian mechanism with noise multiplier sigma: the accounting is
unchanged. The scale is a function of the ``z~`` only (post-processing): halve ``K`` when ``z~`` exceeds a threshold,
double it after ``growth_interval`` steps without a back-off.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["NoisedOverflowScalePolicy"]


@dataclass
class NoisedOverflowScalePolicy:
    """Loss-scale policy driven by the noised count of dropped (overflowed) examples.

    Args:
        scale (`float`): the current loss scale K.
        threshold (`float`): back off when the noised count exceeds it (a few noise standard deviations, and at least
            one example per hundred of the expected batch, so that the noise alone rarely triggers it).
        backoff_factor (`float`, *optional*, defaults to 0.5): factor applied to K on a back-off.
        growth_factor (`float`, *optional*, defaults to 2.0): factor applied to K after `growth_interval` quiet steps.
        growth_interval (`int`, *optional*, defaults to 2000): quiet steps before K grows (GradScaler's default).
        min_scale (`float`, *optional*, defaults to 1.0): K never goes below it.
    """

    scale: float
    threshold: float
    backoff_factor: float = 0.5
    growth_factor: float = 2.0
    growth_interval: int = 2000
    min_scale: float = 1.0
    quiet_steps: int = 0

    @staticmethod
    def threshold_for(noise_multiplier: float, expected_batch_size: float) -> float:
        """``max(1, 3 sigma, L / 100)``: the noise alone exceeds it with probability about 0.1%."""
        return max(1.0, 3.0 * noise_multiplier, expected_batch_size / 100.0)

    def update(self, noised_dropped: float) -> float:
        """The scale for the next step, from this step's noised count of dropped examples."""
        if noised_dropped > self.threshold:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.quiet_steps = 0
        else:
            self.quiet_steps += 1
            if self.quiet_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.quiet_steps = 0
        return self.scale
