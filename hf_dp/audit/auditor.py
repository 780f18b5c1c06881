"""`CanaryAudit`: draws which canaries are trained on, hands the trainer a training set and a callback, and turns the
canaries' scores into an `AuditResult`.

The inclusion bits live here and nowhere else: the trainer sees a training set (its data plus the included
canaries) and a callback that scores all canaries alike.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from .callback import AuditCallback
from .canaries import _INCLUSION_STREAM, CanarySet, canary_rng
from .guesses import DEFAULT_FRACTIONS, GuessChoice, choose_guesses
from .result import AuditResult
from .scores import CanaryScores

__all__ = ["CanaryAudit"]


class _IncludedCanaries(torch.utils.data.Dataset):
    """The included canaries as a map-style dataset (canary ids in increasing order)."""

    def __init__(self, canaries: CanarySet, indices: list[int]) -> None:
        self.canaries = canaries
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.canaries[self.indices[i]]


class CanaryAudit:
    """A one-run privacy audit (Steinke, Nasr and Jagielski 2023) with canaries inserted into one training run.

    Each canary is included in the training set independently with probability 1/2. After training, the canaries
    whose loss dropped most are guessed "in" and those whose loss dropped least "out"; the number of right guesses
    gives a lower bound on the epsilon of the run, valid with probability ``1 - significance``.

    What it assumes: the bound holds for training that is DP with respect to each canary. `DPTrainer` derives
    ``q = L / N`` (and the calibrated sigma) from ``len(train_dataset)``, which counts the included canaries, so their
    number (one statistic, about m/2) shows in the run's settings; the trainer's own guarantee treats N as public, as
    DP-SGD usually does, and so does this audit.

    Args:
        canaries (`CanarySet`): the canaries (`CausalLMCanaries`, `MaskedLMCanaries`, `ClassificationCanaries`).
        seed (`int`, *optional*): seed of the inclusion bits (and of the exposure alternatives); None draws them
            from OS entropy. Use your own seed, not one derived from the trainer's.
        num_alternatives (`int`, *optional*): random alternatives each secret is ranked among for exposure;
            defaults to 100 for generative canaries and 0 (no exposure) for classification canaries.
        batch_size (`int`, *optional*, defaults to 64): canaries per forward pass when scoring.

    Example:
        ```python
        from hf_dp import DPTrainer, DPTrainingArguments
        from hf_dp.audit import CanaryAudit, CausalLMCanaries, candidate_token_ids

        canaries = CausalLMCanaries(500, candidate_token_ids(tokenizer), secret_length=8, seed=1)
        audit = CanaryAudit(canaries, seed=2)
        trainer = DPTrainer(model=model, args=args, train_dataset=audit.training_set(train_dataset),
                            data_collator=collator, callbacks=[audit.callback()])
        trainer.train()
        result = audit.result(claimed_epsilon=trainer.epsilon(), delta=trainer.delta)
        print(result.epsilon_lower_bound, result.card_fields())
        ```
    """

    def __init__(
        self,
        canaries: CanarySet,
        *,
        seed: int | None = None,
        num_alternatives: int | None = None,
        batch_size: int = 64,
    ) -> None:
        if not isinstance(canaries, CanarySet):
            raise TypeError(
                "`canaries` must be a CanarySet (CausalLMCanaries, MaskedLMCanaries or ClassificationCanaries), got "
                f"{type(canaries).__name__}"
            )
        self.canaries = canaries
        # Independent of the canaries' content (another stream), so a canary's text says nothing about its bit.
        self._included = canary_rng(seed, _INCLUSION_STREAM).random(len(canaries)) < 0.5
        if num_alternatives is None:
            num_alternatives = 100 if canaries.generative else 0
        self._scores = CanaryScores(canaries, batch_size=batch_size, num_alternatives=num_alternatives, seed=seed)

    @property
    def included(self) -> np.ndarray:
        """The inclusion bits (a copy): ``included[i]`` is whether canary ``i`` is in the training set."""
        return self._included.copy()

    @property
    def num_included(self) -> int:
        return int(self._included.sum())

    def training_set(self, dataset: Any = None) -> torch.utils.data.Dataset:
        """Your training data followed by the included canaries.

        Canary items are dicts of 1-D ``torch.long`` tensors (``input_ids``, ``attention_mask``, ``labels``) that
        your collator must pad like your own items; give a ``datasets.Dataset`` the torch format
        (``dataset.with_format("torch")``) so that all items look alike.

        Args:
            dataset (*optional*): a map-style dataset (a list of dicts works); None for canaries only.

        Returns:
            `torch.utils.data.Dataset`: ``dataset`` + the included canaries.
        """
        included = _IncludedCanaries(self.canaries, np.flatnonzero(self._included).tolist())
        if dataset is None:
            return included
        return torch.utils.data.ConcatDataset([dataset, included])

    def callback(self) -> AuditCallback:
        """A `TrainerCallback` that scores the canaries at the start and at the end of training."""
        return AuditCallback(self._scores)

    def score_initial(self, model: nn.Module) -> None:
        """Scores the canaries under the untrained ``model`` (instead of the callback's ``on_train_begin``)."""
        self._scores.record_initial(model)

    def score_final(self, model: nn.Module) -> None:
        """Scores the canaries under the trained ``model`` (instead of the callback's ``on_train_end``)."""
        self._scores.record_final(model)

    def scores(self) -> np.ndarray:
        """Initial minus final loss of every canary (higher: more likely a member)."""
        return self._scores.scores()

    def result(
        self,
        *,
        claimed_epsilon: float,
        delta: float,
        significance: float = 0.05,
        selection: str = "bonferroni",
        k_plus: int | None = None,
        k_minus: int | None = None,
        fractions: tuple[float, ...] = DEFAULT_FRACTIONS,
    ) -> AuditResult:
        """The lower bound on epsilon from this run's canaries, against the claim ``(claimed_epsilon, delta)``.

        Args:
            claimed_epsilon (`float`): epsilon the run claims, e.g. ``trainer.epsilon()``; ``math.inf`` for
                non-private training.
            delta (`float`): delta of the claim, e.g. ``trainer.delta`` (for non-private training, the delta the
                bound is stated at).
            significance (`float`, *optional*, defaults to 0.05): level of the test.
            selection (`str`, *optional*, defaults to `"bonferroni"`): how k+/k- are chosen (`"bonferroni"` or
                `"split"`, see `hf_dp.audit.guesses`).
            k_plus (`int`, *optional*): fixed "in" guesses (with `k_minus`; no selection).
            k_minus (`int`, *optional*): fixed "out" guesses.
            fractions (`tuple[float, ...]`, *optional*): the grid of k+/m tried.

        Returns:
            `AuditResult`

        Raises:
            RuntimeError: if the canaries were not scored before and after training.
            ValueError: if ``claimed_epsilon`` is negative or NaN, or ``delta`` is outside [0, 1].
        """
        if not (isinstance(claimed_epsilon, (int, float, np.floating)) and claimed_epsilon >= 0):
            raise ValueError(
                f"`claimed_epsilon` must be >= 0 (math.inf for non-private training), got {claimed_epsilon!r}."
            )
        scores = self._scores.scores()
        choice = choose_guesses(
            scores,
            self._included,
            delta=delta,
            significance=significance,
            selection=selection,
            k_plus=k_plus,
            k_minus=k_minus,
            fractions=fractions,
        )
        return self._result_of(choice, claimed_epsilon=claimed_epsilon, delta=delta, significance=significance)

    def _result_of(
        self, choice: GuessChoice, *, claimed_epsilon: float, delta: float, significance: float
    ) -> AuditResult:
        """The result of the guesses ``choice``, with the mean exposure of the included and of the excluded
        canaries (generative canaries; NaN for a side without canaries)."""
        exposures = self._scores.exposures
        exposure_in = exposure_out = None
        if exposures is not None:
            exposure_in = float(exposures[self._included].mean()) if self._included.any() else math.nan
            exposure_out = float(exposures[~self._included].mean()) if (~self._included).any() else math.nan
        return AuditResult(
            claimed_epsilon=float(claimed_epsilon),
            epsilon_lower_bound=float(choice.epsilon_lower_bound),
            num_canaries=len(self.canaries),
            num_included=self.num_included,
            num_tested=choice.m,
            num_guesses=choice.r,
            num_correct=choice.v,
            k_plus=choice.k_plus,
            k_minus=choice.k_minus,
            significance=float(significance),
            delta=float(delta),
            selection=choice.selection,
            num_choices=choice.num_choices,
            exposure=exposure_in,
            exposure_excluded=exposure_out,
            num_alternatives=self._scores.num_alternatives,
        )
