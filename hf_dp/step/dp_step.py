"""The DP step: from the per-example losses of each micro-batch to one noised, recorded update per logical batch.

:class:`DPStep` is built from plain numbers (:class:`DPStepSettings`: sigma, q, L, C) and a few small objects (the
clipper, a noise source, a back end, the privacy record), so it can be driven and tested with an ``nn.Module`` alone;
:class:`~hf_dp.DPTrainer` drives it from ``compute_loss`` and ``training_step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .adaptive_state import AdaptiveClippingState
from .backends import DataParallel
from .loss_scale import NoisedLossScaling
from .noise import NoiseSource

__all__ = ["DPStep", "DPStepSettings", "PrivacyRecord"]


@dataclass(frozen=True)
class DPStepSettings:
    """The numbers a DP step runs with (a run's frozen plan gives them; nothing else is read while training).

    Args:
        noise_multiplier (`float`): sigma, the noise multiplier the accountant records for every step.
        sample_rate (`float`): q, the probability that a unit (example or user) is in a logical batch.
        expected_batch_size (`int`): L = q N, the divisor of the noised sum (never the realised batch size).
        max_grad_norm (`float`): C, the clipping norm (the starting C with adaptive clipping).
        gradient_noise_multiplier (`float`, *optional*): the gradient's share of sigma when a count is released with
            it (adaptive clipping); defaults to ``noise_multiplier``.
        count_noise_multiplier (`float`, *optional*): the noise multiplier of the adaptive-clipping count (none
            without adaptive clipping).
    """

    noise_multiplier: float
    sample_rate: float
    expected_batch_size: int
    max_grad_norm: float
    gradient_noise_multiplier: float | None = None
    count_noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if self.gradient_noise_multiplier is None:
            object.__setattr__(self, "gradient_noise_multiplier", self.noise_multiplier)
        for name in ("noise_multiplier", "gradient_noise_multiplier", "count_noise_multiplier", "max_grad_norm"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"DPStepSettings: `{name}` must be finite and >= 0, got {value}.")
        if not self.expected_batch_size > 0:
            raise ValueError(f"DPStepSettings: `expected_batch_size` must be > 0, got {self.expected_batch_size}.")


class PrivacyRecord(Protocol):
    """Where the noisy steps are recorded (:class:`~hf_dp.DPCallback`: the accountant and the privacy ledger)."""

    @property
    def steps(self) -> int:
        """Noisy steps recorded so far (the noise of the next step is drawn for this index)."""

    def record_step(self, *, noise_multiplier: float, sample_rate: float, max_grad_norm: float) -> None:
        """Record one noisy step with its sigma, q and C (before the optimizer applies it)."""

    def record_clip_norm(self, used: float, next_clip_norm: float) -> None:
        """Adaptive clipping: the C the step used and the C of the next step."""


class DPStep:
    """One DP-SGD step, micro-batch by micro-batch, as a training loop drives it::

        step = DPStep(settings, clipper=BookKeepingClipper(model, max_grad_norm=C), noise=NoiseSource(), record=...)
        for logical_batch in poisson_batches:                  # hf_dp.sampling: each unit in with probability q
            for micro_batch in logical_batch:                  # may be empty: the step still counts
                w = step.begin_micro_batch()                    # w = K / L: the backward's scale of a true gradient
                losses = per_example_loss(model(micro_batch))   # [b], entry i depends on example i alone
                step.prepare(losses).backward()                 # one backward of sum_i loss_i / L, book-kept
                step.accumulate()                               # p.grad += w sum_i min(1, C / ||g_i||) g_i
            step.privatize()                                    # p.grad += N(0, (w sigma C)^2) once; all-reduce;
                                                                #   record (sigma, q); adaptive C of the next step
            optimizer.step()                                    # on (sum + noise) / L, after unscaling by K

    Args:
        settings (`DPStepSettings`): sigma, q, L, C.
        clipper (`BookKeepingClipper`, *optional*): the model's clipper; under FSDP2 the back end builds it at the
            first micro-batch.
        noise (`NoiseSource`): the run's secret noise stream.
        record (`PrivacyRecord`): where each noisy step is recorded (before the optimizer applies it).
        backend (*optional*): :class:`~hf_dp.step.backends.DataParallel` (default: one process, over
            ``clipper.model``) or :class:`~hf_dp.step.backends.FullySharded`.
        loss_scaling (`NoisedLossScaling`, *optional*): fp16 loss scaling (K); none: K = 1.
        adaptive (`AdaptiveClippingState`, *optional*): quantile-adaptive clipping (C changes from step to step).
        count_noise (`NoiseSource`, *optional*): a separate stream for the counts released with the gradient (fp16's
            dropped count), when ``noise`` is correlated across steps
            (:class:`~hf_dp.step.bandmf.noise.CorrelatedNoiseSource`): only the gradients get the correlated noise, and
            a count never reuses their standard normals. `None`: the counts come from ``noise``'s step stream, with the
            gradients (DP-SGD).
    """

    def __init__(
        self,
        settings: DPStepSettings,
        *,
        noise: NoiseSource,
        record: PrivacyRecord,
        clipper: Any = None,
        backend: Any = None,
        loss_scaling: NoisedLossScaling | None = None,
        adaptive: AdaptiveClippingState | None = None,
        count_noise: NoiseSource | None = None,
    ) -> None:
        self.settings = settings
        self.count_noise = count_noise
        self.clipper = clipper
        self.noise = noise
        self.record = record
        self.backend = backend if backend is not None else DataParallel(clipper.model)
        self.loss_scaling = loss_scaling
        self.adaptive = adaptive
        self.loss_weight = 1.0 / settings.expected_batch_size

    @property
    def clip_norm(self) -> float:
        """C of the current step."""
        return self.adaptive.clip_norm if self.adaptive is not None else self.settings.max_grad_norm

    # ------------------------------------------------------------------ micro-batch
    def begin_micro_batch(self, *, loss_division: int = 1) -> float:
        """Set and return ``w = K / (L * loss_division)``: the factor between the true per-example gradients and
        those the coming backward produces (``K`` the fp16 loss scale, 1 without; ``loss_division`` what the caller's
        backward divides the loss by, e.g. accelerate's gradient accumulation steps)."""
        k = 1.0
        if self.loss_scaling is not None:
            self.loss_scaling.begin_micro_batch()
            k = self.loss_scaling.scale
        self.loss_weight = k / (self.settings.expected_batch_size * loss_division)
        return self.loss_weight

    def prepare(self, per_example_loss: Tensor, *, units: Tensor | None = None) -> Tensor:
        """Let the clipper book-keep the coming backward of these per-example losses (``units``: the user of each
        example, for user-level clipping); returns ``sum_i loss_i / L``, the loss to run the backward on."""
        self.clipper.prepare(per_example_loss, loss_scale=self.loss_weight, units=units)
        return per_example_loss.sum() / self.settings.expected_batch_size

    def accumulate(self, *, count_units: bool = True) -> None:
        """After the backward: the clipped sum into the gradients. The backward ran on ``w * sum_i loss_i``, so the
        clipper clips at ``w * C`` in its units (Li et al. 2022, App. T: K*C in fp16). With adaptive clipping, the
        units' centred unclipped count is added (``count_units=False`` for a placeholder micro-batch)."""
        self.clipper.finish(loss_scale=self.loss_weight)
        if self.adaptive is not None and count_units:  # on the device: read once per optimizer step
            self.adaptive.count(self.clipper.per_example_norms)
        self.backend.after_accumulate()
        if self.loss_scaling is not None:
            self.loss_scaling.count_dropped(self.clipper.per_group_norms)

    def abandon(self) -> None:
        """A micro-batch failed (e.g. a refusal raised in the backward): nothing of its pass stays."""
        if self.clipper is not None:
            self.clipper.abandon()

    # ------------------------------------------------------------------ logical step
    def privatize(self, device: torch.device | str = "cpu") -> None:
        """End of a logical batch, before the optimizer step: noise the clipped sum (and the counts released with it)
        once, sum over processes, record the step, and set the C of the next step (adaptive clipping). ``device``:
        where the counts live."""
        parameters = self.backend.trainable_parameters()
        _ensure_grads(parameters)
        dropped = self.loss_scaling.take_dropped(device) if self.loss_scaling is not None else None
        count = self.adaptive.take_count() if self.adaptive is not None else None
        grads = self.backend.local_gradients(parameters)
        self.add_noise(*self.backend.noise_targets(grads, dropped, count))
        self.backend.reduce([p.grad for p in parameters], dropped, count)
        if dropped is not None:
            self.loss_scaling.update(dropped)
        self.record.record_step(
            noise_multiplier=self.settings.noise_multiplier,
            sample_rate=self.settings.sample_rate,
            max_grad_norm=self.clip_norm,
        )
        if count is not None:  # C of the next step, from this step's noisy count (post-processing)
            used = self.adaptive.clip_norm
            self.record.record_clip_norm(used, self.adaptive.update(count))
            self.clipper.max_grad_norm = self.adaptive.clip_norm

    @torch.no_grad()
    def add_noise(self, grads: list[Tensor], dropped: Tensor | None = None, count: Tensor | None = None) -> None:
        """``grads += w N(0, sigma^2 C^2)``, so that after unscaling by K the update is the DP-SGD one,
        ``(sum + noise) / L``; ``dropped`` (fp16: the count of overflowed examples) += N(0, sigma^2), from the same
        step's stream (one Gaussian mechanism: :mod:`hf_dp.step.loss_scale`); ``count`` (adaptive clipping: the centred
        count of unclipped units) += N(0, sigma_count^2), sigma then being the gradient's share
        (:mod:`hf_dp.step.adaptive_clipping`). The noise of step ``s`` comes from the run's secret source; with a
        separate ``count_noise`` (correlated gradient noise) the counts come from it instead."""
        sigma = self.settings.gradient_noise_multiplier
        std = self.loss_weight * sigma * self.clip_norm
        if std == 0:
            return
        counts = [*([dropped] if dropped is not None else []), *([count] if count is not None else [])]
        if self.count_noise is not None:
            self._add(self.noise, grads, [std] * len(grads))
            self._add(self.count_noise, counts, [self._count_std(t, dropped, sigma) for t in counts])
            return
        targets = [*grads, *counts]
        self._add(self.noise, targets, [std] * len(grads) + [self._count_std(t, dropped, sigma) for t in counts])

    def _count_std(self, target: Tensor, dropped: Tensor | None, sigma: float) -> float:
        """The noise std of a count: sigma for fp16's dropped count, the count's own for adaptive clipping."""
        return sigma if target is dropped else self.settings.count_noise_multiplier

    def _add(self, source: Any, targets: list[Tensor], stds: list[float]) -> None:
        """``targets[i] += N(0, stds[i]^2)`` from ``source``'s draw of the current step, one draw per device."""
        by_device: dict[torch.device, list[tuple[Tensor, float]]] = {}
        for target, sd in zip(targets, stds, strict=True):
            by_device.setdefault(target.device, []).append((target, sd))
        for device, pairs in by_device.items():
            targets = [t for t, _ in pairs]
            noise = source.normal(
                step=self.record.steps,
                shapes=[t.shape for t in targets],
                std=[sd for _, sd in pairs],
                device=device,
                dtype=torch.float32,
            )
            # one fused add for every tensor of the device (the same element-wise sums as one add_ per tensor)
            torch._foreach_add_(targets, [n.to(t.dtype) for t, n in zip(targets, noise, strict=True)])


@torch.no_grad()
def _ensure_grads(parameters: list[nn.Parameter]) -> None:
    """A parameter no example reached still gets the noise: its gradient starts at zero."""
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
