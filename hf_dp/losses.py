"""Per-example losses: entry ``i`` depends on example ``i`` alone (DESIGN §4 rule 1).

HF models' built-in losses average over all tokens of the batch (and ``num_items_in_batch`` across accumulation),
which couples examples; these compute one loss per example from the model's outputs and the batch's label tensors.
Each loss type names the label tensors it reads (:data:`LABEL_NAMES`); ``label_smoothing`` follows the Trainer's
``label_smoothing_factor`` (``(1 - eps) * NLL + eps * mean_k(-log p_k)`` per token, as HF's ``LabelSmoother``),
applied per example.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "LABEL_NAMES",
    "LOSS_TYPES",
    "PER_EXAMPLE_LOSSES",
    "causal_lm_loss",
    "infer_loss_type",
    "masked_lm_loss",
    "multiple_choice_loss",
    "per_example_loss",
    "question_answering_loss",
    "seq2seq_lm_loss",
    "sequence_classification_loss",
    "token_classification_loss",
    "token_loss",
]

IGNORE_INDEX = -100


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` must be 'mean' or 'sum', got {reduction!r}.")


def _float(logits: Tensor) -> Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def token_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` cross-entropy per example over its own labelled positions (``labels != -100``).

    Args:
        logits (`torch.Tensor`): ``[B, T, V]``.
        labels (`torch.Tensor`): ``[B, T]``, ``-100`` where no loss is taken.
        reduction (`str`): ``"mean"`` over the example's own labelled tokens, or ``"sum"``.
        label_smoothing (`float`): the Trainer's ``label_smoothing_factor``.
    """
    _check_reduction(reduction)
    logits = _float(logits)
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(labels.shape)
    total = per_token.sum(1)
    if reduction == "sum":
        return total
    count = (labels != IGNORE_INDEX).sum(1).clamp_min(1)
    return total / count


def causal_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` next-token loss: position ``t`` predicts ``labels[t + 1]`` (the usual shift)."""
    return token_loss(logits[:, :-1, :], labels[:, 1:], reduction=reduction, label_smoothing=label_smoothing)


def masked_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` masked-LM / prompt-infilling loss on the positions whose label is not ``-100`` (no shift)."""
    return token_loss(logits, labels, reduction=reduction, label_smoothing=label_smoothing)


def seq2seq_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` decoder loss of an encoder-decoder model: logits are already aligned with labels (no shift)."""
    return token_loss(logits, labels, reduction=reduction, label_smoothing=label_smoothing)


def token_classification_loss(
    logits: Tensor, labels: Tensor, *, reduction: str = "mean", label_smoothing: float = 0.0
) -> Tensor:
    """``[B]`` token-classification loss over each example's labelled tokens."""
    return token_loss(logits, labels, reduction=reduction, label_smoothing=label_smoothing)


def sequence_classification_loss(logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` loss of a classification head: cross-entropy, or squared error for one regression output."""
    if logits.shape[-1] == 1 and labels.is_floating_point():
        if label_smoothing:
            raise ValueError(
                f"`label_smoothing_factor`={label_smoothing} does not apply to a regression head (one output, float "
                "labels). Set `label_smoothing_factor=0`."
            )
        return (logits.squeeze(-1) - labels.to(logits.dtype)).pow(2)
    if labels.is_floating_point() and labels.shape == logits.shape:
        raise ValueError(
            "Multi-label classification (float labels of shape [B, num_labels]) needs a per-example BCE loss: pass "
            "`compute_loss_func(outputs, labels)` returning one loss per example."
        )
    return torch.nn.functional.cross_entropy(
        _float(logits), labels.view(-1), reduction="none", label_smoothing=label_smoothing
    )


def multiple_choice_loss(logits: Tensor, labels: Tensor, *, label_smoothing: float = 0.0) -> Tensor:
    """``[B]`` cross-entropy over the choices (``logits``: ``[B, num_choices]``)."""
    return torch.nn.functional.cross_entropy(
        _float(logits), labels.view(-1), reduction="none", label_smoothing=label_smoothing
    )


def question_answering_loss(
    start_logits: Tensor,
    end_logits: Tensor,
    start_positions: Tensor,
    end_positions: Tensor,
    *,
    label_smoothing: float = 0.0,
) -> Tensor:
    """``[B]`` extractive-QA loss: the mean of the start and end cross-entropies of each example.

    As in HF's QA heads, positions outside the sequence are clamped to ``T`` and then ignored (that term is 0).
    """
    length = start_logits.shape[1]

    def span_loss(logits: Tensor, positions: Tensor) -> Tensor:
        positions = positions.reshape(-1).clamp(0, length)
        return torch.nn.functional.cross_entropy(
            _float(logits), positions, ignore_index=length, reduction="none", label_smoothing=label_smoothing
        )

    return (span_loss(start_logits, start_positions) + span_loss(end_logits, end_positions)) / 2


def _logits(outputs: Any, name: str = "logits") -> Tensor:
    if isinstance(outputs, Mapping):
        if name not in outputs:
            raise ValueError(f"The model's outputs have no `{name}` (keys: {sorted(outputs)}).")
        return outputs[name]
    return outputs[0] if name in ("logits", "start_logits") else outputs[1]


def _token_type_loss(fn):
    def loss(outputs, labels, *, reduction, label_smoothing):
        return fn(_logits(outputs), labels["labels"], reduction=reduction, label_smoothing=label_smoothing)

    return loss


def _causal(outputs, labels, *, reduction, label_smoothing):
    if "shift_labels" in labels:  # labels already shifted by the collator: no second shift
        return token_loss(
            _logits(outputs), labels["shift_labels"], reduction=reduction, label_smoothing=label_smoothing
        )
    return causal_lm_loss(_logits(outputs), labels["labels"], reduction=reduction, label_smoothing=label_smoothing)


def _sequence(outputs, labels, *, reduction, label_smoothing):
    return sequence_classification_loss(_logits(outputs), labels["labels"], label_smoothing=label_smoothing)


def _choice(outputs, labels, *, reduction, label_smoothing):
    return multiple_choice_loss(_logits(outputs), labels["labels"], label_smoothing=label_smoothing)


def _span(outputs, labels, *, reduction, label_smoothing):
    return question_answering_loss(
        _logits(outputs, "start_logits"),
        _logits(outputs, "end_logits"),
        labels["start_positions"],
        labels["end_positions"],
        label_smoothing=label_smoothing,
    )


#: loss_type -> function(outputs, labels: dict, *, reduction, label_smoothing) returning ``[B]``.
PER_EXAMPLE_LOSSES = {
    "causal_lm": _causal,
    "masked_lm": _token_type_loss(masked_lm_loss),
    "seq2seq_lm": _token_type_loss(seq2seq_lm_loss),
    "sequence_classification": _sequence,
    "token_classification": _token_type_loss(token_classification_loss),
    "question_answering": _span,
    "multiple_choice": _choice,
}
#: loss_type -> the label tensors it reads (``causal_lm`` also reads ``shift_labels`` when the batch has them).
LABEL_NAMES: dict[str, tuple[str, ...]] = {
    "causal_lm": ("labels",),
    "masked_lm": ("labels",),
    "seq2seq_lm": ("labels",),
    "sequence_classification": ("labels",),
    "token_classification": ("labels",),
    "question_answering": ("start_positions", "end_positions"),
    "multiple_choice": ("labels",),
}
LOSS_TYPES = sorted(PER_EXAMPLE_LOSSES)


def per_example_loss(
    loss_type: str,
    outputs: Any,
    labels: Mapping[str, Tensor],
    *,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``[B]`` loss of ``loss_type`` from the model's ``outputs`` and the batch's label tensors.

    Raises:
        ValueError: an unknown loss type, or a label tensor the loss type needs is missing from the batch.
    """
    if loss_type not in PER_EXAMPLE_LOSSES:
        raise ValueError(f"Unknown `loss_type` {loss_type!r}. Choose one of {LOSS_TYPES}.")
    missing = [name for name in LABEL_NAMES[loss_type] if name not in labels and name != "labels"]
    if "labels" in LABEL_NAMES[loss_type] and "labels" not in labels and "shift_labels" not in labels:
        missing.append("labels")
    if missing:
        raise ValueError(
            f"The {loss_type!r} per-example loss needs {missing} in every batch (got {sorted(labels)}); add them in "
            "the data collator (e.g. DataCollatorForLanguageModeling for a causal LM), or set `label_names`."
        )
    return PER_EXAMPLE_LOSSES[loss_type](outputs, labels, reduction=reduction, label_smoothing=label_smoothing)


_CLASS_SUFFIXES = (
    ("ForConditionalGeneration", "seq2seq_lm"),
    ("ForQuestionAnswering", "question_answering"),
    ("ForMultipleChoice", "multiple_choice"),
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForTokenClassification", "token_classification"),
)


def infer_loss_type(model) -> str:
    """The per-example loss for a model, from its class name (PEFT models: their base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    encoder_decoder = bool(getattr(getattr(base, "config", None), "is_encoder_decoder", False))
    for suffix, loss_type in _CLASS_SUFFIXES:
        if suffix in name and (loss_type != "seq2seq_lm" or encoder_decoder):
            return loss_type
    if encoder_decoder:
        return "seq2seq_lm"
    raise ValueError(
        f"Cannot tell which per-example loss {name} needs. Set `loss_type` in DPTrainingArguments to one of "
        f"{LOSS_TYPES}, or pass `compute_loss_func(outputs, labels)` returning one loss per example."
    )
