"""``PrivacyAccountant``: the history of a training run, for any accountant, with checkpointable state."""

from __future__ import annotations

from typing import Any

from .methods import check_proven_accountant, segments_epsilon
from .validation import check_delta, check_noise_multiplier, check_sample_rate, check_segments

__all__ = ["PrivacyAccountant"]


class PrivacyAccountant:
    """Keeps ``[noise_multiplier, sample_rate, steps]`` segments, so that composition stays exact when sigma or the
    sample rate changes mid-training, and evaluates epsilon under any accountant.

    Args:
        noise_multiplier (`float`, *optional*): sigma used by :meth:`step` when none is given.
        sample_rate (`float`, *optional*): q used by :meth:`step` when none is given.
        accountant (`str`, *optional*, defaults to `"rdp"`): the headline accountant, the default for :meth:`epsilon`;
            one of ``PROVEN_ACCOUNTANTS`` (`"rdp"`, `"prv"`). `"gdp"` is refused here (an estimate, not a bound) but
            can be asked for per call: ``epsilon(delta, accountant="gdp")``.

    Raises:
        ValueError: for an unknown accountant or `"gdp"`.

    Example:
        ```python
        acc = PrivacyAccountant(noise_multiplier=1.0, sample_rate=0.01)
        acc.step(100)
        acc.epsilon(1e-5)  # RDP
        acc.epsilon(1e-5, accountant="prv")
        ```
    """

    def __init__(
        self, noise_multiplier: float | None = None, sample_rate: float | None = None, accountant: str = "rdp"
    ) -> None:
        check_proven_accountant(accountant)
        self.noise_multiplier = noise_multiplier
        self.sample_rate = sample_rate
        self.accountant = accountant
        self.history: list[list[float]] = []

    @property
    def steps(self) -> int:
        """Total number of steps taken."""
        return int(sum(segment[2] for segment in self.history))

    def step(self, n: int = 1, *, noise_multiplier: float | None = None, sample_rate: float | None = None) -> None:
        """Record ``n`` noisy steps."""
        sigma = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        q = self.sample_rate if sample_rate is None else sample_rate
        if sigma is None or q is None:
            raise ValueError("`noise_multiplier` and `sample_rate` must be given (here or in the constructor).")
        check_noise_multiplier(sigma)
        check_sample_rate(q)
        if n < 0:
            raise ValueError(f"`n` must be >= 0, got {n}.")
        if self.history and self.history[-1][0] == sigma and self.history[-1][1] == q:
            self.history[-1][2] += n
        else:
            self.history.append([float(sigma), float(q), int(n)])

    def epsilon(self, delta: float, accountant: str | None = None) -> float:
        """Epsilon spent so far at ``delta`` under ``accountant`` (default: the one given at construction; any key of
        ``ACCOUNTANTS``, so `"gdp"` gives its estimate)."""
        check_delta(delta)
        return segments_epsilon([tuple(s) for s in self.history], delta, accountant or self.accountant)

    def get_epsilon(self, delta: float) -> float:
        """Opacus-style alias of :meth:`epsilon` with the default accountant."""
        return self.epsilon(delta)

    def state_dict(self) -> dict[str, Any]:
        """The history and settings, as plain Python values (JSON-serialisable)."""
        return {
            "history": [list(s) for s in self.history],
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "accountant": self.accountant,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: for a malformed history, or a saved headline accountant that is not a proven bound.
        """
        accountant = state.get("accountant", self.accountant)
        check_proven_accountant(accountant)
        self.history = [list(s) for s in check_segments(state["history"], "history")]
        self.noise_multiplier = state.get("noise_multiplier", self.noise_multiplier)
        self.sample_rate = state.get("sample_rate", self.sample_rate)
        self.accountant = accountant
