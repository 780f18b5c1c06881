"""Per-example losses: entry ``i`` depends on example ``i`` alone (DESIGN §4 rule 1).

HF models' built-in losses average over all tokens of the batch (and ``num_items_in_batch`` across accumulation),
which couples examples; these compute one loss per sequence from logits and labels instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "PER_EXAMPLE_LOSSES",
    "causal_lm_loss",
    "infer_loss_type",
    "masked_lm_loss",
    "seq2seq_lm_loss",
    "sequence_classification_loss",
    "token_classification_loss",
    "token_loss",
]

IGNORE_INDEX = -100


def token_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean") -> Tensor:
    """``[B]`` cross-entropy per example over its own labelled positions (``labels != -100``).

    Args:
        logits (`torch.Tensor`): ``[B, T, V]``.
        labels (`torch.Tensor`): ``[B, T]``, ``-100`` where no loss is taken.
        reduction (`str`): ``"mean"`` over the example's own labelled tokens, or ``"sum"``.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"`reduction` must be 'mean' or 'sum', got {reduction!r}.")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    total = per_token.sum(1)
    if reduction == "sum":
        return total
    count = (labels != IGNORE_INDEX).sum(1).clamp_min(1)
    return total / count


def causal_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean") -> Tensor:
    """``[B]`` next-token loss: position ``t`` predicts ``labels[t + 1]`` (the usual shift)."""
    return token_loss(logits[:, :-1, :], labels[:, 1:], reduction=reduction)


def masked_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean") -> Tensor:
    """``[B]`` masked-LM / prompt-infilling loss on the positions whose label is not ``-100`` (no shift)."""
    return token_loss(logits, labels, reduction=reduction)


def sequence_classification_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """``[B]`` loss of a classification head: cross-entropy, or squared error for one regression output."""
    if logits.shape[-1] == 1 and labels.is_floating_point():
        return (logits.squeeze(-1) - labels.to(logits.dtype)).pow(2)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, labels.view(-1), reduction="none")


def seq2seq_lm_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean") -> Tensor:
    """``[B]`` decoder loss of an encoder-decoder model: logits are already aligned with labels (no shift)."""
    return token_loss(logits, labels, reduction=reduction)


def token_classification_loss(logits: Tensor, labels: Tensor, *, reduction: str = "mean") -> Tensor:
    """``[B]`` token-classification loss over each example's labelled tokens."""
    return token_loss(logits, labels, reduction=reduction)


#: loss_type -> function(logits, labels, reduction) returning ``[B]``.
PER_EXAMPLE_LOSSES = {
    "causal_lm": causal_lm_loss,
    "masked_lm": masked_lm_loss,
    "seq2seq_lm": seq2seq_lm_loss,
    "sequence_classification": lambda logits, labels, reduction="mean": sequence_classification_loss(logits, labels),
    "token_classification": token_classification_loss,
}

_CLASS_SUFFIXES = (
    ("ForConditionalGeneration", "seq2seq_lm"),
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForSequenceClassification", "sequence_classification"),
    ("ForTokenClassification", "token_classification"),
)


def infer_loss_type(model) -> str:
    """The per-example loss for a model, from its class name (PEFT models: their base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq_lm"
    name = type(base).__name__
    for suffix, loss_type in _CLASS_SUFFIXES:
        if name.endswith(suffix) or suffix in name:
            return loss_type
    raise ValueError(
        f"Cannot tell which per-example loss {name} needs. Set `loss_type` in DPTrainingArguments to one of "
        f"{sorted(PER_EXAMPLE_LOSSES)}, or pass `compute_loss_func(outputs, labels)` returning one loss per example."
    )
