"""The "Differential privacy" section of the model card: rendered from the template shipped in
``hf_dp/release/templates/``, written into the saved model's ``README.md`` with hf_dp's tags.

What the section states is a :class:`~hf_dp.release.card_data.DPModelCardData` (:mod:`hf_dp.release.card_data`, which
also holds its checks); this module only words it. The template is package data read with :mod:`importlib.resources`,
so it is found in every kind of install (wheel, ``pip install --user``, ``--target``, zipped).
``model_cards/dp_model_card.md`` at the top of the repository is a copy for readers; a test keeps the two identical.
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from collections.abc import Sequence
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

from ..version import __version__
from .card_data import ACCOUNTANT_LABELS, DPModelCardData, check_card_data, privacy_segments
from .card_data import AUDIT_KEYS as AUDIT_KEYS  # re-exported: defined here before card_data.py
from .card_notes import (
    DROP,
    coverage_note,
    eval_note,
    guarantee_note,
    no_guarantee,
    published_note,
    sampling_note,
    wrap,
)
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


# The names of the two card-data checks in this module before card_data.py; still importable from here.
_segments, _check = privacy_segments, check_card_data


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
        return DROP
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
    """The text of a card template shipped as package data in ``hf_dp/release/templates/``.

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


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.4g}"


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


def _noise_rows(segments: list[tuple[float, float, int]], *, banded: bool = False) -> str:
    if len(segments) == 1:
        sigma, q, _ = segments[0]
        rate = "Sample rate of the sampled part (q_part)" if banded else "Sample rate (q)"
        return f"| Noise multiplier (sigma) | {_fmt(sigma)} |\n| {rate} | {_fmt(q)} |"
    rows, start = [], 1
    for k, (sigma, q, steps) in enumerate(segments, start=1):
        span = f"steps {start}-{start + steps - 1}" if steps else "no steps"
        rows.append(f"| Segment {k} ({span}) | noise multiplier (sigma) {_fmt(sigma)}, sample rate (q) {_fmt(q)} |")
        start += steps
    return "\n".join(rows)


def has_guarantee(data: DPModelCardData) -> bool:
    """Whether the card states a finite epsilon under its headline accountant (what the `differential-privacy` tag
    claims)."""
    return not math.isinf(data.epsilons[data.accountant])


def card_tags(headline_epsilon: float) -> list[str]:
    """hf_dp's tags for a card whose headline epsilon is ``headline_epsilon``: :data:`DP_TAGS` if it is finite, else
    :data:`NO_GUARANTEE_TAGS` (no `differential-privacy` tag on a card without a guarantee)."""
    return list(NO_GUARANTEE_TAGS if math.isinf(headline_epsilon) else DP_TAGS)


def _guarantee(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> str:
    label = ACCOUNTANT_LABELS[data.accountant][0]
    eps = data.epsilons[data.accountant]
    none = no_guarantee(data, segments)
    if none is not None:
        return f"none: {none}"
    claim = f"({format_bound(eps)}, {format_bound(data.delta, digits=3)})-DP"
    if not data.poisson_sampling:
        return f"none proven: {claim} under the {label} accountant assumes Poisson sampling, which was not used"
    if data.fixed_noise_seed:
        return f"none: {claim} under the {label} accountant assumes secret noise, but a fixed `noise_seed` was used"
    return f"{claim} under the {label} accountant (a proven upper bound)"


def _audit_block(audit: dict[str, Any] | None) -> str:
    if audit is None:
        return DROP
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
        wrap(
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
            + wrap(
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
    segments = privacy_segments(data)
    check_card_data(data, segments)
    text = Template(template_text()).substitute(_template_fields(data, segments))
    text = "\n".join(line for line in text.splitlines() if line != DROP)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _template_fields(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> dict[str, Any]:
    """The value of every placeholder of the template (an optional block left empty is :data:`DROP`)."""
    return {
        "batch_row": _batch_row(data, segments),
        "sampling": _sampling_scheme(data),
        "sampling_note": sampling_note(data),
        "noise_source": _noise_source(data),
        "epsilon_plot": _epsilon_plot(data),
        "hf_dp_version": __version__,
        "guarantee": _guarantee(data, segments),
        "guarantee_note": guarantee_note(data, segments),
        "coverage_note": coverage_note(data, segments),
        "epsilon_rows": _epsilon_rows(data),
        "delta": format_bound(data.delta, digits=3),
        "noise_rows": _noise_rows(segments, banded=data.banded_noise is not None),
        "mechanism_rows": _mechanism_rows(data),
        "steps": sum(s[2] for s in segments),
        "max_grad_norm": f"{data.max_grad_norm:g}" + (" (starting value)" if data.adaptive_clipping else ""),
        "adaptive_rows": _adaptive_rows(data),
        **_unit_fields(data),
        "clipping_mode": data.clipping_mode,
        "clipping_details_row": f"| Clipping details | {data.clipping_details} |" if data.clipping_details else DROP,
        "optimizer": data.optimizer,
        "published_note": published_note(
            list(data.published_training_metrics), bool(data.eval_overlap) and not data.eval_withheld
        ),
        "eval_note": eval_note(data),
        "audit": _audit_block(data.audit),
    }


def _batch_row(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> str:
    """The expected logical batch size: one row, or the q N of every segment when the settings changed."""
    if len(segments) == 1:
        return f"| Expected logical batch size | {data.expected_batch_size} |"
    sizes = ", ".join(_fmt(q * data.num_examples) for _, q, _ in segments)
    return f"| Expected logical batch size (q N, per segment) | {sizes} |"


def _mechanism_rows(data: DPModelCardData) -> str:
    """Banded correlated noise: the mechanism, its strategy and its noise state (DP-SGD's card has no such row)."""
    banded = data.banded_noise
    if banded is None:
        return DROP
    b = banded["bands"]
    rows = [
        f"| Noise mechanism | banded matrix factorization (banded Toeplitz C, b = {b} bands): step t adds row t of "
        f"C^-1 Z times sigma C; epsilon after T steps is DP-SGD's of ceil(T / {b}) steps at (sigma, q_part) |"
    ]
    if banded.get("error") is not None:
        rows.append(
            f"| Noise strategy | optimized for {banded['workload']} over {banded['optimized_steps']} steps; "
            f"sensitivity {_fmt(banded['sensitivity'])} per participation; error {_fmt(banded['error'])} x sigma C "
            f"per step (DP-SGD: {_fmt(banded['dpsgd_error'])}) |"
        )
    rows.append(
        f"| Noise state | the last b - 1 = {b - 1} rows of C^-1 Z ({_fmt(banded['state_bytes'] / 2**20)} MiB, the "
        "trainable parameters' shape), held in memory only: never written or uploaded |"
    )
    return "\n".join(rows)


def _sampling_scheme(data: DPModelCardData) -> str:
    unit = "user" if data.user_column is not None else "example"
    if data.banded_noise is not None:
        b = data.banded_noise["bands"]
        return (
            f"cyclic Poisson (each {unit} put in one of b = {b} fixed parts at random, from a secret seed; step t "
            f"samples part t mod {b}, each of its {unit}s included independently with probability q_part)"
        )
    if data.poisson_sampling:
        return f"Poisson (each {unit} included independently with probability q)"
    return "shuffled fixed-size batches (sampling without replacement)"


def _noise_source(data: DPModelCardData) -> str:
    if data.fixed_noise_seed:
        return "a fixed `noise_seed` (testing setting): reproducible by anyone who knows it"
    if data.secure_mode:
        return "cryptographically secure (secure_mode)"
    return "OS-seeded PRNG (torch), re-seeded at every start; seed never written"


def _epsilon_plot(data: DPModelCardData) -> str:
    if not data.epsilon_plot:
        return DROP
    label = ACCOUNTANT_LABELS[data.accountant][0]
    return f"![Epsilon spent against the optimizer step ({label} accountant)]({data.epsilon_plot})"


def _replace_section(text: str, section: str) -> str:
    """Put `section` in place of every existing DP section (up to the next level-2 heading), or at the end."""
    lines = text.splitlines()
    out: list[str] = []
    placed = inside = False
    for line in lines:
        if line.strip() == SECTION_HEADING:
            inside = True
            if not placed:
                out.append(DROP)
                placed = True
            continue
        if inside and line.startswith("## "):
            inside = False
        if not inside:
            out.append(line)
    body = "\n".join(out)
    block = section.strip()
    if placed:
        body = body.replace(DROP, block + "\n")
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
