"""Resuming a run: the privacy spent, loaded from a checkpoint and reconciled with the run's privacy ledger.

The checkpoint's DP state is checked first (:func:`~hf_dp.ledger.ledger.check_checkpoint_dp_state`: a missing or
invalid ``trainer_state.json``, a missing, edited or truncated DP state, or another training set are refused, naming the
checkpoint to resume from instead). The history is then the larger of the checkpoint's and the privacy ledger's for
the checkpoint's run: steps taken after the checkpoint (whose checkpoints were deleted by ``save_total_limit``, or
never written) were still taken on this data, and their models were logged or evaluated, so epsilon never goes down
across a resume.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from transformers.trainer_utils import get_last_checkpoint

from ..step.distributed import broadcast_from_main
from .callback import DPCallback
from .ledger import KEY_NAME, LEDGER_NAME, PrivacyLedger, check_checkpoint_dp_state, history_steps, ledger_history

logger = logging.getLogger("hf_dp")

__all__ = ["checkpoint_to_resume", "restore_privacy_spent"]


def checkpoint_to_resume(resume_from_checkpoint: str | bool, output_dir: str) -> str:
    """The checkpoint folder ``Trainer.train(resume_from_checkpoint=...)`` resumes from (``True``: the last one in
    ``output_dir``)."""
    if resume_from_checkpoint is not True:
        return resume_from_checkpoint
    checkpoint = get_last_checkpoint(output_dir)
    if checkpoint is None:
        raise ValueError(f"No checkpoint found in output_dir ({output_dir}) to resume from.")
    return checkpoint


def restore_privacy_spent(
    callback: DPCallback,
    checkpoint: str,
    *,
    output_dir: str,
    fingerprint: Mapping[str, Any],
    fingerprint_key_is_new: bool,
    privacy_unit: str,
    is_main_process: bool,
) -> int:
    """Load the privacy spent from ``checkpoint`` into ``callback``; returns the checkpoint's global step.

    Args:
        fingerprint: the training set's (:func:`~hf_dp.ledger.ledger.data_fingerprint`), compared with the
            checkpoint's; ``fingerprint_key_is_new``: ``output_dir`` had no fingerprint key of the run that wrote the
            checkpoint (only the number of examples can then be compared).
        privacy_unit (`str`): the unit of the resumed run (it must be the unit the privacy was spent with).
        is_main_process (`bool`): the main process writes the ledger lines a checkpoint has and the ledger lost.

    Raises:
        ValueError: the checkpoint's DP state is refused, or it was spent with another unit of privacy.
    """
    if fingerprint_key_is_new:  # the checkpoint's fingerprint has another folder's key: N is all we can compare
        logger.warning(
            "hf_dp: %s has no fingerprint key (%s) from the run that wrote %s: only the number of training "
            "examples is checked against the checkpoint, not their content.",
            output_dir,
            KEY_NAME,
            checkpoint,
        )
        fingerprint = {**fingerprint, "rows": None, "datasets": None}
    trainer_state, attributes = check_checkpoint_dp_state(checkpoint, fingerprint)
    spent_unit = (attributes.get("plan") or {}).get("privacy_unit", "example")
    if attributes.get("history") and spent_unit != privacy_unit:
        raise ValueError(
            f"hf_dp: cannot resume {checkpoint} with `privacy_unit={privacy_unit!r}`: its privacy was spent with "
            f"`privacy_unit={spent_unit!r}`, and guarantees for different units of privacy do not compose into one. "
            "Resume with the same unit, or start a new run in a new `output_dir`."
        )
    callback.load_state({"attributes": attributes})
    ledgers = [
        os.path.join(output_dir, LEDGER_NAME),
        os.path.join(os.path.dirname(os.path.normpath(checkpoint)), LEDGER_NAME),
    ]
    _reconcile_with_ledger(callback, checkpoint, ledgers, fingerprint, output_dir, is_main_process)
    return int(trainer_state.get("global_step", 0))


def _reconcile_with_ledger(
    callback: DPCallback,
    checkpoint: str,
    ledgers: list[str],
    fingerprint: Mapping[str, Any],
    output_dir: str,
    is_main_process: bool,
) -> None:
    """The larger of the checkpoint's history and the ledger's: steps the ledger has after the checkpoint are
    counted; steps the checkpoint has and the ledger lost are written back to it."""
    saved = callback.steps
    # Every process must resume with the same history (the main one's files; others may not see them).
    recorded = broadcast_from_main([ledger_history(ledgers, callback.run_id)])[0]
    extra = history_steps(recorded) - saved
    if extra > 0:
        logger.warning(
            "hf_dp: the privacy ledger of this run (%s) records %d noisy steps, checkpoint %s only %d: %d steps "
            "were taken after it (their checkpoints deleted, e.g. by `save_total_limit`, or never written). "
            "Resuming with the ledger's %d steps, the larger of the two, so that epsilon accounts every step that "
            "ran.",
            ledgers[0],
            saved + extra,
            checkpoint,
            saved,
            extra,
            saved + extra,
        )
        callback.history = recorded
        callback.plan = {}  # sigma is recalibrated (target_epsilon) for the larger past, never reused
        # With a known sampling seed (tests), the steps after the checkpoint draw fresh batches, never those of
        # the steps already taken after it (a replayed draw is not a fresh one: DESIGN §4 rule 15).
        callback.draw_offset += extra
    elif extra < 0 and is_main_process:
        # A ledger that lost lines (or a checkpoint copied from elsewhere): it gets the checkpoint's steps back.
        backfill = PrivacyLedger(output_dir, callback.run_id, fingerprint)
        index = 0
        for sigma, q, steps in callback.history:
            for _ in range(int(steps)):
                if index >= saved + extra:
                    backfill.record(index, sigma, q)
                index += 1
        backfill.flush(sync=True)
