"""What reaches the model is what the Poisson sampler drew (DESIGN §6 rule 20).

The accountant assumes that each logical batch holds each example of the training set once, independently with
probability ``q``, and that each example's contribution to the update is clipped at C. Anything between the sampler and
the loss that merges, duplicates, drops or pads rows breaks that silently: a padding-free collator
(``DataCollatorWithFlattening``, TRL's ``padding_free=True``) or a packed dataset puts several examples into one row, so
the whole row is clipped as one example (sensitivity up to the micro-batch size times C); accelerate's batch dispatcher
joins micro-batches and pads the epoch's last batch from its start (an example twice in one step: sensitivity 2C).

This module checks, for every micro-batch of a DP step:

- the collator's output carries no padding-free/packing keys (``cu_seq_lens_q``, ``cu_seqlens``, ``seq_idx``, ...):
  a dictionary lookup, free;
- ``position_ids`` do not restart within a row (several sequences packed into one row): checked on the host on the
  first non-empty micro-batch carrying ``position_ids`` of each ``train()`` call only (one device-to-host read per
  run, none per micro-batch). Packing is a property of the collator or of the prepared dataset, the same for every
  batch; a collator that merges rows only sometimes is caught by the next check;
- the number of per-example losses equals the number of examples the Poisson sampler put in the micro-batch:
  :class:`~hf_dp.sampling.collators.EmptyBatchSafeCollator` records ``len(features)`` in the batch under
  :data:`NUM_EXAMPLES_KEY` (a Python int, so comparing it with the loss's ``shape[0]`` needs no device sync).

The collator itself is checked before training (:func:`check_collator`), so the usual cases fail before the model is
even moved to the device.

One collator is accepted with padding-free batches: :class:`~hf_dp.sampling.packing.PackedSequenceCollator`, with which
the trainer clips each sequence of a row as one example (DPSFTTrainer's padding-free packing). Its batches may carry
the packing keys and restarting ``position_ids``; one loss per sampled sequence is then checked as for rows (the
losses against the sampled count here, the sequences of the ``position_ids`` against the losses in the engine).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from .data_checks import empty_sequences
from .packing import packs_sequences

__all__ = [
    "NUM_EXAMPLES_KEY",
    "PACKING_KEYS",
    "MicroBatchChecks",
    "check_collator",
    "collator_name",
    "position_ids_restart",
]

#: Key under which the training collator records how many examples the sampler put in the micro-batch.
NUM_EXAMPLES_KEY = "hf_dp_num_examples"
#: Keys of padding-free / packed batches (FlashAttention varlen boundaries, Mamba's sequence index).
PACKING_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "seq_idx")

_PACKING_FIX = (
    "DP training clips one example per row, so several sequences in one row would be clipped together as one example "
    "while the accountant counts each of them. Set `padding_free=False` (TRL), use `packing=False` or "
    "`packing_strategy='wrapped'` (each packed row is then the privacy unit), or use a padding collator "
    "(`DataCollatorWithPadding`, `DataCollatorForLanguageModeling`, `DataCollatorForSeq2Seq`) instead of "
    "`DataCollatorWithFlattening`. (DPSFTTrainer trains TRL's padding-free packing, `packing_strategy='bfd'`, with "
    "each sequence clipped on its own.)"
)


def collator_name(collator: Any) -> str:
    """How error messages name ``collator`` (the user's, inside hf_dp's and the Trainer's wrappers)."""
    for _ in range(4):  # EmptyBatchSafeCollator.collator, transformers' RemoveColumnsCollator.data_collator
        inner = getattr(collator, "collator", None) or getattr(collator, "data_collator", None)
        if inner is None or not callable(inner):
            break
        collator = inner
    if collator is None:
        return "the default collator"
    return f"`{getattr(collator, '__qualname__', None) or type(collator).__name__}`"


def check_collator(collator: Any) -> None:
    """A collator that flattens the micro-batch into one row (padding-free) raises ValueError with what to set."""
    if collator is None or packs_sequences(collator):  # each sequence of its rows is clipped as one example
        return
    classes = {cls.__name__ for cls in type(collator).__mro__}
    reason = None
    if "DataCollatorWithFlattening" in classes:
        reason = "concatenates the micro-batch into one row `[1, total_tokens]` (padding-free)"
    elif getattr(collator, "padding_free", False) is True:
        reason = "has `padding_free=True`: it concatenates the micro-batch into one row"
    if reason is not None:
        raise ValueError(f"The data collator {collator_name(collator)} {reason}. {_PACKING_FIX}")


def position_ids_restart(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """A 0-dim bool tensor (on the device, no sync): does any row of ``position_ids`` ``[B, T]`` not increase from
    one attended token to the next (a second sequence starting inside the row)? Padding (``attention_mask == 0``)
    is ignored, so left padding is not a restart."""
    if position_ids.shape[-1] < 2:
        return torch.zeros((), dtype=torch.bool, device=position_ids.device)
    restart = position_ids[..., 1:] <= position_ids[..., :-1]
    if attention_mask is not None and attention_mask.shape == position_ids.shape:
        attended = attention_mask.bool()
        restart &= attended[..., 1:] & attended[..., :-1]
    return restart.any()


class MicroBatchChecks:
    """The checks of one ``train()`` call; see the module docstring. ``collator``: the user's collator (for the
    error messages)."""

    def __init__(self, collator: Any = None) -> None:
        self.collator = collator_name(collator)
        self.positions_checked = False
        self.packed = packs_sequences(collator)  # padding-free rows, each sequence clipped as one example

    def before_forward(self, inputs: Any) -> int | None:
        """Takes :data:`NUM_EXAMPLES_KEY` out of ``inputs`` (in place: the model must not see it) and returns it
        (``None`` when the batch does not carry it: no Poisson sampler, or a collator output that is not a
        mutable mapping); raises ValueError for a padding-free or packed micro-batch."""
        if not isinstance(inputs, Mapping):
            return None
        sampled = inputs.pop(NUM_EXAMPLES_KEY, None) if isinstance(inputs, MutableMapping) else None
        empty = empty_sequences(inputs)
        if empty is not None:
            raise ValueError(
                f"The micro-batch from {self.collator} has {empty}: its sequences have length 0, so there is nothing "
                "to train on. Check the tokenization (the text column, `max_length`, truncation or filtering)."
            )
        if self.packed:
            return sampled
        packed = [key for key in PACKING_KEYS if key in inputs]
        if packed:
            raise ValueError(
                f"The micro-batch from {self.collator} carries {packed}: it is a padding-free (packed) batch, several "
                f"sequences in one row. {_PACKING_FIX}"
            )
        position_ids = inputs.get("position_ids")
        if not self.positions_checked and isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2:
            # Once per train() call, on the first micro-batch that has them: the one device-to-host read of these
            # checks. (3-D position ids, e.g. multimodal rotary positions [3, B, T], are not sequence positions.)
            self.positions_checked = True
            mask = inputs.get("attention_mask")
            if bool(position_ids_restart(position_ids, mask if isinstance(mask, torch.Tensor) else None)):
                raise ValueError(
                    f"The micro-batch from {self.collator} has `position_ids` that restart within a row: several "
                    f"sequences are packed into one row. {_PACKING_FIX}"
                )
        return sampled

    def after_loss(self, per_example: torch.Tensor, sampled: int | None) -> None:
        """The per-example losses must be one per sampled example (``shape[0]`` is known on the host: no sync)."""
        if sampled is None or per_example.shape[0] == sampled:
            return
        raise ValueError(
            f"The Poisson sampler put {sampled} examples in this micro-batch, but the model received "
            f"{per_example.shape[0]} rows (per-example losses): {self.collator} (or the dataset) merges, drops, "
            "duplicates or pads examples, so the clipping would not bound one example's contribution. Use a collator "
            "that returns one row per example (padding, not packing: `padding_free=False`, no "
            "`DataCollatorWithFlattening`), and do not set accelerate's `dispatch_batches`/`split_batches`."
        )
