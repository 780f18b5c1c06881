"""`AuditResult`: what an audit found, and the fields a model card states."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["CARD_FIELDS", "AuditResult"]

#: The keys of `AuditResult.card_fields` (plus ``exposure`` when it was computed).
CARD_FIELDS = ("claimed_epsilon", "epsilon_lower_bound", "num_canaries", "significance", "delta")


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """The outcome of a one-run audit (Steinke, Nasr and Jagielski 2023).

    With probability at least ``1 - significance`` over the canaries' inclusion bits, a training run that is
    (epsilon, delta)-DP has ``epsilon >= epsilon_lower_bound``. A bound above ``claimed_epsilon`` is evidence that the
    claim is wrong (a bug that drops the noise or under-clips). A bound far below the claim proves nothing about the
    claim: the audit is a lower bound, and a weak attack (a few hundred canaries, black-box losses) gives small
    bounds even when the claim is tight.

    Attributes:
        claimed_epsilon (`float`): epsilon the run claims (``inf`` for non-private training).
        epsilon_lower_bound (`float`): the empirical lower bound.
        num_canaries (`int`): canaries drawn (m); each was included with probability 1/2.
        num_included (`int`): canaries that were in the training set.
        num_tested (`int`): canaries the bound is computed on (m, or half of them with ``selection="split"``).
        num_guesses (`int`): guesses made (r = k+ + k-).
        num_correct (`int`): right guesses (v).
        k_plus (`int`): canaries guessed "in" (highest scores).
        k_minus (`int`): canaries guessed "out" (lowest scores).
        significance (`float`): level of the test.
        delta (`float`): delta of the claim under test.
        selection (`str`): how k+/k- were chosen: ``"bonferroni"``, ``"split"`` or ``"fixed"``.
        num_choices (`int`): (k+, k-) pairs the Bonferroni correction paid for (1 otherwise).
        exposure (`float`, *optional*): mean exposure (bits) of the included canaries; None if not computed.
        exposure_excluded (`float`, *optional*): mean exposure of the excluded canaries (the baseline, about 1.44).
        num_alternatives (`int`): alternatives each secret was ranked among (0: no exposure).
    """

    claimed_epsilon: float
    epsilon_lower_bound: float
    num_canaries: int
    num_included: int
    num_tested: int
    num_guesses: int
    num_correct: int
    k_plus: int
    k_minus: int
    significance: float
    delta: float
    selection: str
    num_choices: int
    exposure: float | None = None
    exposure_excluded: float | None = None
    num_alternatives: int = 0

    @property
    def m(self) -> int:
        """Canaries the bound is computed on (the paper's m)."""
        return self.num_tested

    @property
    def r(self) -> int:
        """Guesses made (the paper's r)."""
        return self.num_guesses

    @property
    def v(self) -> int:
        """Right guesses (the paper's v)."""
        return self.num_correct

    @property
    def exceeds_claim(self) -> bool:
        """Whether the empirical lower bound is above the claimed epsilon (the claim is refuted at ``significance``)."""
        return self.epsilon_lower_bound > self.claimed_epsilon

    def card_fields(self) -> dict[str, Any]:
        """The fields a model card states: exactly ``claimed_epsilon, epsilon_lower_bound, num_canaries,
        significance, delta``, plus ``exposure`` when it was computed.

        Returns:
            `dict[str, Any]`: plain Python numbers (``claimed_epsilon`` is ``inf`` for non-private training).

        Example:
            ```python
            trainer.record_audit(result.card_fields())
            ```
        """
        fields = {
            "claimed_epsilon": float(self.claimed_epsilon),
            "epsilon_lower_bound": float(self.epsilon_lower_bound),
            "num_canaries": int(self.num_canaries),
            "significance": float(self.significance),
            "delta": float(self.delta),
        }
        if self.exposure is not None:
            fields["exposure"] = float(self.exposure)
        return fields

    def to_dict(self) -> dict[str, Any]:
        """All fields and ``exceeds_claim``, JSON-ready (an infinite ``claimed_epsilon`` becomes None)."""
        out = dataclasses.asdict(self)
        out["exceeds_claim"] = self.exceeds_claim
        if math.isinf(out["claimed_epsilon"]):
            out["claimed_epsilon"] = None
        return out
