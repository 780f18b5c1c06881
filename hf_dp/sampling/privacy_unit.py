"""User-level DP in the Trainer: who each row belongs to, and how that reaches the clipper.

With ``privacy_unit="user"`` the unit of the guarantee is the user named by ``user_column``. The training set's
column is read once when the plan is resolved (:func:`user_codes`: a code ``0 .. U-1`` per row, ``N = U``); the
sampler (:class:`~hf_dp.sampling.users.PoissonUserBatchSampler`) draws users and at most ``k`` rows of each, all in one
micro-batch; each row carries its user's code to the collator (:class:`UnitTaggedDataset`), which renumbers the
codes of a micro-batch ``0 .. u-1`` (:class:`~hf_dp.sampling.collators.EmptyBatchSafeCollator`), so that the clipper
clips the sum of each user's per-example gradients as one (``BookKeepingClipper.prepare(loss, units=...)``). The codes
travel on the host: no device read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .users import encode_users

__all__ = ["UNIT_KEY", "UnitTaggedDataset", "user_codes"]

#: Key of a row's user code in the features the collator receives, then of the micro-batch's units in the batch.
UNIT_KEY = "hf_dp_unit"


def _column(dataset, column: str) -> list:
    """The values of ``column`` in every row of ``dataset`` (a ``datasets.Dataset`` column, or row by row)."""
    names = getattr(dataset, "column_names", None)
    if names is not None:
        if column not in names:
            raise ValueError(
                f"`user_column={column!r}` is not a column of the training set (columns: {list(names)}). Name the "
                "column that identifies each row's user."
            )
        return list(dataset[column])
    values = []
    for i in range(len(dataset)):
        row = dataset[i]
        if not isinstance(row, Mapping) or column not in row:
            raise ValueError(
                f"Row {i} of the training set has no `{column}` (`user_column`): with `privacy_unit='user'` every "
                "row must be a mapping that names its user."
            )
        value = row[column]
        values.append(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value)
    return values


def user_codes(dataset, column: str) -> tuple[np.ndarray, int]:
    """``(codes, U)``: the user code of every row of ``dataset`` (``0 .. U-1``) and the number of users.

    Raises:
        ValueError: a missing column, or a row without a user (it would be a unit the sampler cannot protect).
    """
    return encode_users(_column(dataset, column))


class UnitTaggedDataset(Dataset):
    """``dataset`` whose rows also carry their user's code under :data:`UNIT_KEY` (taken out by the collator)."""

    def __init__(self, dataset, codes: np.ndarray) -> None:
        self.dataset = dataset
        self.codes = codes

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.dataset[index]
        if not isinstance(row, Mapping):
            raise TypeError(
                f"With `privacy_unit='user'` each training row must be a mapping of features, got {type(row).__name__}."
            )
        return {**row, UNIT_KEY: int(self.codes[index])}
