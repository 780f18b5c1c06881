"""Whether the evaluation data is (or overlaps) the training set, and the refusal of selection on it (issue 26).

The guarantee covers the noised model. Metrics computed on the training data are un-noised statistics of it: when
they pick the released model (``load_best_model_at_end``, ``save_strategy="best"``), stop training
(``EarlyStoppingCallback``) or drive the learning rate (``lr_scheduler_type="reduce_lr_on_plateau"`` or ``"greedy"``),
the release depends on the training data through a channel that no accountant counts. So hf_dp compares the
trainer's ``eval_dataset`` with its ``train_dataset`` and

- refuses, before the first step, every such selection on an ``eval_dataset`` that is or substantially overlaps the
  training set (:func:`check_eval_selection`), saying what to do: a held-out evaluation split, or those settings off;
- tells the model card what the evaluation metrics were computed on (:func:`eval_card_fields`), so that its sentence
  about them is true in every case.

Three tests, cheapest first (:func:`find_eval_overlap`):

1. identity: ``eval_dataset is train_dataset``;
2. the ``datasets`` fingerprint: ``eval_dataset._fingerprint == train_dataset._fingerprint`` (the same table and the
   same transforms);
3. rows: a hash of each row of a deterministic sample of the evaluation rows (up to ``eval_sample``) looked up among
   the hashes of the training rows (all of them up to ``max_train_rows``, else a deterministic sample of that many;
   the overlap fraction is then scaled by N / rows hashed). A row is hashed from its values (tensors, arrays, lists,
   strings, numbers; integers as int64 and floats as float64), on the columns both datasets share, so a re-formatted
   copy (torch tensors against Python lists) still matches. A `datasets.Dataset` is read from its stored columns, in
   numpy batches (about 4 s for 50,000 rows of 128 tokens on one loaded core), not through a `set_transform`.

Rows that merely repeat in both splits (the same short sentence in train and validation) are no privacy leak: the
neighbouring training sets differ in one training example while the evaluation set stays fixed. A row overlap below
:data:`REFUSE_FRACTION` of the evaluation rows is taken for such duplicates: selection is not refused, but the card says
how many evaluation rows are training rows and that metrics on them are not covered. Datasets without ``len`` or
indexing (iterable datasets) cannot be compared; the card then says that the data was not checked.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "REFUSE_FRACTION",
    "EvalOverlap",
    "check_eval_selection",
    "eval_card_fields",
    "find_eval_overlap",
    "row_digest",
    "selection_settings",
    "training_metric_prefixes",
    "withheld_metric_prefixes",
]

#: A row overlap estimated at this fraction of the evaluation rows or more is the training set, not duplicates.
REFUSE_FRACTION = 0.05
#: Evaluation rows hashed per evaluation set (a deterministic sample above that).
EVAL_SAMPLE = 256
#: Training rows hashed (a deterministic sample above that).
MAX_TRAIN_ROWS = 50_000
_SEED = 0x26


@dataclass(frozen=True)
class EvalOverlap:
    """What :func:`find_eval_overlap` found for one evaluation set.

    Args:
        name (`str`): how the set is named to the user, e.g. ``"eval_dataset"`` or ``"eval_dataset['dev']"``.
        how (`str`): ``"identity"``, ``"fingerprint"`` or ``"rows"``.
        rows_checked (`int`): evaluation rows hashed (0 for identity and fingerprint).
        rows_found (`int`): of those, rows whose hash is a training row's hash.
        train_rows_hashed (`int`): training rows hashed.
        num_train (`int`): training rows in all.
        fraction (`float`): the estimated fraction of the evaluation rows that are training rows (1 for identity and
            fingerprint).
    """

    name: str
    how: str
    rows_checked: int = 0
    rows_found: int = 0
    train_rows_hashed: int = 0
    num_train: int = 0
    fraction: float = 1.0

    @property
    def metric_prefix(self) -> str:
        """The prefix of the metrics ``Trainer.evaluate`` logs for this set: ``eval_``, or ``eval_<key>_`` for a set
        of a dict of evaluation sets."""
        if self.name.startswith("eval_dataset[") and self.name.endswith("]"):
            key = self.name[len("eval_dataset[") : -1].strip("'\"")
            return f"eval_{key}_"
        return "eval_"

    @property
    def is_training_set(self) -> bool:
        """Whether this is the training set (or a substantial part of it), not duplicates: selection is refused."""
        return self.how != "rows" or self.fraction >= REFUSE_FRACTION

    def describe(self) -> str:
        """A clause for messages and the card, e.g. "`eval_dataset` is the training set (the same object)"."""
        if self.how == "identity":
            return f"`{self.name}` is the training set (the same object)"
        if self.how == "fingerprint":
            return f"`{self.name}` is the training set (the same `datasets` fingerprint)"
        sampled = "" if self.train_rows_hashed >= self.num_train else f" (of {self.train_rows_hashed} sampled)"
        return (
            f"{self.rows_found} of {self.rows_checked} sampled rows of `{self.name}` are also rows of the training "
            f"set{sampled}, about {self.fraction:.0%} of it"
        )


_NUMERIC_KINDS = {"b": np.bool_, "i": np.int64, "u": np.int64, "f": np.float64, "c": np.complex128}


def _feed_array(h: Any, array: np.ndarray) -> None:
    kind = array.dtype.kind
    if kind in _NUMERIC_KINDS:
        if array.size == 0:
            h.update(b"e" + repr(array.shape).encode())
            return
        array = np.ascontiguousarray(array, dtype=_NUMERIC_KINDS[kind])
        h.update(kind.replace("u", "i").encode() + repr(array.shape).encode() + array.tobytes())
        return
    h.update(b"[" + repr(array.shape).encode())  # strings, objects, ragged rows: element by element
    for item in array.reshape(-1):
        _feed(h, item)
    h.update(b"]")


def _feed(h: Any, value: Any) -> None:
    """Feed ``value`` to the hash ``h`` in a canonical form: a tensor, an array and a (nested) list with the same
    entries hash alike (integers as int64, floats as float64), and so do a mapping's items in any order."""
    if isinstance(value, Mapping):
        h.update(b"{")
        for key in sorted(value, key=str):
            _feed(h, str(key))
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, torch.Tensor):
        _feed_array(h, value.detach().cpu().numpy())
    elif isinstance(value, (np.ndarray, np.generic)) and not isinstance(value, (np.str_, np.bytes_)):
        _feed_array(h, np.asarray(value))
    elif isinstance(value, (str, bytes)):
        raw = value.encode() if isinstance(value, str) else value
        h.update(b"s" + len(raw).to_bytes(8, "little") + raw)
    elif value is None:
        h.update(b"n")
    elif isinstance(value, (bool, int, float, complex)):
        _feed_array(h, np.asarray(value))
    elif isinstance(value, (list, tuple)):
        try:
            array = np.asarray(value)
        except ValueError:  # ragged
            array = None
        if array is not None and array.dtype.kind in _NUMERIC_KINDS:
            _feed_array(h, array)
        else:
            h.update(b"[" + repr((len(value),)).encode())
            for item in value:
                _feed(h, item)
            h.update(b"]")
    elif hasattr(value, "tobytes"):  # PIL images and the like (their repr holds a memory address)
        h.update(type(value).__name__.encode() + value.tobytes())
    else:
        h.update(b"r" + repr(value).encode())


def row_digest(row: Any, keys: tuple[str, ...] | None = None) -> bytes:
    """A 16-byte hash of a dataset row (restricted to ``keys`` when the row is a mapping and ``keys`` is given)."""
    if keys is not None and isinstance(row, Mapping):
        row = {k: row[k] for k in keys}
    h = hashlib.blake2b(digest_size=16)
    _feed(h, row)
    return h.digest()


def _hf_dataset(dataset: Any) -> bool:
    datasets = sys.modules.get("datasets")  # a `datasets.Dataset` was built with it, so it is imported already
    return datasets is not None and isinstance(dataset, datasets.Dataset)


def _rows(dataset: Any, indices: list[int]):
    """The rows at ``indices``. A `datasets.Dataset` is read in batches of its stored columns as numpy (fast, and
    unaffected by a random `set_transform`, so that the same stored row always gives the same hash)."""
    if not _hf_dataset(dataset):
        for i in indices:
            yield dataset[i]
        return
    view = dataset.with_format("numpy")
    for start in range(0, len(indices), 1024):
        chunk = indices[start : start + 1024]
        batch = view[chunk]
        for r in range(len(chunk)):
            yield {column: values[r] for column, values in batch.items()}


def _first_row(dataset: Any) -> Any:
    return next(iter(_rows(dataset, [0])))


def _indexable(dataset: Any) -> bool:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return False
    try:
        len(dataset)
    except TypeError:
        return False
    return hasattr(dataset, "__getitem__")


def _sample(n: int, k: int, salt: int) -> list[int]:
    if n <= k:
        return list(range(n))
    return sorted(int(i) for i in np.random.default_rng(_SEED + salt).choice(n, size=k, replace=False))


def _common_keys(a: Any, b: Any) -> tuple[str, ...] | None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return tuple(sorted(set(a) & set(b), key=str))
    return None


def _named_eval_sets(eval_dataset: Any) -> list[tuple[str, Any]]:
    if isinstance(eval_dataset, Mapping):  # the Trainer's dict of evaluation sets
        return [(f"eval_dataset[{key!r}]", value) for key, value in eval_dataset.items()]
    return [("eval_dataset", eval_dataset)]


def find_eval_overlap(
    train_dataset: Any,
    eval_dataset: Any,
    *,
    eval_sample: int = EVAL_SAMPLE,
    max_train_rows: int = MAX_TRAIN_ROWS,
) -> tuple[list[EvalOverlap], list[str]]:
    """Compare each evaluation set with the training set.

    Args:
        train_dataset: the training set (map-style).
        eval_dataset: an evaluation set, a dict of them (as the Trainer takes), or `None`.
        eval_sample (`int`, *optional*): evaluation rows hashed per set (a deterministic sample above that).
        max_train_rows (`int`, *optional*): training rows hashed (a deterministic sample above that).

    Returns:
        `(overlaps, unchecked)`: an :class:`EvalOverlap` per evaluation set found to be or overlap the training set,
        and the names of the sets that could not be compared (no `len` or indexing).

    Example:
        ```python
        overlaps, _ = find_eval_overlap(ds, ds.select(range(100)))
        assert overlaps[0].is_training_set
        ```
    """
    if eval_dataset is None or train_dataset is None:
        return [], []
    overlaps: list[EvalOverlap] = []
    unchecked: list[str] = []
    train_hashes: dict[tuple[str, ...] | None, set[bytes]] = {}  # per set of shared columns, hashed once
    for name, data in _named_eval_sets(eval_dataset):
        if data is None:
            continue
        same = _same_set(name, data, train_dataset)
        if same is not None:
            overlaps.append(same)
            continue
        if not (_indexable(data) and _indexable(train_dataset)):
            unchecked.append(name)
            continue
        n_train, n_eval = len(train_dataset), len(data)
        if n_train == 0 or n_eval == 0:
            continue
        train_indices = _sample(n_train, max_train_rows, salt=1)
        eval_indices = _sample(n_eval, eval_sample, salt=2)
        found = _rows_found(name, data, train_dataset, eval_indices, train_indices, train_hashes)
        if found is None:
            unchecked.append(name)
        elif found:
            coverage = len(train_indices) / n_train
            fraction = min(1.0, found / len(eval_indices) / coverage)
            overlaps.append(EvalOverlap(name, "rows", len(eval_indices), found, len(train_indices), n_train, fraction))
    return overlaps, unchecked


def _same_set(name: str, data: Any, train_dataset: Any) -> EvalOverlap | None:
    """Tests 1 and 2: ``data`` is the training set object, or has its `datasets` fingerprint."""
    if data is train_dataset:
        return EvalOverlap(name, "identity")
    fingerprint = getattr(train_dataset, "_fingerprint", None)
    if fingerprint is not None and getattr(data, "_fingerprint", None) == fingerprint:
        return EvalOverlap(name, "fingerprint")
    return None


def _rows_found(
    name: str,
    data: Any,
    train_dataset: Any,
    eval_indices: list[int],
    train_indices: list[int],
    train_hashes: dict[tuple[str, ...] | None, set[bytes]],
) -> int | None:
    """Test 3: how many rows of ``data`` at ``eval_indices`` hash like a training row at ``train_indices``, on the
    columns both share (the training hashes are kept in ``train_hashes``); `None` if the two cannot be compared row
    by row (no column in common, or rows that cannot be read by index)."""
    try:
        keys = _common_keys(_first_row(train_dataset), _first_row(data))
        if keys == ():
            return None  # no column in common: nothing to compare
        if keys not in train_hashes:
            train_hashes[keys] = {row_digest(row, keys) for row in _rows(train_dataset, train_indices)}
        return sum(row_digest(row, keys) in train_hashes[keys] for row in _rows(data, eval_indices))
    except Exception as error:  # a dataset whose rows cannot be read by index: not compared (the card says so)
        logger.warning("hf_dp: could not compare %s with the training set row by row (%r).", name, error)
        return None


def selection_settings(args: Any, callbacks: Any = (), lr_scheduler: Any = None) -> list[str]:
    """The settings under which evaluation metrics choose the released model, stop training or set the learning rate.

    Args:
        args: the training arguments.
        callbacks: the trainer's callbacks (``trainer.callback_handler.callbacks``).
        lr_scheduler: the trainer's scheduler if already built (``trainer.lr_scheduler``).

    Returns:
        `list[str]`: e.g. ``["load_best_model_at_end=True", "EarlyStoppingCallback"]``; empty when none.
    """
    from transformers import EarlyStoppingCallback

    found = []
    if getattr(args, "load_best_model_at_end", False):
        found.append("load_best_model_at_end=True")
    if str(getattr(getattr(args, "save_strategy", None), "value", getattr(args, "save_strategy", None))) == "best":
        found.append('save_strategy="best"')
    for callback in callbacks or ():  # the handler holds instances (it instantiates the classes it is given)
        if isinstance(callback, EarlyStoppingCallback):
            found.append(type(callback).__name__)
    scheduler = str(getattr(getattr(args, "lr_scheduler_type", None), "value", getattr(args, "lr_scheduler_type", "")))
    if scheduler in ("reduce_lr_on_plateau", "greedy"):
        found.append(f'lr_scheduler_type="{scheduler}"')
    elif lr_scheduler is not None:
        from transformers.optimization import GreedyLR

        if isinstance(lr_scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)):
            found.append(f"a {type(lr_scheduler).__name__} scheduler")
    return list(dict.fromkeys(found))


_CACHE_ATTRIBUTE = "_hf_dp_eval_overlap"


def _trainer_overlap(trainer: Any) -> tuple[list[EvalOverlap], list[str]]:
    """:func:`find_eval_overlap` for the trainer's datasets, cached while both stay the same objects."""
    train, evaluation = trainer.train_dataset, trainer.eval_dataset
    cached = getattr(trainer, _CACHE_ATTRIBUTE, None)
    if cached is not None and cached[0] is train and cached[1] is evaluation:
        return cached[2]
    result = find_eval_overlap(train, evaluation)
    setattr(trainer, _CACHE_ATTRIBUTE, (train, evaluation, result))
    return result


def check_eval_selection(trainer: Any) -> list[EvalOverlap]:
    """Refuse, before training, evaluation metrics of the training data choosing the release (see the module doc).

    Args:
        trainer: a DP trainer (reads ``args``, ``train_dataset``, ``eval_dataset``, its callbacks and scheduler).

    Returns:
        `list[EvalOverlap]`: the overlaps found (duplicates below :data:`REFUSE_FRACTION` when selection is on).

    Raises:
        ValueError: if a selection setting is on and an evaluation set is or substantially overlaps the training set.
    """
    settings = selection_settings(
        trainer.args, trainer.callback_handler.callbacks, getattr(trainer, "lr_scheduler", None)
    )
    if not settings or trainer.eval_dataset is None:
        return []
    overlaps, _ = _trainer_overlap(trainer)
    refused = [o for o in overlaps if o.is_training_set]
    if refused:
        what = "; ".join(o.describe() for o in refused)
        raise ValueError(
            f"{what}, and {', '.join(settings)} would use metrics computed on it: the released model (or when training "
            "stops, or the learning rate) would then depend on un-noised statistics of the training data, which the DP "
            "guarantee does not cover. Give a held-out evaluation split as `eval_dataset` (e.g. `split = "
            "dataset.train_test_split(test_size=0.1)`, train on split['train'], evaluate on split['test']), or turn "
            f"{' and '.join(settings)} off."
        )
    for overlap in overlaps:
        logger.warning(
            "hf_dp: %s; taken for duplicates (below %.0f%%): %s still uses them, and the model card says so.",
            overlap.describe(),
            REFUSE_FRACTION * 100,
            ", ".join(settings),
        )
    return overlaps


def training_metric_prefixes(trainer: Any) -> tuple[str, ...]:
    """The prefixes of the evaluation metrics computed on the training set (an evaluation set that is, or
    substantially overlaps, it): un-noised statistics of the training data."""
    if trainer.eval_dataset is None or trainer.train_dataset is None:
        return ()
    overlaps, _ = _trainer_overlap(trainer)
    return tuple(dict.fromkeys(o.metric_prefix for o in overlaps if o.is_training_set))


def withheld_metric_prefixes(trainer: Any) -> tuple[str, ...]:
    """:func:`training_metric_prefixes`, withheld from every written file unless ``publish_training_metrics``."""
    return () if trainer.args.publish_training_metrics else training_metric_prefixes(trainer)


def eval_card_fields(trainer: Any) -> dict[str, Any]:
    """The model card's fields on the evaluation data: ``eval_checked``, ``eval_overlap``, ``eval_selection``.

    Args:
        trainer: a DP trainer.

    Returns:
        `dict`: keyword arguments for :class:`~hf_dp.release.model_card.DPModelCardData`.
    """
    if trainer.eval_dataset is None or trainer.train_dataset is None:
        return {"eval_checked": False, "eval_overlap": [], "eval_selection": [], "eval_withheld": []}
    overlaps, unchecked = _trainer_overlap(trainer)
    settings = selection_settings(
        trainer.args, trainer.callback_handler.callbacks, getattr(trainer, "lr_scheduler", None)
    )
    return {
        "eval_checked": not unchecked,
        "eval_overlap": [o.describe() for o in overlaps],
        "eval_selection": settings if overlaps else [],
        "eval_withheld": list(withheld_metric_prefixes(trainer)),
    }
