"""The training set's fingerprint: what identifies it across processes and resumes, without revealing its rows.

The fingerprint (saved with checkpoints and in the ledger) is a hash of training rows keyed with a random key kept in
``output_dir/_dp_fingerprint.key`` (:func:`fingerprint_key`): it identifies the training set for a resume in the same
output folder, and without the key it is no membership oracle for whoever reads a pushed checkpoint. A resume in
another folder (without the key) cannot compare contents and says so; N is still checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("hf_dp.ledger.ledger")

__all__ = ["KEY_NAME", "data_fingerprint", "fingerprint_key", "fingerprint_mismatch"]

#: The key of the fingerprints, in ``output_dir`` (never uploaded: the Trainer skips ``_*`` files).
KEY_NAME = "_dp_fingerprint.key"
#: Rows hashed into the fingerprint: an Arrow-backed ``datasets.Dataset`` is read in one call, other datasets row by
#: row (twice, to detect a ``__getitem__`` that is not deterministic, e.g. random augmentation).
_ARROW_ROWS = 1024
_ROWS = 64


def _sample_indices(n: int, k: int) -> list[int]:
    """``k`` evenly spaced indices of ``range(n)`` (all of them when ``n <= k``), first and last included."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _encode(value: Any) -> Any:
    """``json.dumps`` fallback: tensors and arrays by dtype, shape and a hash of their bytes; other objects by type and
    a stable byte form when they have one."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point() and value.dtype == torch.bfloat16:
            value = value.float()
        value = value.numpy()
    if isinstance(value, np.ndarray):
        data = np.ascontiguousarray(value)
        return [
            "ndarray",
            str(data.dtype),
            list(data.shape),
            hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest(),
        ]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes | bytearray | memoryview):
        return ["bytes", hashlib.blake2b(bytes(value), digest_size=16).hexdigest()]
    if hasattr(value, "tobytes") and hasattr(value, "size") and hasattr(value, "mode"):  # a PIL image
        return ["image", value.mode, list(value.size), hashlib.blake2b(value.tobytes(), digest_size=16).hexdigest()]
    if isinstance(value, set | frozenset):
        return sorted(map(repr, value))
    return ["object", type(value).__qualname__]  # no stable byte form: its type only (never an address)


def fingerprint_key(output_dir: str) -> tuple[bytes, bool]:
    """The key of this output folder's fingerprints (:data:`KEY_NAME`, created on first use): a keyed hash of
    training rows tells nothing to whoever lacks the key, so the fingerprints saved with checkpoints (which
    ``hub_strategy`` may push) and in the ledger are no membership oracle. The key stays on the training machine: the
    Trainer's uploads skip files whose names start with ``_``, and nothing else of hf_dp writes it elsewhere.
    Returns the key and whether it was created now (fingerprints saved before, elsewhere, cannot be compared)."""
    path = os.path.join(output_dir, KEY_NAME)
    if os.path.isfile(path):
        with open(path) as f:
            return bytes.fromhex(f.read().strip()), False
    os.makedirs(output_dir, exist_ok=True)
    key = os.urandom(32)
    with open(path, "w") as f:
        f.write(key.hex())
    return key, True


def _hash_rows(rows: Iterable[Any], key: bytes = b"") -> str:
    digest = hashlib.blake2b(digest_size=16, key=key)
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=_encode).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def data_fingerprint(dataset, key: bytes = b"") -> dict[str, Any]:
    """What identifies a training set across processes: ``N``, a hash of the content of a deterministic sample of its
    rows (all rows up to 1024 for a ``datasets.Dataset``, read raw, without its format or transform; up to 64 for
    another map-style dataset), and the ``datasets`` fingerprint when there is one.

    ``rows`` is ``None`` when the dataset's rows are not deterministic (two reads differ: random augmentation in
    ``__getitem__``); then only ``N`` and the ``datasets`` fingerprint identify it. Two training sets that differ only
    in rows outside the sample have the same ``rows``: the check is against a wrong dataset, not an adversary.
    Both hashes are keyed with ``key`` (:func:`fingerprint_key`): without it they reveal nothing of the rows.
    """
    n = len(dataset)
    fingerprint: dict[str, Any] = {"num_examples": n, "rows": None, "datasets": None}
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset):
            own = getattr(dataset, "_fingerprint", None)
            fingerprint["datasets"] = None if own is None else _hash_rows([own], key)
            table = dataset.with_format("arrow")[_sample_indices(n, _ARROW_ROWS)]  # one read, no decoding, no transform
            columns = table.to_pydict()
            names = sorted(columns)
            fingerprint["rows"] = _hash_rows([names, *zip(*(columns[c] for c in names), strict=True)], key)
            return fingerprint
    except ImportError:
        pass
    indices = _sample_indices(n, _ROWS)
    try:
        first = _hash_rows((dataset[i] for i in indices), key)
        second = _hash_rows((dataset[i] for i in indices), key)
    except Exception as error:  # noqa: BLE001 - an unreadable row: the fingerprint is N only, and says why
        logger.warning("hf_dp: the training set's rows could not be fingerprinted (%s); only N identifies it.", error)
        return fingerprint
    if first == second:
        fingerprint["rows"] = first
    else:
        logger.warning(
            "hf_dp: reading the same training examples twice gave different values (random transforms in "
            "`__getitem__`?): the training set is identified by N only when resuming."
        )
    return fingerprint


def fingerprint_mismatch(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> str | None:
    """Why ``saved`` and ``current`` are not the same training set (``None`` if they may be)."""
    if not saved:
        return None
    if saved.get("num_examples") is not None and saved.get("num_examples") != current.get("num_examples"):
        return f"N={saved.get('num_examples')} examples, and this run has N={current.get('num_examples')}"
    if saved.get("rows") and current.get("rows") and saved["rows"] != current["rows"]:
        return (
            f"a training set whose sampled rows hash to {saved['rows'][:12]}, and this run's hash to "
            f"{current['rows'][:12]} (same N={current.get('num_examples')}, different content)"
        )
    return None
