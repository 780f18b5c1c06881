"""What the "Differential privacy" section of the model card states, and the checks it must pass to be rendered.

The trainer fills a :class:`DPModelCardData`; :mod:`hf_dp.release.model_card` turns it into Markdown after
:func:`privacy_segments` and :func:`check_card_data` have refused anything that would make the card state a guarantee
that was not computed (an estimate as the headline, an epsilon that contradicts the noise, a malformed audit).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ACCOUNTANT_LABELS", "AUDIT_KEYS", "DPModelCardData", "check_card_data", "privacy_segments"]

# Accountant key -> (label on the card, whether its epsilon is a proven upper bound).
ACCOUNTANT_LABELS: dict[str, tuple[str, bool]] = {
    "rdp": ("RDP", True),
    "prv": ("PRV", True),
    "gdp": ("GDP (CLT)", False),
}
AUDIT_KEYS = ("claimed_epsilon", "epsilon_lower_bound", "num_canaries", "significance", "delta")


@dataclass
class DPModelCardData:
    """Everything the DP section of the model card states. The trainer fills it; the card only renders it.

    Args:
        epsilons (`dict[str, float]`):
            Epsilon spent at `delta` under each accountant computed, keyed `"rdp"`, `"prv"` (the pessimistic
            privacy-loss-distribution bound, connect-the-dots, dp-accounting) or `"gdp"`. Must hold `accountant`. A
            `"gdp"` entry is shown as an estimate, never as a bound. Bounds are rounded up on the card.
        accountant (`str`):
            The headline accountant: `"rdp"` or `"prv"` (proven upper bounds). `"gdp"` is refused at rendering.
        delta (`float`):
            The delta of the guarantee, in (0, 1).
        expected_batch_size (`int`):
            Expected logical batch size L = q N of the current settings (shown when there is one segment).
        num_examples (`int`):
            N, the size of the training set.
        max_grad_norm (`float`):
            C, the per-example clipping norm.
        clipping_mode (`str`):
            How per-example norms were computed (`"bk"`, `"bk-mixopt"`, `"ghost"`, `"per-sample"`).
        poisson_sampling (`bool`):
            Whether logical batches were Poisson-sampled. If not, the card states that no guarantee is proven.
        optimizer (`str`):
            Name of the optimizer class that took the steps, e.g. `"AdamW"`.
        segments (`Sequence[tuple[float, float, int]]`, *optional*):
            The privacy history as `(noise_multiplier, sample_rate, steps)` segments, oldest first, e.g.
            `PrivacyAccountant.history`. Several segments arise when a run was resumed with changed settings; each
            gets its own row. If `None`, the legacy fields `noise_multiplier`, `sample_rate` and `steps` give one
            segment.
        noise_multiplier (`float`, *optional*):
            Legacy: sigma of a single-segment run. Give either `segments` or these three fields.
        sample_rate (`float`, *optional*):
            Legacy: q of a single-segment run.
        steps (`int`, *optional*):
            Legacy: noisy steps of a single-segment run.
        clipping_details (`str`, *optional*):
            Free text on the clipping policy (e.g. group-wise or automatic clipping), shown as its own row.
        secure_mode (`bool`, *optional*, defaults to `False`):
            Whether the noise came from a cryptographically secure generator (`secure_mode`) rather than torch's
            OS-seeded PRNG.
        fixed_noise_seed (`bool`, *optional*, defaults to `False`):
            Whether the run used a fixed `noise_seed` (a testing setting): anyone who knows it can regenerate and
            subtract the noise, so the card warns that the guarantee does not hold.
        published_training_metrics (`list[str]`, *optional*, defaults to `[]`):
            Names of un-noised statistics of the training data the user chose to publish (e.g. `["loss"]`). Empty: the
            card says none was written. Non-empty: a warning says they are not covered by the guarantee.
        audit (`dict`, *optional*):
            Result of an empirical privacy audit, with keys `claimed_epsilon`, `epsilon_lower_bound`,
            `num_canaries`, `significance`, `delta` and optionally `exposure`. Rendered as a "Privacy audit"
            subsection.
        epsilon_plot (`str`, *optional*):
            File name of a PNG of epsilon against the step, relative to the card (see `plot_epsilon_curve`).
        eval_checked (`bool`, *optional*, defaults to `False`):
            Whether hf_dp compared the trainer's `eval_dataset` with the training set (`hf_dp.release.eval_overlap`). If
            not, the card says only that evaluation metrics are computed on the data given for evaluation.
        eval_overlap (`list[str]`, *optional*, defaults to `[]`):
            One clause per evaluation set found to be or overlap the training set (`EvalOverlap.describe()`). Non-empty:
            a warning says that evaluation metrics were computed on training data and are not covered.
        eval_selection (`list[str]`, *optional*, defaults to `[]`):
            The settings that used those metrics (e.g. `load_best_model_at_end=True`) on an evaluation set that
            overlaps the training set (duplicates below the refusal threshold): the warning says that the choice of
            the released model is not covered either.
        user_column (`str`, *optional*):
            User-level DP (`privacy_unit="user"`): the column naming each row's user. `num_examples` and
            `expected_batch_size` then count users.
        max_examples_per_user (`int`, *optional*):
            With `user_column`: the most rows of one user in a logical batch.
        num_rows (`int`, *optional*):
            With `user_column`: the rows of the training set.
        adaptive_clipping (`dict`, *optional*):
            Quantile-adaptive clipping: `target_quantile`, `learning_rate`, `count_noise_multiplier`,
            `gradient_noise_multiplier` and `clip_norms` (the C of every step taken). `max_grad_norm` is then the
            starting C.
        eval_withheld (`list[str]`, *optional*, defaults to `[]`):
            Prefixes of the evaluation metrics computed on the training set (e.g. `"eval_"`) that were withheld from
            every written file.
        earlier_steps (`int`, *optional*, defaults to 0):
            Noisy steps of earlier runs in the same output folder that `segments` include (counted as spent).
        not_covered (`list[str]`, *optional*, defaults to `[]`):
            What the stated epsilon does not cover, one clause each (noisy steps whose record was lost, earlier runs
            left out): shown as a warning.
        banded_noise (`dict`, *optional*):
            Banded correlated noise (`noise_mechanism="banded-toeplitz"`): `bands` (b), `workload` (what the strategy
            was optimized for), `optimized_steps`, `sensitivity` (per participation, max column norm of C), `error`
            and `dpsgd_error` (the workload's RMSE per step in units of sigma C, for C and for DP-SGD's identity) and
            `state_bytes` (the noise state held in memory, never written). The segments' sample rate is then the
            rate of a part, q_part = b L / N, and epsilon after T steps is DP-SGD's of ceil(T / b) steps.

    Example:
        ```python
        data = DPModelCardData(
            epsilons={"rdp": 7.99, "prv": 6.83, "gdp": 5.9}, accountant="rdp", delta=1.25e-4,
            expected_batch_size=200, num_examples=4000, max_grad_norm=0.5, clipping_mode="bk-mixopt",
            poisson_sampling=True, optimizer="AdamW", segments=[(0.7415, 0.05, 160)],
        )
        section = render_dp_section(data)
        ```
    """

    epsilons: dict[str, float]
    accountant: str
    delta: float
    expected_batch_size: int
    num_examples: int
    max_grad_norm: float
    clipping_mode: str
    poisson_sampling: bool
    optimizer: str
    segments: Sequence[tuple[float, float, int]] | None = None
    noise_multiplier: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    clipping_details: str | None = None
    secure_mode: bool = False
    fixed_noise_seed: bool = False
    published_training_metrics: list[str] = field(default_factory=list)
    audit: dict[str, Any] | None = None
    epsilon_plot: str | None = None
    eval_checked: bool = False
    eval_overlap: list[str] = field(default_factory=list)
    eval_selection: list[str] = field(default_factory=list)
    user_column: str | None = None
    max_examples_per_user: int | None = None
    num_rows: int | None = None
    adaptive_clipping: dict[str, Any] | None = None
    eval_withheld: list[str] = field(default_factory=list)
    earlier_steps: int = 0
    not_covered: list[str] = field(default_factory=list)
    banded_noise: dict[str, Any] | None = None


def privacy_segments(data: DPModelCardData) -> list[tuple[float, float, int]]:
    """The privacy history of ``data`` as ``(noise_multiplier, sample_rate, steps)`` segments, oldest first: its
    `segments`, or the one segment of the legacy fields `noise_multiplier`, `sample_rate` and `steps`.

    Raises:
        ValueError: if both `segments` and a legacy field are given, the legacy fields are incomplete, or the
            history is empty or has a segment out of range.
    """
    legacy = {"noise_multiplier": data.noise_multiplier, "sample_rate": data.sample_rate, "steps": data.steps}
    given = [k for k, v in legacy.items() if v is not None]
    if data.segments is not None:
        if given:
            raise ValueError(
                f"Both `segments` and {', '.join(f'`{k}`' for k in given)} were given: give the privacy history once, "
                "as `segments` (a list of (noise_multiplier, sample_rate, steps))."
            )
        segments = [(float(s[0]), float(s[1]), int(s[2])) for s in data.segments]
    elif len(given) == len(legacy):
        segments = [(float(data.noise_multiplier), float(data.sample_rate), int(data.steps))]
    else:
        missing = [f"`{k}`" for k in legacy if legacy[k] is None]
        raise ValueError(
            f"The privacy history is incomplete ({', '.join(missing)} missing): set `segments` to a list of "
            "(noise_multiplier, sample_rate, steps), or all of `noise_multiplier`, `sample_rate` and `steps`."
        )
    if not segments:
        raise ValueError("`segments` is empty: give at least one (noise_multiplier, sample_rate, steps) segment.")
    for sigma, q, steps in segments:
        if not (math.isfinite(sigma) and sigma >= 0 and 0 <= q <= 1 and steps >= 0):
            raise ValueError(
                f"Invalid segment (noise_multiplier={sigma}, sample_rate={q}, steps={steps}): need a finite "
                "noise_multiplier >= 0, 0 <= sample_rate <= 1 and steps >= 0."
            )
    return segments


def check_card_data(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> None:
    """Refuse card data whose card would be false or malformed (``segments``: :func:`privacy_segments` of ``data``).

    Raises:
        ValueError: if the headline accountant is not a proven bound (`"gdp"`) or unknown, its epsilon is missing, an
            epsilon is negative, `delta` is not in (0, 1), an epsilon contradicts a noiseless segment, or
            `audit`/`epsilon_plot` are malformed.
        TypeError: if `published_training_metrics`, `eval_overlap` or `eval_selection` is a string, not a list.
    """
    _check_accountants(data)
    _check_epsilons_and_delta(data, segments)
    _check_release_fields(data)


def _check_accountants(data: DPModelCardData) -> None:
    """Every epsilon is under a known accountant, and the headline one is a proven bound that has an epsilon."""
    unknown = sorted(set(data.epsilons) - set(ACCOUNTANT_LABELS))
    if unknown:
        raise ValueError(
            f"Unknown accountant(s) {unknown} in `epsilons`: the keys must be in {sorted(ACCOUNTANT_LABELS)}."
        )
    proven = sorted(k for k, (_, is_bound) in ACCOUNTANT_LABELS.items() if is_bound)
    if data.accountant == "gdp":
        raise ValueError(
            "The headline accountant is 'gdp', but GDP (CLT) is an estimate that can under-estimate epsilon, not a "
            f"bound: set `accountant` to one of {proven} for the guarantee (a GDP figure may stay in `epsilons`; the "
            "card marks it as an estimate)."
        )
    if data.accountant not in proven:
        raise ValueError(f"Unknown headline accountant {data.accountant!r}: set `accountant` to one of {proven}.")
    if data.accountant not in data.epsilons:
        raise ValueError(
            f"`epsilons` has no entry for the headline accountant {data.accountant!r} (got {sorted(data.epsilons)}): "
            "add it."
        )


def _check_epsilons_and_delta(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> None:
    """Every epsilon is >= 0, `delta` is in (0, 1), and a noiseless step leaves the headline epsilon infinite."""
    for name, eps in data.epsilons.items():
        if not eps >= 0:  # also catches NaN
            raise ValueError(f"Epsilon under {name!r} is {eps}: it must be >= 0 (or inf).")
    if not 0 < data.delta < 1:
        raise ValueError(f"`delta` must be in (0, 1), got {data.delta}.")
    if not (math.isfinite(data.max_grad_norm) and data.max_grad_norm > 0):
        raise ValueError(
            f"`max_grad_norm` is {data.max_grad_norm}: without a finite clipping norm > 0 no example's contribution is "
            "bounded and no guarantee holds, so no card can state one."
        )
    noiseless = [s for s in segments if s[0] == 0 and s[2] > 0]
    if noiseless and math.isfinite(data.epsilons[data.accountant]):
        raise ValueError(
            f"A segment took {noiseless[0][2]} steps with noise_multiplier 0, so epsilon is infinite, but `epsilons` "
            f"says {data.epsilons[data.accountant]} under {data.accountant!r}: recompute `epsilons` from the same "
            "privacy history."
        )


def _check_release_fields(data: DPModelCardData) -> None:
    """The lists of names are lists, the plot is a file name relative to the card, and the audit has its keys."""
    for name in ("published_training_metrics", "eval_overlap", "eval_selection", "eval_withheld", "not_covered"):
        if isinstance(getattr(data, name), str):
            raise TypeError(f"`{name}` must be a list of strings, got str.")
    if data.epsilon_plot is not None and (os.path.isabs(data.epsilon_plot) or "://" in data.epsilon_plot):
        raise ValueError(
            f"`epsilon_plot` must be a file name relative to the card (e.g. 'epsilon.png'), got {data.epsilon_plot!r}."
        )
    if data.audit is not None:
        missing = [k for k in AUDIT_KEYS if k not in data.audit]
        if missing:
            raise ValueError(
                f"`audit` lacks the key(s) {missing}: it needs {list(AUDIT_KEYS)} (and may have `exposure`)."
            )
        if not 0 < data.audit["significance"] < 1:
            raise ValueError(f"`audit['significance']` must be in (0, 1), got {data.audit['significance']}.")
