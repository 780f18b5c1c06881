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

import torch

__all__ = ["NoisedLossScaling", "NoisedOverflowScalePolicy"]


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


class NoisedLossScaling:
    """fp16 loss scaling of a DP run: accelerate's ``GradScaler`` set, at every micro-batch, to the scale of a
    :class:`NoisedOverflowScalePolicy`, and the count of dropped examples that drives it.

    Args:
        scaler (`torch.amp.GradScaler`): the run's (enabled) scaler; its own growth is overridden every micro-batch.
        noise_multiplier (`float`): the gradient's noise multiplier (the count is noised with it).
        expected_batch_size (`int`): L, for the policy's threshold.
    """

    def __init__(self, scaler, *, noise_multiplier: float, expected_batch_size: int) -> None:
        self.scaler = scaler
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        self.policy: NoisedOverflowScalePolicy | None = None  # created at the first micro-batch (the resumed scale)
        self._dropped: float | torch.Tensor = 0.0  # examples dropped in the current logical step (on the device)

    @property
    def scale(self) -> float:
        """K, the loss scale of this step (a host float: no read of the device once the policy exists)."""
        return self.policy.scale if self.policy is not None else float(self.scaler.get_scale())

    def begin_micro_batch(self) -> None:
        """Set the scaler to the policy's scale. The scale of a step is the policy's, never GradScaler's own (which
        would only ever grow); the previous optimizer step has run, so changing it now is safe. Set on the device
        every micro-batch (a fill, no read back: the scaler's own growth may have changed it)."""
        if self.policy is None:
            threshold = NoisedOverflowScalePolicy.threshold_for(self.noise_multiplier, self.expected_batch_size)
            self.policy = NoisedOverflowScalePolicy(scale=float(self.scaler.get_scale()), threshold=threshold)
        if self.scaler._get_scale_async() is not None:
            self.scaler.update(new_scale=self.policy.scale)

    def count_dropped(self, per_group_norms: torch.Tensor) -> None:
        """Each example counts the share of its clipping groups whose scaled gradient overflowed (weight 0): with k of
        G groups kept, its contribution (k groups at C / sqrt(G), count (G - k) / G) has norm at most C, so the noised
        count stays one Gaussian mechanism with the gradient. Summed on the device (float64, as a host sum would be):
        read once per step, by the policy."""
        dropped = (~torch.isfinite(per_group_norms)).float().mean(0)
        self._dropped = self._dropped + dropped.sum().to(_count_dtype(dropped.device))

    def take_dropped(self, device: torch.device | str) -> torch.Tensor:
        """The step's count as a ``[1]`` float32 tensor on ``device``, to noise and reduce (the count starts again)."""
        count = self._dropped
        if isinstance(count, torch.Tensor):
            dropped = count.to(device=device, dtype=torch.float32).reshape(1)
        else:
            dropped = torch.tensor([count], dtype=torch.float32, device=device)
        self._dropped = 0.0
        return dropped

    def update(self, noised_dropped: torch.Tensor) -> None:
        """The scale of the next step, from this step's noised and reduced count (a host read)."""
        self.policy.update(float(noised_dropped))


def _count_dtype(device: torch.device) -> torch.dtype:
    """float64 where the device has it (the dropped-example count is summed as the host's Python floats were)."""
    return torch.float32 if device.type == "mps" else torch.float64
