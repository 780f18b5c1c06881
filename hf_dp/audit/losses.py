"""Each canary's loss under a model: summed cross-entropy over its labelled tokens (or its class label), in eval
mode, without gradients, in float64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from .canaries import CANARY_TASKS, IGNORE_INDEX

__all__ = ["canary_losses"]

PAD_VALUES = {"attention_mask": 0, "labels": IGNORE_INDEX}


def _pad(items: Sequence[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pads 1-D tensors to the longest item; 0-d tensors (class labels) are stacked."""
    batch = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if values[0].dim() == 0:
            batch[key] = torch.stack(values)
            continue
        longest = max(len(v) for v in values)
        fill = PAD_VALUES.get(key, pad_token_id if key == "input_ids" else 0)
        batch[key] = torch.stack([torch.nn.functional.pad(v, (0, longest - len(v)), value=fill) for v in values])
    return batch


def _per_item_loss(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """``[B]`` summed cross-entropy of each item over its own labelled positions (float64)."""
    logits = logits.double()
    if task == "sequence_classification":
        return torch.nn.functional.cross_entropy(logits, labels.view(-1), reduction="none")
    if task == "causal_lm":  # position t predicts token t + 1
        logits, labels = logits[:, :-1], labels[:, 1:]
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return per_token.view(labels.shape).sum(1)


@torch.no_grad()
def canary_losses(
    model: nn.Module,
    items: Sequence[dict[str, torch.Tensor]],
    *,
    task: str,
    pad_token_id: int = 0,
    batch_size: int = 64,
) -> np.ndarray:
    """Each item's loss under ``model`` (summed over its labelled tokens), in eval mode and without gradients.

    The model's mode is restored afterwards (a model in training mode goes back to training mode).

    Args:
        model (`nn.Module`): a Hugging Face model whose output has ``logits``.
        items (`Sequence[dict[str, torch.Tensor]]`): canary items (`CanarySet` entries).
        task (`str`): one of `CANARY_TASKS`.
        pad_token_id (`int`, *optional*, defaults to 0): the id ``input_ids`` are padded with.
        batch_size (`int`, *optional*, defaults to 64): items per forward pass.

    Returns:
        `np.ndarray`: float64 losses, one per item.

    Raises:
        ValueError: for an unknown ``task``.
    """
    if task not in CANARY_TASKS:
        raise ValueError(f"Unknown canary task {task!r}; choose one of {list(CANARY_TASKS)}.")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = []
    try:
        for start in range(0, len(items), batch_size):
            batch = _pad(items[start : start + batch_size], pad_token_id)
            labels = batch.pop("labels").to(device)
            outputs = model(**{k: v.to(device) for k, v in batch.items()})
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
            out.append(_per_item_loss(logits, labels, task).cpu())
    finally:
        model.train(was_training)
    return torch.cat(out).numpy() if out else np.zeros(0)
