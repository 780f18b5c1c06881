"""The privacy record of a run: an append-only ledger of noisy steps, the training-set fingerprint, and the checks a
checkpoint's DP state must pass before a resume trusts it (DESIGN §6 rule 21).

Checkpoints are not a safe record of the privacy spent: ``save_total_limit`` deletes them, ``load_best_model_at_end``
with ``save_total_limit=1`` keeps only the best (an earlier one), and a resume from it would forget every noisy step
taken after it, although the models of those steps were evaluated, logged or pushed. So every noisy step is also
appended to ``output_dir/dp_ledger.jsonl`` (outside the ``checkpoint-*`` folders), one JSON line per batch of steps
written together::

    {"format": 1, "run": "3f2a...", "step": 12, "steps": 1, "noise_multiplier": 1.0, "sample_rate": 0.01,
     "num_examples": 1000, "data": "9b1c..."}

``run`` identifies the run (random, drawn at its first ``train()``, saved with its checkpoints, kept by a resume);
``step`` is the index of the first noisy step of the line in that run (0-based, over every ``train()`` call and
resume), ``steps`` how many consecutive steps with that ``noise_multiplier`` and ``sample_rate`` the line records.
``data`` is the fingerprint of the training set (:func:`data_fingerprint`). The ledger holds no seed, no generator
state, no loss, no statistic of the batches, and no time stamp (the time a step takes depends on the size of its
Poisson batch, an un-noised statistic: DESIGN §4 rule 15). A resume takes the larger of the ledger's steps of the
checkpoint's run and the checkpoint's own history (:func:`ledger_history`).

The ``data`` fingerprint (and the ``data_fingerprint`` saved with checkpoints) is a hash of training rows keyed with
a random key kept in ``output_dir/_dp_fingerprint.key`` (:func:`fingerprint_key`): it identifies the training set for
a resume in the same output folder, and without the key it is no membership oracle for whoever reads a pushed
checkpoint. A resume in another folder (without the key) cannot compare contents and says so; N is still checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "LEDGER_NAME",
    "CheckpointDPStateError",
    "TrainingSetMismatchError",
    "PrivacyLedger",
    "check_checkpoint_dp_state",
    "data_fingerprint",
    "fingerprint_key",
    "fingerprint_mismatch",
    "history_steps",
    "ledger_history",
    "new_run_id",
    "read_checkpoint_dp_state",
]

LEDGER_NAME = "dp_ledger.jsonl"
#: The key of the fingerprints, in ``output_dir`` (never uploaded: the Trainer skips ``_*`` files).
KEY_NAME = "_dp_fingerprint.key"
TRAINER_STATE_NAME = "trainer_state.json"
_FORMAT = 1
#: Rows hashed into the fingerprint: an Arrow-backed ``datasets.Dataset`` is read in one call, other datasets row by
#: row (twice, to detect a ``__getitem__`` that is not deterministic, e.g. random augmentation).
_ARROW_ROWS = 1024
_ROWS = 64
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def new_run_id() -> str:
    """A random identifier of a run (not a secret: nothing is derived from it)."""
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------------- fingerprint
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


# ---------------------------------------------------------------------------------------------------- the ledger
def history_steps(history: Iterable[Iterable[float]]) -> int:
    """Noisy steps of a ``[sigma, q, steps]`` history."""
    return sum(int(segment[2]) for segment in history)


class PrivacyLedger:
    """Appends the noisy steps of one run to ``<output_dir>/dp_ledger.jsonl``.

    :meth:`record` buffers a step, :meth:`flush` appends the buffered steps (one line per run of equal
    ``(sigma, q)``). :class:`~hf_dp.DPCallback` flushes every step as it records it, i.e. where the noise is added,
    before the optimizer applies it: so no model that is saved, logged, evaluated or pushed (which all happen after
    the optimizer step) can come from a step the ledger lacks, and a crash at any point loses at most steps that no
    model outside the process depends on (a step recorded but never applied is counted: that errs on the safe side).
    A checkpoint written later carries the same steps in its own history. The cost is one small append per optimizer
    step; the file is opened, appended and closed each time (exception-safe, no handle kept), and ``fsync``-ed at
    saves and at the end of training.
    """

    def __init__(self, output_dir: str, run_id: str, data: Mapping[str, Any]) -> None:
        self.path = os.path.join(output_dir, LEDGER_NAME)
        self.run_id = run_id
        self.num_examples = data.get("num_examples")
        self.data = data.get("rows") or data.get("datasets")
        self._pending: list[list[float]] = []  # [first step, steps, sigma, q]

    def __repr__(self) -> str:
        return f"PrivacyLedger({self.path!r}, run={self.run_id!r}, pending={sum(int(p[1]) for p in self._pending)})"

    def record(self, step: int, noise_multiplier: float, sample_rate: float) -> None:
        """Noisy step ``step`` (0-based, in the run) with this sigma and q."""
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] + last[1] == step and (last[2], last[3]) == (noise_multiplier, sample_rate):
            last[1] += 1
        else:
            self._pending.append([int(step), 1, float(noise_multiplier), float(sample_rate)])

    def flush(self, *, sync: bool = False) -> None:
        """Append the buffered steps (and ``fsync`` the file when ``sync``)."""
        if not self._pending:
            if sync and os.path.isfile(self.path):
                with open(self.path, "a", encoding="utf-8") as f:
                    os.fsync(f.fileno())
            return
        lines = "".join(
            json.dumps(
                {
                    "format": _FORMAT,
                    "run": self.run_id,
                    "step": int(first),
                    "steps": int(steps),
                    "noise_multiplier": sigma,
                    "sample_rate": q,
                    "num_examples": self.num_examples,
                    "data": self.data,
                },
                sort_keys=True,
            )
            + "\n"
            for first, steps, sigma, q in self._pending
        )
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        self._pending.clear()


def ledger_history(paths: Iterable[str], run_id: str) -> list[list[float]]:
    """The ``[sigma, q, steps]`` history of run ``run_id`` recorded in the ledgers at ``paths`` (missing files
    skipped; a torn last line, left by a crash during a write, skipped with a warning). Each step index counts once."""
    steps: dict[int, tuple[float, float]] = {}
    for path in dict.fromkeys(os.path.abspath(p) for p in paths):
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    if entry.get("run") != run_id:
                        continue
                    first, count = int(entry["step"]), int(entry["steps"])
                    sigma, q = float(entry["noise_multiplier"]), float(entry["sample_rate"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    logger.warning("hf_dp: skipping unreadable line %d of the privacy ledger %s.", number, path)
                    continue
                for index in range(first, first + count):
                    steps[index] = (sigma, q)
    history: list[list[float]] = []
    for index in sorted(steps):
        sigma, q = steps[index]
        if history and (history[-1][0], history[-1][1]) == (sigma, q):
            history[-1][2] += 1
        else:
            history.append([sigma, q, 1])
    return history


# ---------------------------------------------------------------------------------------------------- checkpoints
class CheckpointDPStateError(ValueError):
    """A checkpoint whose DP state cannot be trusted (missing, unreadable, edited, or from another training set)."""


def _checkpoint_step(path: str) -> int | None:
    match = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def read_checkpoint_dp_state(checkpoint: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(trainer_state, DPCallback attributes)`` of ``checkpoint``, checked for what a resume relies on.

    Raises:
        CheckpointDPStateError: the folder or its ``trainer_state.json`` is missing or not valid JSON, it has no
            DPCallback state, or that state is incomplete or edited (a history that is not ``[sigma, q, steps]``
            segments, or accounts fewer noisy steps than the checkpoint's ``global_step`` took).
    """
    trainer_state = _load_trainer_state(checkpoint)
    attributes = _dp_callback_attributes(checkpoint, trainer_state)
    _check_history_covers_steps(checkpoint, attributes["history"], trainer_state.get("global_step", 0))
    return trainer_state, attributes


def _load_trainer_state(checkpoint: str) -> dict[str, Any]:
    """The JSON object of the checkpoint's ``trainer_state.json``, refused if the folder or the file is missing or
    damaged."""
    if not os.path.isdir(checkpoint):
        raise CheckpointDPStateError(f"Checkpoint {checkpoint} does not exist (or is not a folder).")
    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    if not os.path.isfile(path):
        raise CheckpointDPStateError(
            f"Checkpoint {checkpoint} has no {TRAINER_STATE_NAME} ({path}): it is incomplete (interrupted while "
            "saving, or files were removed): neither the training state nor the privacy spent can be restored from it."
        )
    try:
        with open(path, encoding="utf-8") as f:
            trainer_state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointDPStateError(
            f"{path} is not valid JSON ({error}): checkpoint {checkpoint} is damaged (interrupted while saving, or "
            "edited)."
        ) from None
    if not isinstance(trainer_state, dict):
        raise CheckpointDPStateError(f"{path} does not hold a trainer state (a JSON object): checkpoint is damaged.")
    return trainer_state


def _dp_callback_attributes(checkpoint: str, trainer_state: dict[str, Any]) -> dict[str, Any]:
    """The attributes of the DPCallback state saved in ``trainer_state``, refused if absent or incomplete."""
    callbacks = trainer_state.get("stateful_callbacks")
    state = callbacks.get("DPCallback") if isinstance(callbacks, dict) else None
    if isinstance(state, list):
        state = state[0] if state else None
    if state is None:
        raise CheckpointDPStateError(
            f"Checkpoint {checkpoint} has no DPCallback state, so the privacy already spent is unknown. Resume only "
            "from checkpoints written by a DP trainer."
        )
    attributes = state.get("attributes") if isinstance(state, dict) else None
    if not isinstance(attributes, dict):
        raise CheckpointDPStateError(f"The DPCallback state of checkpoint {checkpoint} has no attributes (edited?).")
    missing = [k for k in ("history", "num_examples", "run_id", "data_fingerprint") if attributes.get(k) is None]
    if missing:
        raise CheckpointDPStateError(
            f"The DPCallback state of checkpoint {checkpoint} lacks {', '.join(missing)} (edited, or written by an "
            "older hf_dp): the privacy spent, or the run and the data it belongs to, cannot be checked."
        )
    return attributes


def _check_history_covers_steps(checkpoint: str, history: Any, global_step: Any) -> None:
    """The DP history is a list of ``[sigma, q, steps]`` segments accounting at least the ``global_step`` optimizer
    steps the checkpoint took (each of them noisy)."""
    if not isinstance(history, list) or not all(_is_segment(s) for s in history):
        raise CheckpointDPStateError(
            f"The DP history of checkpoint {checkpoint} is not a list of [noise_multiplier, sample_rate, steps] "
            f"segments (got {history!r:.200}): edited or damaged."
        )
    if not isinstance(global_step, int) or global_step < 0:
        raise CheckpointDPStateError(f"Checkpoint {checkpoint} has an invalid global_step {global_step!r}.")
    spent = history_steps(history)
    if spent < global_step:
        raise CheckpointDPStateError(
            f"The DP history of checkpoint {checkpoint} accounts {spent} noisy steps, but the checkpoint was saved "
            f"after {global_step} optimizer steps (its global_step), each of them noisy: the history was edited or "
            "truncated, and resuming from it would under-report epsilon."
        )


def _is_segment(segment: Any) -> bool:
    if not isinstance(segment, list | tuple) or len(segment) != 3:
        return False
    sigma, q, steps = segment
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in segment)
    return numbers and sigma >= 0 and math.isfinite(sigma) and 0 < q <= 1 and int(steps) == steps and steps >= 0


def _other_checkpoints(checkpoint: str) -> list[str]:
    """The other ``checkpoint-*`` folders next to ``checkpoint``, latest first."""
    parent = os.path.dirname(os.path.normpath(checkpoint)) or "."
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = [
        (step, os.path.join(parent, name))
        for name in names
        if (step := _checkpoint_step(name)) is not None and os.path.isdir(os.path.join(parent, name))
    ]
    this = os.path.abspath(checkpoint)
    return [path for _, path in sorted(found, reverse=True) if os.path.abspath(path) != this]


class TrainingSetMismatchError(CheckpointDPStateError):
    """A checkpoint trained on another training set than this run's (its N or its fingerprint differ)."""


def check_checkpoint_dp_state(checkpoint: str, fingerprint: Mapping[str, Any]) -> tuple[dict, dict]:
    """:func:`read_checkpoint_dp_state` plus the training-set check against ``fingerprint`` (this run's data); the
    error names the checkpoint to resume from instead (the latest sibling that passes every check), if any."""
    try:
        trainer_state, attributes = read_checkpoint_dp_state(checkpoint)
        # the fingerprint counts rows; the callback's N counts privacy units (users with privacy_unit="user")
        saved = {"num_examples": attributes["num_examples"], **attributes["data_fingerprint"]}
        mismatch = fingerprint_mismatch(saved, fingerprint)
        if mismatch is not None:
            raise TrainingSetMismatchError(
                f"hf_dp: cannot resume: checkpoint {checkpoint} was trained on {mismatch}. Resuming on a different "
                "training set is a different mechanism from the one accounted so far. Resume with the same "
                "`train_dataset`, or start a new run in a new `output_dir`."
            )
    except TrainingSetMismatchError:
        raise  # every checkpoint of this run is from that training set: no other one to name
    except CheckpointDPStateError as error:
        raise CheckpointDPStateError(
            f"hf_dp: cannot resume: {error}{_alternative_hint(checkpoint, fingerprint)}"
        ) from None
    return trainer_state, attributes


def _alternative_hint(checkpoint: str, fingerprint: Mapping[str, Any]) -> str:
    """Which checkpoint to resume from instead of a rejected one: the latest sibling that passes every check."""
    for other in _other_checkpoints(checkpoint):
        try:
            _, attributes = read_checkpoint_dp_state(other)
        except CheckpointDPStateError:
            continue
        if fingerprint_mismatch(
            {**attributes["data_fingerprint"], "num_examples": attributes["num_examples"]}, fingerprint
        ):
            continue
        return f" Resume from {other} instead (`resume_from_checkpoint={other!r}`)."
    parent = os.path.dirname(os.path.normpath(checkpoint)) or "."
    return (
        f" No other checkpoint in {parent} has a valid DP state for this training set: start a new run (without "
        "`resume_from_checkpoint`, in a new `output_dir`)."
    )
