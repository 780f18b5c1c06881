"""Collator wrapper for Poisson batches, which can be empty (HF collators fail on ``[]``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["EMPTY_BATCH_KEY", "EmptyBatchSafeCollator", "is_empty_batch"]

#: Key of the placeholder a :class:`EmptyBatchSafeCollator` returns for an empty micro-batch.
EMPTY_BATCH_KEY = "hf_dp_empty_batch"


class EmptyBatchSafeCollator:
    """Calls ``collator(features)``, or returns ``{EMPTY_BATCH_KEY: True}`` when ``features`` is empty."""

    def __init__(self, collator: Callable[[list], Any]) -> None:
        self.collator = collator

    def __call__(self, features: list) -> Any:
        if len(features) == 0:
            return {EMPTY_BATCH_KEY: True}
        return self.collator(features)


def is_empty_batch(inputs: Any) -> bool:
    return isinstance(inputs, dict) and bool(inputs.get(EMPTY_BATCH_KEY, False))
