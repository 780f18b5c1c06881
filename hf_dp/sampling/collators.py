"""Collation of Poisson micro-batches, which can be empty (HF collators fail on ``[]``), and its inverse: what a
training step finds in a collated micro-batch (:func:`unpack_micro_batch`)."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "EMPTY_BATCH_KEY",
    "PLACEHOLDER_KEY",
    "EmptyBatchSafeCollator",
    "MicroBatch",
    "batch_size",
    "is_empty_batch",
    "unpack_micro_batch",
]

#: Key of the placeholder a :class:`EmptyBatchSafeCollator` returns for an empty micro-batch.
EMPTY_BATCH_KEY = "hf_dp_empty_batch"
#: Key, in that placeholder, of a collated batch of one example to run with loss weight 0 (FSDP2 ranks must all run
#: every micro-batch through the model, whose collectives they share).
PLACEHOLDER_KEY = "hf_dp_placeholder"


class EmptyBatchSafeCollator:
    """Calls ``collator(features)``, or returns ``{EMPTY_BATCH_KEY: True}`` when ``features`` is empty (with
    ``{PLACEHOLDER_KEY: collator(placeholder())}`` if ``placeholder`` is given). With ``count_key``, a non-empty
    batch that is a mutable mapping also carries ``len(features)`` under it: the number of examples the sampler put
    in the micro-batch, which the trainer compares with the number of per-example losses (hf_dp.sampling.batch_checks).
    With ``unit_key``, features carrying a user code under it (``privacy_unit="user"``) have it taken out before
    ``collator`` sees them, and the batch carries the micro-batch's units (codes ``0 .. u-1``, a CPU tensor) under
    it."""

    def __init__(
        self,
        collator: Callable[[list], Any],
        placeholder: Callable[[], list] | None = None,
        count_key: str | None = None,
        unit_key: str | None = None,
    ) -> None:
        self.collator = collator
        self.placeholder = placeholder
        self.count_key = count_key
        self.unit_key = unit_key

    def __call__(self, features: list) -> Any:
        if len(features) == 0:
            empty: dict[str, Any] = {EMPTY_BATCH_KEY: True}
            if self.placeholder is not None:
                empty[PLACEHOLDER_KEY] = self.collator(self._strip(self.placeholder()))
            return empty
        units = None
        if self.unit_key is not None:
            features = [dict(f) for f in features]
            seen: dict[int, int] = {}
            units = [seen.setdefault(int(f.pop(self.unit_key)), len(seen)) for f in features]
        batch = self.collator(features)
        if self.count_key is not None and isinstance(batch, MutableMapping):
            batch[self.count_key] = len(features)
        if units is not None:
            if not isinstance(batch, MutableMapping):
                raise TypeError(
                    "With `privacy_unit='user'` the data collator must return a mapping (a dict of tensors), got "
                    f"{type(batch).__name__}."
                )
            batch[self.unit_key] = torch.tensor(units, dtype=torch.long)
        return batch

    def _strip(self, features: list) -> list:
        if self.unit_key is None:
            return features
        return [{k: v for k, v in f.items() if k != self.unit_key} for f in features]


def is_empty_batch(inputs: Any) -> bool:
    return isinstance(inputs, dict) and bool(inputs.get(EMPTY_BATCH_KEY, False))


def batch_size(inputs: Any) -> int:
    """The number of rows of a collated batch (the first dimension of its first tensor with one)."""
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    raise ValueError("The batch has no tensor with a batch dimension.")


@dataclass
class MicroBatch:
    """A micro-batch as a training step receives it from :class:`EmptyBatchSafeCollator`.

    Attributes:
        inputs: the batch for the model: the collated rows; for an FSDP2 placeholder, the placeholder's one example
            (to run with loss weight 0); for an empty micro-batch, ``{EMPTY_BATCH_KEY: True}``.
        units (`torch.Tensor`, *optional*): the user of each row (codes ``0 .. u-1``, user-level DP), else `None`.
        placeholder (`bool`): whether ``inputs`` is the placeholder of an empty micro-batch (it adds nothing).
    """

    inputs: Any
    units: torch.Tensor | None = None
    placeholder: bool = False

    @property
    def empty(self) -> bool:
        """No example: no forward pass, no gradient (the logical step still counts)."""
        return is_empty_batch(self.inputs)

    def rows(self) -> int:
        """Rows the model runs on: 1 for a placeholder, 0 when empty."""
        return 1 if self.placeholder else 0 if self.empty else batch_size(self.inputs)


def unpack_micro_batch(inputs: Any, *, unit_key: str | None = None) -> MicroBatch:
    """The parts of a collated micro-batch: the placeholder swapped in for an empty one that carries it, and, with
    ``unit_key`` (user-level DP), the user codes taken out of the batch.

    Raises:
        ValueError: with ``unit_key``, a micro-batch of rows that carries no user codes (it was not collated by
            :class:`EmptyBatchSafeCollator` with that key).
    """
    placeholder = inputs.get(PLACEHOLDER_KEY) if is_empty_batch(inputs) else None
    if placeholder is not None:
        inputs = placeholder
    units = None
    if unit_key is not None and not is_empty_batch(inputs):
        inputs = dict(inputs)
        units = inputs.pop(unit_key, None)
        if units is None and placeholder is None:
            raise ValueError(
                "privacy_unit='user': this micro-batch carries no user codes, so its rows cannot be clipped per "
                "user. Train through DPTrainer's own dataloader (do not override `get_train_dataloader`)."
            )
    return MicroBatch(inputs, units, placeholder is not None)
