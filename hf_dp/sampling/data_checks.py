"""Training data DP training would learn nothing from: refused before the first step, with what to look at.

A DP step adds noise whatever the data: on a training set whose examples have no target (every label ``-100``, which
the loss ignores) or no token at all, training would run on the noise alone, and nothing would say so. Before
training, a sample of the training set's rows (evenly spaced, all of them for a small set) is checked here, before
collation (the collator is not called: a recording or random collator would see calls that are not training); every
micro-batch is checked for sequences of length 0 too (its shapes only: no device read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..losses import target_counts

__all__ = ["check_training_rows", "empty_sequences", "row_targets", "sequence_length"]

#: Model inputs whose second dimension is the sequence.
SEQUENCE_KEYS = ("input_ids", "inputs_embeds", "decoder_input_ids", "input_values", "input_features")


def empty_sequences(batch: Mapping[str, Any]) -> str | None:
    """The name and shape of a sequence input of length 0 in ``batch`` (host metadata only: no device read)."""
    for key in SEQUENCE_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] > 0 and value.shape[1] == 0:
            return f"`{key}` of shape {tuple(value.shape)}"
    return None


def row_targets(loss_type: str, row: Mapping[str, Any]) -> int | None:
    """How many tokens of one training row (before collation) the loss of ``loss_type`` learns from: its ``labels``
    that are not ``-100`` (after the one-token shift for causal LM); `None` when the row carries no token labels (a
    collator builds them, or the loss has one target per example)."""
    labels = row.get("shift_labels", row.get("labels")) if isinstance(row, Mapping) else None
    if labels is None:
        return None
    labels = torch.as_tensor(labels)
    if labels.dim() != 1:
        return None
    key = "shift_labels" if "shift_labels" in row else "labels"
    counts = target_counts(loss_type, {key: labels[None]})
    return None if counts is None else int(counts[0])


def sequence_length(row: Mapping[str, Any]) -> int | None:
    """The length of a training row's token sequence (before collation), `None` if it has none."""
    if not isinstance(row, Mapping):
        return None
    for key in SEQUENCE_KEYS:
        value = row.get(key)
        if value is not None and hasattr(value, "__len__"):
            return len(value)
    return None


def check_training_rows(rows: Iterable[Mapping[str, Any]], target_count, *, total: int) -> None:
    """Refuse a training set whose sampled ``rows`` (of its ``total``) all have sequences of length 0, or together not
    one target to learn (``target_count(row)``: a row's targets, `None` if unknown). Reads rows until one has both a
    token and a target (usually the first).

    Raises:
        ValueError: with what to check in the data preparation.
    """
    checked, has_tokens, has_targets = 0, False, False
    for row in rows:
        checked += 1
        has_tokens = has_tokens or sequence_length(row) != 0
        has_targets = has_targets or target_count(row) != 0
        if has_tokens and has_targets:
            return
    which = "all" if checked == total else f"{checked} evenly spaced"
    if checked and not has_tokens:
        raise ValueError(
            f"The training examples have no tokens: every sequence is of length 0 ({which} of the {total} rows "
            "checked), so there is nothing to train on. Check the tokenization (the text column, `max_length`, "
            "truncation or filtering that emptied the rows)."
        )
    if checked and not has_targets:
        raise ValueError(
            f"None of the training examples checked ({which} of the {total} rows) has a target to learn: every "
            "label is -100, which the loss ignores, so each example's gradient is zero and training would run on the "
            "noise alone. Check how the labels are built (e.g. `completion_only_loss` or `assistant_only_loss` "
            "masking every token, prompts longer than `max_length`, or labels set to -100)."
        )
