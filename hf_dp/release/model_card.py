"""The "Differential privacy" section of the model card, rendered from the template shipped in ``hf_dp/templates/``.

The template is package data read with :mod:`importlib.resources`, so it is found in every kind of install (wheel,
``pip install --user``, ``--target``, zipped). ``model_cards/dp_model_card.md`` at the top of the repository is a
copy for readers; a test keeps the two identical.
"""

from __future__ import annotations

import logging
import math
import os
import re
import textwrap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from ..version import __version__
from .epsilon_plot import plot_epsilon_curve

logger = logging.getLogger(__name__)

__all__ = [
    "DP_TAGS",
    "NO_GUARANTEE_TAGS",
    "DPModelCardData",
    "card_tags",
    "format_bound",
    "has_guarantee",
    "plot_epsilon_curve",
    "render_dp_section",
    "template_path",
    "template_text",
    "write_dp_model_card",
]

#: Tags of a card that states a differential-privacy guarantee (finite epsilon).
DP_TAGS = ["differential-privacy", "hf-dp"]
#: Tags of a card of a run without a guarantee (epsilon infinite: noise multiplier 0): no `differential-privacy` tag.
NO_GUARANTEE_TAGS = ["hf-dp", "no-dp-guarantee"]
TEMPLATE_NAME = "dp_model_card.md"
SECTION_HEADING = "## Differential privacy"

# Accountant key -> (label on the card, whether its epsilon is a proven upper bound).
ACCOUNTANT_LABELS: dict[str, tuple[str, bool]] = {
    "rdp": ("RDP", True),
    "prv": ("PRV", True),
    "gdp": ("GDP (CLT)", False),
}
AUDIT_KEYS = ("claimed_epsilon", "epsilon_lower_bound", "num_canaries", "significance", "delta")

_DROP = "\x00drop-line\x00"  # an optional block left empty: its template line is removed


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


def _unit_fields(data: DPModelCardData) -> dict[str, str]:
    """The card's wording of the unit of privacy, the training set's size and the clipping norm."""
    if data.user_column is None:
        return {
            "unit_of_privacy": "one training example (one row of the training set)",
            "training_set_size": str(data.num_examples),
            "clipping_norm_label": "Per-example clipping norm (C)",
            "neighbouring": "one example",
        }
    rows = f" ({data.num_rows} rows)" if data.num_rows is not None else ""
    return {
        "unit_of_privacy": (
            f"one user (column `{data.user_column}`): all of a user's rows, at most {data.max_examples_per_user} "
            "examples per user in a logical batch, users Poisson-sampled"
        ),
        "training_set_size": f"{data.num_examples} users{rows}",
        "clipping_norm_label": "Per-user clipping norm (C, on the sum of a user's per-example gradients)",
        "neighbouring": "all the data of one user",
    }


def _adaptive_rows(data: DPModelCardData) -> str:
    """Rows of quantile-adaptive clipping: its settings, the noise split and the trajectory of C."""
    a = data.adaptive_clipping
    if not a:
        return _DROP
    norms = [float(c) for c in a.get("clip_norms", [])]
    if norms:
        path = (
            f"{_fmt(norms[0])} at the first step, {_fmt(norms[-1])} at the last ({len(norms)} steps; min "
            f"{_fmt(min(norms))}, max {_fmt(max(norms))})"
        )
    else:
        path = "no step taken yet"
    return "\n".join(
        [
            f"| Adaptive clipping (Andrew et al. 2021) | target unclipped quantile {a['target_quantile']:g}, learning "
            f"rate {a['learning_rate']:g}; C {path} |",
            f"| Noise split (adaptive clipping) | gradient sigma {_fmt(a['gradient_noise_multiplier'])}, count of "
            f"unclipped units sigma {_fmt(a['count_noise_multiplier'])}: together one Gaussian mechanism with the "
            "noise multiplier above |",
        ]
    )


def template_text(name: str = TEMPLATE_NAME) -> str:
    """The text of a card template shipped as package data in ``hf_dp/templates/``.

    Args:
        name (`str`, *optional*, defaults to `"dp_model_card.md"`): the template file.

    Returns:
        `str`: the template, with `string.Template` placeholders.
    """
    return resources.files(__package__).joinpath("templates", name).read_text(encoding="utf-8")


def template_path() -> Path:
    """Deprecated: the template may live in a zip; use :func:`template_text`."""
    warnings.warn("`template_path()` is deprecated; use `template_text()`.", FutureWarning, stacklevel=2)
    resource = resources.files(__package__).joinpath("templates", TEMPLATE_NAME)
    if not isinstance(resource, Path):
        raise FileNotFoundError(
            f"The template {resource} is not a file on disk (zipped install); use `template_text()`."
        )
    return resource


def format_bound(x: float, *, digits: int = 4, upper: bool = True) -> str:
    """Format a bound to `digits` significant digits, rounding away from the claim it supports.

    An upper bound (epsilon, delta) is rounded up and a lower bound down, so that the card never states a stronger
    guarantee (or a weaker attack) than was computed.

    Args:
        x (`float`): the value, >= 0 or `inf`.
        digits (`int`, *optional*, defaults to 4): significant digits.
        upper (`bool`, *optional*, defaults to `True`): round up (an upper bound) or down (a lower bound).

    Returns:
        `str`: e.g. `format_bound(7.98749) == "7.988"`, `format_bound(1e-5) == "1e-05"`.
    """
    if math.isinf(x):
        return "inf"
    if x == 0:
        return "0"
    exact = Decimal(repr(float(x)))  # repr: the shortest decimal that is this float, so 1e-05 stays 1e-05
    quantum = Decimal(1).scaleb(exact.adjusted() - digits + 1)
    rounded = float(exact.quantize(quantum, rounding=ROUND_CEILING if upper else ROUND_FLOOR))
    return f"{rounded:.{digits}g}"


def _wrap(text: str, prefix: str = "") -> str:
    """A paragraph wrapped at 120 characters like the template, each line starting with ``prefix`` (e.g. ``"> "``)."""
    return textwrap.fill(text, width=120, initial_indent=prefix, subsequent_indent=prefix, break_on_hyphens=False)


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


def _segments(data: DPModelCardData) -> list[tuple[float, float, int]]:
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
        if not (sigma >= 0 and 0 <= q <= 1 and steps >= 0):
            raise ValueError(
                f"Invalid segment (noise_multiplier={sigma}, sample_rate={q}, steps={steps}): need noise_multiplier "
                ">= 0, 0 <= sample_rate <= 1 and steps >= 0."
            )
    return segments


def _check(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> None:
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
    for name, eps in data.epsilons.items():
        if not eps >= 0:  # also catches NaN
            raise ValueError(f"Epsilon under {name!r} is {eps}: it must be >= 0 (or inf).")
    if not 0 < data.delta < 1:
        raise ValueError(f"`delta` must be in (0, 1), got {data.delta}.")
    noiseless = [s for s in segments if s[0] == 0 and s[2] > 0]
    if noiseless and math.isfinite(data.epsilons[data.accountant]):
        raise ValueError(
            f"A segment took {noiseless[0][2]} steps with noise_multiplier 0, so epsilon is infinite, but `epsilons` "
            f"says {data.epsilons[data.accountant]} under {data.accountant!r}: recompute `epsilons` from the same "
            "privacy history."
        )
    for name in ("published_training_metrics", "eval_overlap", "eval_selection"):
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


def _epsilon_rows(data: DPModelCardData) -> str:
    # Proven bounds first (the headline one leading), then estimates on rows of their own.
    names = sorted(data.epsilons, key=lambda k: (not ACCOUNTANT_LABELS[k][1], k != data.accountant, k))
    bound = "proven upper bound" if data.poisson_sampling else "not proven: assumes Poisson sampling"
    rows = []
    for name in names:
        label, is_bound = ACCOUNTANT_LABELS[name]
        eps = data.epsilons[name]
        if is_bound:
            rows.append(f"| Epsilon, {label} accountant | {format_bound(eps)} ({bound}) |")
        else:
            rows.append(f"| Epsilon, {label} accountant | {_fmt(eps)} (estimate, not a bound: can under-estimate) |")
    return "\n".join(rows)


def _noise_rows(segments: list[tuple[float, float, int]]) -> str:
    if len(segments) == 1:
        sigma, q, _ = segments[0]
        return f"| Noise multiplier (sigma) | {_fmt(sigma)} |\n| Sample rate (q) | {_fmt(q)} |"
    rows, start = [], 1
    for k, (sigma, q, steps) in enumerate(segments, start=1):
        span = f"steps {start}-{start + steps - 1}" if steps else "no steps"
        rows.append(f"| Segment {k} ({span}) | noise multiplier (sigma) {_fmt(sigma)}, sample rate (q) {_fmt(q)} |")
        start += steps
    return "\n".join(rows)


def _no_guarantee(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> str | None:
    """The clause "no differential-privacy guarantee (...)" when the headline epsilon is infinite, else `None`."""
    if not math.isinf(data.epsilons[data.accountant]):
        return None
    steps = sum(s[2] for s in segments)
    noiseless = sum(s[2] for s in segments if s[0] == 0)
    if noiseless and noiseless == steps:
        why = "noise multiplier 0"
    elif noiseless:
        why = f"noise multiplier 0 for {noiseless} of the {steps} steps"
    else:
        why = f"under the {ACCOUNTANT_LABELS[data.accountant][0]} accountant"
    return f"no differential-privacy guarantee ({why}, epsilon = inf)"


def has_guarantee(data: DPModelCardData) -> bool:
    """Whether the card states a finite epsilon under its headline accountant (what the `differential-privacy` tag
    claims)."""
    return not math.isinf(data.epsilons[data.accountant])


def card_tags(headline_epsilon: float) -> list[str]:
    """hf_dp's tags for a card whose headline epsilon is ``headline_epsilon``: :data:`DP_TAGS` if it is finite, else
    :data:`NO_GUARANTEE_TAGS` (no `differential-privacy` tag on a card without a guarantee)."""
    return list(NO_GUARANTEE_TAGS if math.isinf(headline_epsilon) else DP_TAGS)


def _guarantee_note(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> str:
    none = _no_guarantee(data, segments)
    if none is None:
        return _DROP
    return "> [!WARNING]\n" + _wrap(
        f"This model has {none}: its gradients were not privatised, so nothing on this card protects the training "
        "examples. The settings below are reported for the record; they are no privacy guarantee.",
        "> ",
    )


def _eval_note(data: DPModelCardData) -> str:
    if data.eval_overlap:
        what = "; ".join(data.eval_overlap)
        text = (
            f"The evaluation data overlaps the training set: {what}. Evaluation metrics reported on this card or in "
            "the repository were computed, without noise, on training data and are NOT covered by the guarantee; they "
            "can reveal information about individual training examples."
        )
        if data.eval_selection:
            text += (
                f" {', '.join(data.eval_selection)} used these metrics, so the choice of the released model depends on "
                "those training rows and is NOT covered by the guarantee either."
            )
        return "> [!WARNING]\n" + _wrap(text, "> ")
    if data.eval_checked:
        where = (
            "evaluation data (the trainer's `eval_dataset`, compared with the training set by hf_dp: no overlap found)"
        )
    else:
        where = "the data given for evaluation, which hf_dp did not compare with the training set"
    return _wrap(
        f"Evaluation metrics reported on this card or in the repository are computed on {where} and are not covered "
        "by the guarantee (the guarantee covers the training set only)."
    )


def _guarantee(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> str:
    label = ACCOUNTANT_LABELS[data.accountant][0]
    eps = data.epsilons[data.accountant]
    none = _no_guarantee(data, segments)
    if none is not None:
        return f"none: {none}"
    claim = f"({format_bound(eps)}, {format_bound(data.delta, digits=3)})-DP"
    if not data.poisson_sampling:
        return f"none proven: {claim} under the {label} accountant assumes Poisson sampling, which was not used"
    if data.fixed_noise_seed:
        return f"none: {claim} under the {label} accountant assumes secret noise, but a fixed `noise_seed` was used"
    return f"{claim} under the {label} accountant (a proven upper bound)"


def _published_note(metrics: list[str], eval_on_training_data: bool = False) -> str:
    if not metrics:
        if eval_on_training_data:
            return _wrap(
                "Apart from the evaluation metrics (computed on training data: see the warning below), no un-noised "
                "statistic of the training data (training loss, token counts, FLOs) was written to the released files."
            )
        return (
            "No un-noised statistic of the training data (training loss, token counts, FLOs) was written to the "
            "released files."
        )
    names = ", ".join(f"`{m}`" for m in metrics)
    return "> [!WARNING]\n" + _wrap(
        f"These statistics of the training data were published without noise, at the user's request: {names}. They "
        "are NOT covered by the guarantee above and can reveal information about individual training examples.",
        "> ",
    )


def _audit_block(audit: dict[str, Any] | None) -> str:
    if audit is None:
        return _DROP
    claimed, lower = float(audit["claimed_epsilon"]), float(audit["epsilon_lower_bound"])
    confidence = f"{(1 - float(audit['significance'])) * 100:.4g}%"
    rows = [
        "### Privacy audit",
        "",
        "| Quantity | Value |",
        "|---|---|",
        f"| Claimed epsilon | {format_bound(claimed)} |",
        f"| Empirical epsilon lower bound | {format_bound(lower, upper=False)} (at {confidence} confidence) |",
        f"| Canaries | {int(audit['num_canaries'])} |",
        f"| Significance | {audit['significance']:g} |",
        f"| Delta | {format_bound(float(audit['delta']), digits=3)} |",
    ]
    if audit.get("exposure") is not None:
        rows.append(f"| Exposure | {_fmt(float(audit['exposure']))} |")
    rows += [
        "",
        _wrap(
            "An empirical lower bound is what an attack on inserted canaries could demonstrate: one above the claimed "
            "epsilon exposes a broken implementation or accounting, but one below it does not prove the claimed upper "
            "bound."
        ),
    ]
    if lower > claimed:
        logger.warning("The audit's epsilon lower bound %s exceeds the claimed epsilon %s.", lower, claimed)
        rows += [
            "",
            "> [!WARNING]\n"
            + _wrap(
                "The empirical lower bound exceeds the claimed epsilon: the implementation or the accounting may be "
                "broken (or this is the chance failure at the stated significance). Do not rely on the guarantee "
                "until this is understood.",
                "> ",
            ),
        ]
    return "\n".join(rows)


def render_dp_section(data: DPModelCardData) -> str:
    """Render the "Differential privacy" section of the model card.

    Args:
        data (`DPModelCardData`): what the card states.

    Returns:
        `str`: the Markdown section, starting with `## Differential privacy`.

    Raises:
        ValueError: if the headline accountant is not a proven bound (`"gdp"`) or unknown, its epsilon is missing,
            the privacy history is missing, inconsistent or invalid, an epsilon contradicts a noiseless segment, or
            `audit`/`epsilon_plot` are malformed.
        TypeError: if `published_training_metrics` is a string instead of a list.

    Example:
        ```python
        section = render_dp_section(data)
        write_dp_model_card("out", section)
        ```
    """
    segments = _segments(data)
    _check(data, segments)
    steps = sum(s[2] for s in segments)
    if len(segments) == 1:
        batch_row = f"| Expected logical batch size | {data.expected_batch_size} |"
    else:
        sizes = ", ".join(_fmt(q * data.num_examples) for _, q, _ in segments)
        batch_row = f"| Expected logical batch size (q N, per segment) | {sizes} |"
    if data.poisson_sampling:
        unit = "user" if data.user_column is not None else "example"
        sampling, note = f"Poisson (each {unit} included independently with probability q)", _DROP
    else:
        sampling = "shuffled fixed-size batches (sampling without replacement)"
        note = "> [!WARNING]\n" + _wrap(
            "The accountants assume Poisson sampling; with shuffled fixed-size batches the epsilons above are a "
            "heuristic, not a proven bound.",
            "> ",
        )
    if data.fixed_noise_seed:
        noise_source = "a fixed `noise_seed` (testing setting): reproducible by anyone who knows it"
        note = "\n".join(
            part
            for part in (
                note if note != _DROP else "",
                "> [!WARNING]\n"
                + _wrap(
                    "This run used a fixed `noise_seed`, a setting for tests: anyone who knows the seed can regenerate "
                    "the noise and subtract it, so the epsilon above is no guarantee for this model.",
                    "> ",
                ),
            )
            if part
        )
    elif data.secure_mode:
        noise_source = "cryptographically secure (secure_mode)"
    else:
        noise_source = "OS-seeded PRNG (torch), re-seeded at every start; seed never written"
    plot = _DROP
    if data.epsilon_plot:
        label = ACCOUNTANT_LABELS[data.accountant][0]
        plot = f"![Epsilon spent against the optimizer step ({label} accountant)]({data.epsilon_plot})"
    text = Template(template_text()).substitute(
        hf_dp_version=__version__,
        guarantee=_guarantee(data, segments),
        guarantee_note=_guarantee_note(data, segments),
        epsilon_rows=_epsilon_rows(data),
        delta=format_bound(data.delta, digits=3),
        noise_rows=_noise_rows(segments),
        steps=steps,
        batch_row=batch_row,
        max_grad_norm=f"{data.max_grad_norm:g}" + (" (starting value)" if data.adaptive_clipping else ""),
        adaptive_rows=_adaptive_rows(data),
        **_unit_fields(data),
        clipping_mode=data.clipping_mode,
        clipping_details_row=f"| Clipping details | {data.clipping_details} |" if data.clipping_details else _DROP,
        sampling=sampling,
        optimizer=data.optimizer,
        noise_source=noise_source,
        sampling_note=note,
        epsilon_plot=plot,
        published_note=_published_note(list(data.published_training_metrics), bool(data.eval_overlap)),
        eval_note=_eval_note(data),
        audit=_audit_block(data.audit),
    )
    text = "\n".join(line for line in text.splitlines() if line != _DROP)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _replace_section(text: str, section: str) -> str:
    """Put `section` in place of every existing DP section (up to the next level-2 heading), or at the end."""
    lines = text.splitlines()
    out: list[str] = []
    placed = inside = False
    for line in lines:
        if line.strip() == SECTION_HEADING:
            inside = True
            if not placed:
                out.append(_DROP)
                placed = True
            continue
        if inside and line.startswith("## "):
            inside = False
        if not inside:
            out.append(line)
    body = "\n".join(out)
    block = section.strip()
    if placed:
        body = body.replace(_DROP, block + "\n")
    else:
        body = body.rstrip() + "\n\n" + block + "\n"
    return re.sub(r"\n{3,}", "\n\n", body).rstrip() + "\n"


def write_dp_model_card(output_dir: str, section: str, tags: Sequence[str] | None = None) -> None:
    """Add or replace the DP section and set hf_dp's tags in ``output_dir/README.md`` (a minimal card if there is none).

    An existing "Differential privacy" section is replaced in place, up to the next level-2 heading, so sections the
    user wrote after it are kept. hf_dp's tags are the only ones set here: the `differential-privacy` tag is added
    only with the section that states the guarantee, and an hf_dp tag the new section does not carry (a stale
    `differential-privacy` on a card that now states no guarantee) is removed.

    Args:
        output_dir (`str`): the folder of the saved model.
        section (`str`): the output of :func:`render_dp_section`.
        tags (`Sequence[str]`, *optional*): hf_dp's tags for this section, :func:`card_tags` of its data (default
            :data:`DP_TAGS`).

    Example:
        ```python
        write_dp_model_card("out", render_dp_section(data))
        ```
    """
    from huggingface_hub import ModelCard, ModelCardData

    path = os.path.join(output_dir, "README.md")
    if os.path.exists(path):
        card = ModelCard.load(path)
    else:
        name = os.path.basename(os.path.abspath(output_dir))
        card = ModelCard(f"---\n{ModelCardData().to_yaml()}\n---\n\n# {name}\n\nFine-tuned with hf_dp's DPTrainer.\n")
    tags = list(DP_TAGS if tags is None else tags)
    stale = set(DP_TAGS + NO_GUARANTEE_TAGS) - set(tags)
    card.data.tags = list(dict.fromkeys([*(t for t in card.data.tags or [] if t not in stale), *tags]))
    card.text = _replace_section(card.text, section)
    card.save(path)
