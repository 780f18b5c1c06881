"""``DPCallback``: the privacy state of a run (accountant and noise generator), the budget stop, and checkpoints."""

from __future__ import annotations

import logging
import math
import secrets
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .accounting import PrivacyAccountant
from .accounting.methods import segments_epsilon

logger = logging.getLogger(__name__)

__all__ = ["DPCallback"]

_MAX_BUDGET_STEPS = 10**8


class DPCallback(TrainerCallback, ExportableState):
    """Counts every noisy step in a :class:`~hf_dp.accounting.PrivacyAccountant`, stops training before the budget
    would be exceeded, and saves its state (accountant history, noise generator) in ``trainer_state.json`` so that
    ``resume_from_checkpoint`` continues the same epsilon. It acts on training only through ``control``.

    Args:
        noise_multiplier (`float`): sigma of every step.
        sample_rate (`float`): q of every step.
        delta (`float`): delta of the guarantee.
        accountant (`str`, *optional*, defaults to `"rdp"`): accountant for the budget.
        epsilon_budget (`float`, *optional*): stop before epsilon would exceed it (`None`: no stop).
        noise_seed (`int`, *optional*): seed of the noise generator (`None`: from the OS).
    """

    def __init__(
        self,
        noise_multiplier: float = 0.0,
        sample_rate: float = 1.0,
        delta: float = 1e-5,
        accountant: str = "rdp",
        epsilon_budget: float | None = None,
        noise_seed: int | None = None,
    ) -> None:
        self.accountant = PrivacyAccountant(noise_multiplier, sample_rate, accountant)
        self.delta = delta
        self.epsilon_budget = epsilon_budget
        self.noise_seed = secrets.randbits(62) if noise_seed is None else int(noise_seed)
        self._generators: dict[str, torch.Generator] = {}
        self._pending_generator_states: dict[str, list[int]] = {}
        self._budget_steps: int | None = None

    # ------------------------------------------------------------------ state
    @property
    def noise_multiplier(self) -> float:
        return self.accountant.noise_multiplier

    @property
    def sample_rate(self) -> float:
        return self.accountant.sample_rate

    @property
    def history(self) -> list[list[float]]:
        return self.accountant.history

    @history.setter
    def history(self, value: list[list[float]]) -> None:
        self.accountant.load_state_dict({"history": value})

    @property
    def noise_generator_states(self) -> dict[str, list[int]]:
        states = dict(self._pending_generator_states)
        states.update({device: g.get_state().tolist() for device, g in self._generators.items()})
        return states

    @noise_generator_states.setter
    def noise_generator_states(self, value: dict[str, list[int]]) -> None:
        self._generators = {}
        self._pending_generator_states = {str(k): list(v) for k, v in (value or {}).items()}

    def noise_generator(self, device: torch.device) -> torch.Generator:
        """The dedicated noise generator for ``device`` (restored from a checkpoint if one was loaded)."""
        key = str(device)
        if key not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.noise_seed)
            if key in self._pending_generator_states:
                generator.set_state(torch.tensor(self._pending_generator_states.pop(key), dtype=torch.uint8))
            self._generators[key] = generator
        return self._generators[key]

    def state(self) -> dict[str, Any]:
        return {
            "args": {
                "noise_multiplier": self.noise_multiplier,
                "sample_rate": self.sample_rate,
                "delta": self.delta,
                "accountant": self.accountant.accountant,
                "epsilon_budget": self.epsilon_budget,
                "noise_seed": self.noise_seed,
            },
            "attributes": {"history": self.history, "noise_generator_states": self.noise_generator_states},
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore the attributes saved by :meth:`state` (what the Trainer does when restoring callback states)."""
        for name, value in state.get("attributes", {}).items():
            setattr(self, name, value)

    # ------------------------------------------------------------------ privacy
    @property
    def steps(self) -> int:
        return self.accountant.steps

    def epsilon(self, accountant: str | None = None) -> float:
        """Epsilon spent so far (``math.inf`` with zero noise)."""
        return self.accountant.epsilon(self.delta, accountant)

    def steps_within_budget(self) -> int | None:
        """Total number of steps (taken and future, at the current sigma and q) that keeps epsilon within budget."""
        if self.epsilon_budget is None:
            return None
        if self.noise_multiplier == 0:
            return self.steps
        past = [tuple(s) for s in self.history]

        def within(n: int) -> bool:
            future = [(self.noise_multiplier, self.sample_rate, n)]
            return segments_epsilon(past + future, self.delta, self.accountant.accountant) <= self.epsilon_budget

        if not within(0):
            return self.steps
        high = 1
        while within(high):
            high *= 2
            if high > _MAX_BUDGET_STEPS:
                return None
        low = high // 2
        while high - low > 1:
            mid = (low + high) // 2
            if within(mid):
                low = mid
            else:
                high = mid
        return self.steps + low

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, **kwargs):
        self._budget_steps = self.steps_within_budget()
        if self._budget_steps is not None and self._budget_steps <= self.steps:
            logger.warning("The privacy budget epsilon=%s is already spent; training stops.", self.epsilon_budget)
            control.should_training_stop = True
        return control

    def on_step_end(self, args, state, control, **kwargs):
        self.accountant.step()
        if self._budget_steps is not None and self.steps >= self._budget_steps:
            if state.max_steps and state.global_step < state.max_steps:
                logger.warning(
                    "Stopping at step %d: one more step would exceed the privacy budget epsilon=%s (%s).",
                    state.global_step,
                    self.epsilon_budget,
                    self.accountant.accountant,
                )
            control.should_training_stop = True
        return control

    def __repr__(self) -> str:
        eps = self.epsilon() if self.history else 0.0
        eps_text = "inf" if math.isinf(eps) else f"{eps:.3f}"
        return (
            f"DPCallback(sigma={self.noise_multiplier}, q={self.sample_rate}, delta={self.delta}, steps={self.steps}, "
            f"epsilon={eps_text})"
        )
