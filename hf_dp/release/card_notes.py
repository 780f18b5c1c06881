"""The paragraphs of the "Differential privacy" card section around its table: what the guarantee does not hold for,
what it counts and leaves out, what was published, the evaluation data, the sampling, and the audit."""

from __future__ import annotations

import math
import textwrap

from .card_data import ACCOUNTANT_LABELS, DPModelCardData

__all__ = [
    "DROP",
    "coverage_note",
    "eval_note",
    "guarantee_note",
    "no_guarantee",
    "published_note",
    "sampling_note",
    "wrap",
]

DROP = "\x00drop-line\x00"  # an optional block left empty: its template line is removed


def wrap(text: str, prefix: str = "") -> str:
    """A paragraph wrapped at 120 characters like the template, each line starting with ``prefix`` (e.g. ``"> "``)."""
    return textwrap.fill(text, width=120, initial_indent=prefix, subsequent_indent=prefix, break_on_hyphens=False)


def no_guarantee(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> str | None:
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


def guarantee_note(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> str:
    none = no_guarantee(data, segments)
    if none is None:
        return DROP
    return "> [!WARNING]\n" + wrap(
        f"This model has {none}: its gradients were not privatised, so nothing on this card protects the training "
        "examples. The settings below are reported for the record; they are no privacy guarantee.",
        "> ",
    )


def coverage_note(data: DPModelCardData, segments: list[tuple[float, float, int]]) -> str:
    """What the epsilon includes besides this run's steps, and what it leaves out (a warning)."""
    parts = []
    if data.earlier_steps:
        total = sum(s[2] for s in segments)
        parts.append(
            wrap(
                f"The epsilon above counts {data.earlier_steps} of its {total} noisy steps from earlier runs recorded "
                "in the privacy ledger of the same output folder (e.g. a run that stopped before its first "
                "checkpoint): their steps ran on the training data, so they are spent privacy."
            )
        )
    if data.not_covered:
        items = "\n".join(wrap(f"- {clause}.", "> ") for clause in data.not_covered)
        parts.append(
            "> [!WARNING]\n"
            + wrap("Not covered by the guarantee above (hf_dp could not count them; see the privacy ledger):", "> ")
            + "\n"
            + items
        )
    return "\n\n".join(parts) if parts else DROP


def published_note(metrics: list[str], eval_on_training_data: bool = False) -> str:
    if not metrics:
        if eval_on_training_data:
            return wrap(
                "Apart from the evaluation metrics (computed on training data: see the warning below), no un-noised "
                "statistic of the training data (training loss, token counts, FLOs) was written to the released files."
            )
        return (
            "No un-noised statistic of the training data (training loss, token counts, FLOs) was written to the "
            "released files."
        )
    names = ", ".join(f"`{m}`" for m in metrics)
    return "> [!WARNING]\n" + wrap(
        f"These statistics of the training data were published without noise, at the user's request: {names}. They "
        "are NOT covered by the guarantee above and can reveal information about individual training examples.",
        "> ",
    )


def eval_note(data: DPModelCardData) -> str:
    if data.eval_overlap:
        what = "; ".join(data.eval_overlap)
        if data.eval_withheld:
            prefixes = ", ".join(f"`{p}*`" for p in data.eval_withheld)
            return wrap(
                f"The evaluation data overlaps the training set: {what}. Its metrics ({prefixes}) are un-noised "
                "statistics of the training data, so they were withheld from the released files (this card, the "
                "logs and metrics files written): no number computed on training data leaves with the model."
            )
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
        return "> [!WARNING]\n" + wrap(text, "> ")
    if data.eval_checked:
        where = (
            "evaluation data (the trainer's `eval_dataset`, compared with the training set by hf_dp: no overlap found)"
        )
    else:
        where = "the data given for evaluation, which hf_dp did not compare with the training set"
    return wrap(
        f"Evaluation metrics reported on this card or in the repository are computed on {where} and are not covered "
        "by the guarantee (the guarantee covers the training set only)."
    )


def sampling_note(data: DPModelCardData) -> str:
    """The warnings under the table when the epsilons assume more than the run did: Poisson sampling, secret noise."""
    notes = []
    if not data.poisson_sampling:
        notes.append(
            "> [!WARNING]\n"
            + wrap(
                "The accountants assume Poisson sampling; with shuffled fixed-size batches the epsilons above are a "
                "heuristic, not a proven bound.",
                "> ",
            )
        )
    if data.fixed_noise_seed:
        notes.append(
            "> [!WARNING]\n"
            + wrap(
                "This run used a fixed `noise_seed`, a setting for tests: anyone who knows the seed can regenerate "
                "the noise and subtract it, so the epsilon above is no guarantee for this model.",
                "> ",
            )
        )
    return "\n".join(notes) if notes else DROP
