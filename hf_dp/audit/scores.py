"""Membership scores: how much training lowered each canary's loss.

``score_i = loss_i(initial model) - loss_i(trained model)``. Subtracting the initial loss calibrates each canary
against itself, so a canary that is naturally easy (short, frequent tokens) is not mistaken for a member; higher
means more likely a member (Steinke, Nasr and Jagielski 2023 use the same loss-difference score for input-space
canaries when the initial model is known).
"""

from __future__ import annotations

import numpy as np
from torch import nn

from .canaries import CanarySet
from .exposures import canary_exposures
from .losses import canary_losses

__all__ = ["CanaryScores"]


class CanaryScores:
    """The canaries' losses before and after training, and their exposure (what the audit callback records; it holds
    no inclusion bits).

    Args:
        canaries (`CanarySet`): the canaries.
        batch_size (`int`, *optional*, defaults to 64): items per forward pass.
        num_alternatives (`int`, *optional*, defaults to 0): random alternatives per secret for exposure, computed
            with the final losses (0: no exposure; must be 0 for classification canaries).
        seed (`int`, *optional*): seed of the exposure alternatives (None: OS entropy).

    Example:
        ```python
        scores = CanaryScores(canaries)
        scores.record_initial(model)
        ...  # train
        scores.record_final(model)
        scores.scores()  # initial loss - final loss, one per canary
        ```
    """

    def __init__(
        self, canaries: CanarySet, *, batch_size: int = 64, num_alternatives: int = 0, seed: int | None = None
    ) -> None:
        if num_alternatives and not canaries.generative:
            raise ValueError(
                f"Exposure needs generative canaries, got {type(canaries).__name__}; set `num_alternatives=0`."
            )
        if num_alternatives < 0:
            raise ValueError(f"`num_alternatives` must be >= 0, got {num_alternatives}.")
        self.canaries = canaries
        self.batch_size = batch_size
        self.num_alternatives = num_alternatives
        self.seed = seed
        self.initial_losses: np.ndarray | None = None
        self.final_losses: np.ndarray | None = None
        self.exposures: np.ndarray | None = None

    def _losses(self, model: nn.Module) -> np.ndarray:
        items = [self.canaries[i] for i in range(len(self.canaries))]
        return canary_losses(
            model, items, task=self.canaries.task, pad_token_id=self.canaries.pad_token_id, batch_size=self.batch_size
        )

    def record_initial(self, model: nn.Module) -> None:
        """Scores the untrained model (call before the first training step)."""
        self.initial_losses = self._losses(model)

    def record_final(self, model: nn.Module) -> None:
        """Scores the trained model (and computes exposure when ``num_alternatives > 0``)."""
        self.final_losses = self._losses(model)
        if self.num_alternatives:
            self.exposures = canary_exposures(
                model,
                self.canaries,
                num_alternatives=self.num_alternatives,
                secret_losses=self.final_losses,
                seed=self.seed,
                batch_size=self.batch_size,
            )

    def scores(self) -> np.ndarray:
        """``initial loss - final loss`` per canary; higher means more likely a member.

        Raises:
            RuntimeError: if the initial or the final losses were not recorded.
        """
        if self.initial_losses is None:
            raise RuntimeError(
                "The canaries were not scored under the initial model. Pass `audit.callback()` to the trainer "
                "(it scores at the start of training), or call `audit.score_initial(model)` before training."
            )
        if self.final_losses is None:
            raise RuntimeError(
                "The canaries were not scored under the trained model. Pass `audit.callback()` to the trainer (it "
                "scores at the end of training), or call `audit.score_final(model)` after training."
            )
        return self.initial_losses - self.final_losses
