"""From canary scores to guesses: "in" for the k+ highest scores, "out" for the k- lowest, abstain on the rest.

How many to guess is chosen after seeing the scores, so the choice must be paid for, or the bound is not valid:

- ``"bonferroni"`` (default): try every (k+, k-) of a small grid (`guess_grid`, G = 12 pairs) and test each at
  ``significance / G``; if training is (eps, delta)-DP, the chance that any of the G tests rejects eps is at most
  ``significance`` (union bound), so the largest bound over the grid is valid. All m canaries count; the price is
  the lower per-test level, small because binomial tails fall fast (250 right guesses out of 250 on m = 500:
  3.75 at 0.05/12 instead of 4.40 at 0.05).
- ``"split"``: a random half of the canaries (drawn independently of the inclusion bits) picks the fractions
  k+/m and k-/m that give the best bound there; the bound is then computed on the other half alone at the full
  significance. Valid because the guesses on the second half are a function of the model and of the first half's
  bits, which are independent of the second half's; it costs half the canaries.
- fixed ``k_plus`` / ``k_minus``: one test, no choice to pay for (for counts fixed before training).

Bonferroni is the default because it kept more power with a few hundred to a thousand canaries: on simulated
scores (70% of members shifted by mu standard deviations, mean of 6 draws) it gave 1.58 / 2.46 / 2.58 against the
split's 1.10 / 2.06 / 2.29 at m = 256 (mu = 2 / 4 / 8), and 2.33 / 3.68 / 3.87 against 2.28 / 3.42 / 3.66 at
m = 1000.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from .bounds import epsilon_lower_bound

__all__ = ["DEFAULT_FRACTIONS", "GuessChoice", "choose_guesses", "count_correct", "guess_grid"]

#: Fractions of the canaries that may be guessed "in" (k+); k- is 0 or k+ (see `guess_grid`).
DEFAULT_FRACTIONS: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)
SELECTIONS = ("bonferroni", "split")


@dataclasses.dataclass(frozen=True)
class GuessChoice:
    """The guesses behind a bound.

    Attributes:
        k_plus (`int`): canaries guessed "in" (the highest scores).
        k_minus (`int`): canaries guessed "out" (the lowest scores).
        r (`int`): guesses made, ``k_plus + k_minus``.
        v (`int`): right guesses.
        m (`int`): canaries the bound is computed on (half of them with ``selection="split"``).
        epsilon_lower_bound (`float`): the bound these guesses give.
        selection (`str`): ``"bonferroni"``, ``"split"`` or ``"fixed"``.
        num_choices (`int`): (k+, k-) pairs tried on the canaries that the bound is computed on (1 unless
            Bonferroni).
    """

    k_plus: int
    k_minus: int
    r: int
    v: int
    m: int
    epsilon_lower_bound: float
    selection: str
    num_choices: int


def _as_arrays(scores: Sequence[float], included: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(scores, dtype=np.float64)
    b = np.asarray(included)
    if s.ndim != 1 or b.shape != s.shape:
        raise ValueError(
            f"`scores` and `included` must be 1-D and of the same length, got shapes {s.shape} and {b.shape}."
        )
    if b.dtype != np.bool_:
        if not np.isin(b, (0, 1)).all():
            raise ValueError("`included` must hold booleans (or 0/1): the canaries' inclusion bits.")
        b = b.astype(bool)
    if not np.isfinite(s).all():
        bad = np.flatnonzero(~np.isfinite(s))[:5].tolist()
        raise ValueError(
            f"Canary scores must be finite, got non-finite scores at canaries {bad}: the model's loss on them "
            "overflowed or is NaN. Check the model and the canaries (e.g. a label outside the vocabulary)."
        )
    return s, b


def count_correct(scores: Sequence[float], included: Sequence[bool], k_plus: int, k_minus: int) -> tuple[int, int]:
    """Guess "in" for the ``k_plus`` highest scores and "out" for the ``k_minus`` lowest; count the right guesses.

    Ties are broken by canary index (a fixed order, independent of the inclusion bits).

    Args:
        scores (`Sequence[float]`): one score per canary; higher means more likely a member.
        included (`Sequence[bool]`): the canaries' inclusion bits.
        k_plus (`int`): how many to guess "in".
        k_minus (`int`): how many to guess "out".

    Returns:
        `tuple[int, int]`: ``(r, v)``, the guesses made and the right ones.

    Raises:
        ValueError: if ``k_plus + k_minus`` exceeds the number of canaries, or the inputs are malformed.
    """
    s, b = _as_arrays(scores, included)
    m = len(s)
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(f"Need 0 <= k_plus, k_minus and k_plus + k_minus <= m={m}, got {k_plus} and {k_minus}.")
    order = np.argsort(-s, kind="stable")
    right = int(b[order[:k_plus]].sum()) + int((~b[order[m - k_minus :]]).sum() if k_minus else 0)
    return k_plus + k_minus, right


def guess_grid(m: int, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> list[tuple[int, int]]:
    """The (k+, k-) pairs tried: k+ = round(f m) for f in ``fractions``, and k- = 0 or k- = k+ (k+ + k- <= m).

    Memorised members stand out at the top of the scores, while the bottom mixes non-members with members that
    were not memorised; so "in" guesses alone, or as many "out" as "in" guesses, cover the useful choices with few
    pairs (each pair tried lowers the per-test level under Bonferroni).

    Args:
        m (`int`): number of canaries.
        fractions (`Sequence[float]`): fractions in (0, 1].

    Returns:
        `list[tuple[int, int]]`: distinct pairs, each with at least one guess.
    """
    if any(not 0 < f <= 1 for f in fractions):
        raise ValueError(f"`fractions` must lie in (0, 1], got {list(fractions)}.")
    ks = sorted({max(1, round(f * m)) for f in fractions})
    pairs = {(k, 0) for k in ks} | {(k, k) for k in ks if 2 * k <= m}
    return sorted(pairs)


def _best_on(s, b, pairs, delta, level) -> tuple[float, tuple[int, int], int, int]:
    best = (-1.0, (0, 0), 0, 0)
    m = len(s)
    for kp, km in pairs:
        r, v = count_correct(s, b, kp, km)
        eps = epsilon_lower_bound(m, r, v, delta, level)
        if eps > best[0]:
            best = (eps, (kp, km), r, v)
    return best


def choose_guesses(
    scores: Sequence[float],
    included: Sequence[bool],
    *,
    delta: float,
    significance: float = 0.05,
    selection: str = "bonferroni",
    k_plus: int | None = None,
    k_minus: int | None = None,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    seed: int = 0,
) -> GuessChoice:
    """Choose how many canaries to guess and return the resulting valid lower bound.

    Args:
        scores (`Sequence[float]`): one score per canary; higher means more likely a member.
        included (`Sequence[bool]`): the canaries' inclusion bits.
        delta (`float`): delta of the DP claim under test.
        significance (`float`, *optional*, defaults to 0.05): overall level of the test.
        selection (`str`, *optional*, defaults to `"bonferroni"`): `"bonferroni"` or `"split"` (see the module
            docstring); ignored when `k_plus`/`k_minus` are given.
        k_plus (`int`, *optional*): fixed number of "in" guesses (with `k_minus`: no selection, one test).
        k_minus (`int`, *optional*): fixed number of "out" guesses.
        fractions (`Sequence[float]`, *optional*): the grid of fractions of the canaries to guess (see
            `guess_grid`).
        seed (`int`, *optional*, defaults to 0): seed of the random halves for `selection="split"`.

    Returns:
        `GuessChoice`: the counts and the bound.

    Raises:
        ValueError: for an unknown `selection`, only one of `k_plus`/`k_minus`, or malformed scores.
    """
    s, b = _as_arrays(scores, included)
    m = len(s)
    if m == 0:
        raise ValueError("No canaries to audit: pass at least one score.")
    if (k_plus is None) != (k_minus is None):
        raise ValueError(
            f"Pass both `k_plus` and `k_minus` (fixed guesses) or neither (chosen by `selection`), got "
            f"k_plus={k_plus}, k_minus={k_minus}."
        )
    if k_plus is not None:
        return _fixed(s, b, k_plus, k_minus, delta, significance)
    if selection == "bonferroni":
        return _bonferroni(s, b, fractions, delta, significance)
    if selection == "split":
        return _split(s, b, fractions, delta, significance, seed)
    raise ValueError(f"Unknown `selection` {selection!r}; choose one of {list(SELECTIONS)}.")


def _fixed(s: np.ndarray, b: np.ndarray, k_plus: int, k_minus: int, delta: float, significance: float) -> GuessChoice:
    """One test of the fixed guesses, at the full significance."""
    r, v = count_correct(s, b, k_plus, k_minus)
    eps = epsilon_lower_bound(len(s), r, v, delta, significance)
    return GuessChoice(k_plus, k_minus, r, v, len(s), eps, "fixed", 1)


def _bonferroni(
    s: np.ndarray, b: np.ndarray, fractions: Sequence[float], delta: float, significance: float
) -> GuessChoice:
    """The best bound over the grid of guesses, each tested at ``significance / G``."""
    m = len(s)
    pairs = guess_grid(m, fractions)
    eps, (kp, km), r, v = _best_on(s, b, pairs, delta, significance / len(pairs))
    return GuessChoice(kp, km, r, v, m, eps, "bonferroni", len(pairs))


def _split(
    s: np.ndarray, b: np.ndarray, fractions: Sequence[float], delta: float, significance: float, seed: int
) -> GuessChoice:
    """The fractions of guesses that do best on a random half, tested on the other half at the full significance."""
    m = len(s)
    if m < 4:
        raise ValueError(f"selection='split' needs at least 4 canaries, got {m}; use 'bonferroni'.")
    perm = np.random.default_rng(seed).permutation(m)
    tune, test = perm[: m // 2], perm[m // 2 :]
    tune_pairs = guess_grid(len(tune), fractions)
    _, (kp, km), _, _ = _best_on(s[tune], b[tune], tune_pairs, delta, significance)
    # The same fractions of the other half (what was chosen is a rate, not a count tied to the first half).
    m_test = len(test)
    kp = min(m_test, math.floor(kp * m_test / len(tune) + 0.5))
    km = min(m_test - kp, math.floor(km * m_test / len(tune) + 0.5))
    r, v = count_correct(s[test], b[test], kp, km)
    eps = epsilon_lower_bound(m_test, r, v, delta, significance)
    return GuessChoice(kp, km, r, v, m_test, eps, "split", 1)
