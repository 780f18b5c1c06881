"""Padding-free packing of Poisson-sampled sequences: each sequence is an example, packed only after sampling.

TRL packs at dataset preparation (``trl.data_utils.pack_dataset``), which would make a packed row the item a sampler
draws. For DP the unit is a sequence (one example of the training set), so hf_dp samples **sequences**: the Poisson
sampler runs over the un-packed, tokenized training set (q and the expected batch size count sequences, as the
accountant does), and the sequences of each micro-batch are packed by TRL's own padding-free collator
(``DataCollatorForLanguageModeling(padding_free=True)``: one row of all of them, ``position_ids`` restarting at 0 at
each sequence, ``-100`` as the label of each sequence's first token, no attention mask, ``cu_seq_lens_*``). The model
thus receives exactly what TRL's ``packing_strategy="bfd"`` gives it (where TRL also flattens its packed rows into
one).

:class:`PackedSequenceCollator` wraps that collator: it returns the same batches and declares that the trainer clips
each sequence of its rows on its own (``BookKeepingClipper(packed_sequences=True)``), so that the checks of what
reaches the model (:mod:`.batch_checks`) accept its padding-free batches, which they refuse from any other collator.
That one loss per sampled sequence reaches the clipper is checked as for rows: the number of per-example losses equals
the number of sampled sequences, and the engine finds exactly that many sequences in the ``position_ids``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PackedSequenceCollator", "packs_sequences"]


class PackedSequenceCollator:
    """``collator(features)`` unchanged (a padding-free collator: several sequences per row), marked as packing
    sequences that are each clipped as one example.

    Args:
        collator (`Callable[[list], Any]`): TRL's ``DataCollatorForLanguageModeling(padding_free=True)`` (or any
            collator that packs the features into rows with ``position_ids`` restarting at each of them, one
            sequence per feature, no padding).
    """

    #: Read by :func:`packs_sequences`.
    packs_sequences = True

    def __init__(self, collator: Callable[[list], Any]) -> None:
        self.collator = collator

    def __call__(self, features: list) -> Any:
        return self.collator(features)

    def __getattr__(self, name: str) -> Any:  # the wrapped collator's settings (`pad_token_id`, ...)
        if name == "collator":
            raise AttributeError(name)
        return getattr(self.collator, name)


def packs_sequences(collator: Any) -> bool:
    """Whether ``collator`` (or a collator it wraps: hf_dp's, the Trainer's column remover) is a
    :class:`PackedSequenceCollator`."""
    for _ in range(4):
        if collator is None:
            return False
        if isinstance(collator, PackedSequenceCollator):
            return True
        collator = getattr(collator, "collator", None) or getattr(collator, "data_collator", None)
    return False
