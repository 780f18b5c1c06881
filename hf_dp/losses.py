"""Per-example losses: entry ``i`` depends on example ``i`` alone (DESIGN §4 rule 1).

HF models' built-in losses average over all tokens of the batch (and ``num_items_in_batch`` across accumulation),
which couples examples; these compute one loss per sequence from logits and labels instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["causal_lm_loss", "masked_lm_loss", "sequence_classification_loss", "token_loss"]

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
