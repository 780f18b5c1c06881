"""A checkpoint's DP state: read, and checked for what a resume relies on before it trusts it (DESIGN §6 rule 21).

A checkpoint whose DP state is missing, unreadable, edited or from another training set is refused, naming the
checkpoint to resume from instead (the latest sibling that passes every check), or saying how to start again without
losing count of the privacy spent (:mod:`hf_dp.ledger.resume`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .fingerprint import fingerprint_mismatch

__all__ = [
    "CheckpointDPStateError",
    "TrainingSetMismatchError",
    "check_checkpoint_dp_state",
    "checkpoint_step",
    "history_steps",
    "other_checkpoints",
    "read_checkpoint_dp_state",
]

TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def history_steps(history: Iterable[Iterable[float]]) -> int:
    """Noisy steps of a ``[sigma, q, steps]`` history."""
    return sum(int(segment[2]) for segment in history)


class CheckpointDPStateError(ValueError):
    """A checkpoint whose DP state cannot be trusted (missing, unreadable, edited, or from another training set)."""


def checkpoint_step(path: str) -> int | None:
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


def other_checkpoints(checkpoint: str) -> list[str]:
    """The other ``checkpoint-*`` folders next to ``checkpoint``, latest first."""
    parent = os.path.dirname(os.path.normpath(checkpoint)) or "."
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = [
        (step, os.path.join(parent, name))
        for name in names
        if (step := checkpoint_step(name)) is not None and os.path.isdir(os.path.join(parent, name))
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
    for other in other_checkpoints(checkpoint):
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
        f" No other checkpoint in {parent} has a valid DP state for this training set: start over without "
        "`resume_from_checkpoint` in the same `output_dir`, whose privacy ledger then counts the noisy steps already "
        "taken as spent (`earlier_runs='count'`, the default); a new `output_dir` would lose count of them."
    )
