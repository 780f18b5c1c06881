"""Sequences packed into rows: which token belongs to which sequence, and the per-sequence causal LM loss.

TRL's padding-free batches (``packing_strategy="bfd"``, ``padding_free=True``) put several sequences into one row with
``position_ids`` restarting at each sequence and no attention mask; transformers then builds a block-causal mask from
those position ids. With DP each sequence is one example: one loss per sequence, clipped on its own
(:mod:`hf_dp.engine.packed`). The engine, the losses and the model's mask read the sequences off the same
``position_ids`` with the same rule (:func:`packed_sequence_ids`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .losses import IGNORE_INDEX, _check_reduction, _float

__all__ = ["packed_causal_lm_loss", "packed_sequence_ids"]


def packed_sequence_ids(position_ids: Tensor) -> Tensor:
    """``[R, T]`` long: the sequence of every token of packed rows, numbered ``0 .. S-1`` in row-major order.

    A sequence starts at the first token of each row and wherever the position does not grow by exactly 1: the rule
    of transformers' ``find_packed_sequence_indices``, from which the model builds its block-causal mask, so the
    losses, the engine and the attention cut the rows at the same tokens.

    Raises:
        ValueError: ``position_ids`` that are not ``[rows, tokens]``.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"packed `position_ids` must be [rows, tokens], got shape {tuple(position_ids.shape)}.")
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = torch.diff(position_ids, dim=1) != 1
    return starts.reshape(-1).long().cumsum(0).view(position_ids.shape) - 1


def packed_causal_lm_loss(
    logits: Tensor,
    labels: Tensor,
    position_ids: Tensor,
    *,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    token_weight: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``[S]``: the next-token loss of each sequence of packed rows, entry ``s`` depending on sequence ``s`` alone.

    Position ``t`` predicts ``labels[t + 1]`` only inside one sequence (the first token of a sequence is no target, as
    TRL's padding-free collator marks it with ``-100``); the losses are reduced over each sequence's own targets.

    Args:
        logits (`torch.Tensor`): ``[R, T, V]``.
        labels (`torch.Tensor`): ``[R, T]``, ``-100`` where no loss is taken.
        position_ids (`torch.Tensor`): ``[R, T]``, restarting at each sequence (:func:`packed_sequence_ids`).
        reduction (`str`): ``"mean"`` over the sequence's own targets, or ``"sum"``.
        label_smoothing (`float`): the Trainer's ``label_smoothing_factor``, per token.
        token_weight (`Callable`, *optional*): maps the per-token losses before the reduction (TRL's DFT weighting).
    """
    _check_reduction(reduction)
    sequence = packed_sequence_ids(position_ids.to(labels.device))
    count = int(sequence[-1, -1]) + 1 if sequence.numel() else 0  # S, read on the host (the loss is [S])
    targets = labels[:, 1:].masked_fill(sequence[:, 1:] != sequence[:, :-1], IGNORE_INDEX)
    logits = _float(logits[:, :-1])
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    )
    if token_weight is not None:
        per_token = token_weight(per_token)
    index = sequence[:, 1:].reshape(-1)
    total = per_token.new_zeros(count).index_add(0, index, per_token)
    if reduction == "sum":
        return total
    kept = (targets.reshape(-1) != IGNORE_INDEX).to(per_token.dtype)
    return total / per_token.new_zeros(count).index_add(0, index, kept).clamp_min(1)
