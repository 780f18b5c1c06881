"""Resuming a run: the privacy spent, loaded from a checkpoint and checked against the run's privacy ledgers.

The checkpoint's DP state is checked first (:func:`~hf_dp.ledger.checkpoint.check_checkpoint_dp_state`: a missing or
invalid ``trainer_state.json``, a missing, edited or truncated DP state, or another training set are refused, naming the
checkpoint to resume from instead). Then every record of the run hf_dp can find is read, each ledger's hash chain
verified (:func:`~hf_dp.ledger.ledger.read_ledger`): the ledger of ``output_dir``, the one of the folder the checkpoint
was saved in, and the copies the checkpoint and its siblings carry. The ledgers are the authority on what ran:

* the checkpoint must sit on the chain (its ``ledger_head`` after as many steps as its history counts), and every
  step's sigma and q, its C, and the run's delta, accountant, unit and k must be what the ledger recorded: a mismatch
  is refused, naming both values;
* steps the ledger records after the checkpoint (whose checkpoints were deleted by ``save_total_limit``, or never
  written) were still taken on this data, and their models logged or evaluated: they are counted, so epsilon never goes
  down across a resume;
* when no ledger of the folder the checkpoint was saved in reaches the checkpoint (deleted, replaced by another run's,
  rewound, or the checkpoint was copied from another folder), steps taken after it cannot be known: the console and the
  card say that the stated epsilon does not cover them.

The ledger of ``output_dir`` is then made whole again (the run's verified lines it lacks are appended), so that the
run goes on recording onto one chain.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers.trainer_utils import get_last_checkpoint

from ..step.distributed import broadcast_from_main
from .callback import DPCallback
from .checkpoint import CheckpointDPStateError, check_checkpoint_dp_state, history_steps, other_checkpoints
from .fingerprint import KEY_NAME
from .ledger import LEDGER_NAME, RunChain, read_ledger, record_link

logger = logging.getLogger("hf_dp")

__all__ = ["Reconciled", "checkpoint_to_resume", "reconcile_with_ledgers", "restore_privacy_spent"]


def checkpoint_to_resume(resume_from_checkpoint: str | bool, output_dir: str) -> str:
    """The checkpoint folder ``Trainer.train(resume_from_checkpoint=...)`` resumes from (``True``: the last one in
    ``output_dir``)."""
    if resume_from_checkpoint is not True:
        return resume_from_checkpoint
    checkpoint = get_last_checkpoint(output_dir)
    if checkpoint is None:
        raise ValueError(f"No checkpoint found in output_dir ({output_dir}) to resume from.")
    return checkpoint


@dataclass
class Reconciled:
    """What a resume continues from: the run's history (the checkpoint's, then the steps the ledgers record after it),
    the chain the run's ledger continues, the lines ``output_dir``'s ledger lacks, and what the epsilon leaves out."""

    history: list[list[float]]
    extra: int
    chain: RunChain | None
    missing_lines: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)


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
        fingerprint: the training set's (:func:`~hf_dp.ledger.fingerprint.data_fingerprint`), compared with the
            checkpoint's; ``fingerprint_key_is_new``: ``output_dir`` had no fingerprint key of the run that wrote the
            checkpoint (only the number of examples can then be compared).
        privacy_unit (`str`): the unit of the resumed run (it must be the unit the privacy was spent with).
        is_main_process (`bool`): the main process makes ``output_dir``'s ledger whole.

    Raises:
        ValueError: the checkpoint's DP state is refused, disagrees with the ledger, or was spent with another unit.
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
            "Resume with the same unit, or start over without `resume_from_checkpoint` in this `output_dir`: the card "
            "then says that the steps spent with the other unit are not covered."
        )
    # Every process must resume with the same history (the main one's files; others may not see them).
    reconciled = broadcast_from_main([reconcile_with_ledgers(checkpoint, attributes, output_dir)])[0]
    callback.load_state({"attributes": attributes})
    _apply(callback, reconciled, checkpoint, output_dir, is_main_process)
    return int(trainer_state.get("global_step", 0))


def _apply(callback: DPCallback, reconciled: Reconciled, checkpoint: str, output_dir: str, main: bool) -> None:
    saved = callback.steps
    if reconciled.extra > 0:
        logger.warning(
            "hf_dp: the privacy ledger of this run records %d noisy steps, checkpoint %s only %d: %d steps were "
            "taken after it (their checkpoints deleted, e.g. by `save_total_limit`, or never written). Resuming with "
            "the ledger's %d steps, so that epsilon accounts every step that ran.",
            saved + reconciled.extra,
            checkpoint,
            saved,
            reconciled.extra,
            saved + reconciled.extra,
        )
        callback.history = reconciled.history
        callback.plan = {}  # sigma is recalibrated (target_epsilon) for the larger past, never reused
        # With a known sampling seed (tests), the steps after the checkpoint draw fresh batches, never those of
        # the steps already taken after it (a replayed draw is not a fresh one: DESIGN §4 rule 15).
        callback.draw_offset += reconciled.extra
    if reconciled.chain is not None:
        callback.ledger_head = reconciled.chain.head
    for note in reconciled.not_covered:
        if note not in callback.not_covered:
            logger.warning("hf_dp: not covered by the stated epsilon: %s", note)
            callback.not_covered.append(note)
    if main and reconciled.missing_lines:
        with open(os.path.join(output_dir, LEDGER_NAME), "ab") as f:
            f.write("".join(reconciled.missing_lines).encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())


def reconcile_with_ledgers(checkpoint: str, attributes: Mapping[str, Any], output_dir: str) -> Reconciled:
    """Check the checkpoint's DP state (``attributes``) against every ledger of its run and decide what the resume
    continues from (module docstring).

    Raises:
        CheckpointDPStateError: the ledgers disagree with each other, or the checkpoint disagrees with them.
    """
    run_id = attributes["run_id"]
    home = _ledger_paths(output_dir, checkpoint)
    copies = [os.path.join(c, LEDGER_NAME) for c in [checkpoint, *other_checkpoints(checkpoint)]]
    chains = [c for p in dict.fromkeys([*home, *copies]) if (c := read_ledger(p).get(run_id)) is not None]
    longest = _agreeing_chain(chains)
    saved_history = [list(s) for s in attributes["history"]]
    saved = history_steps(saved_history)
    notes = [
        f"{c.path} is damaged ({c.problem}): no step it records after that line is counted" for c in chains if c.problem
    ]
    head = attributes.get("ledger_head")
    if longest is not None:
        _check_on_chain(checkpoint, longest, head, saved)
        _check_fields(checkpoint, attributes, longest, saved)
    if not any(_reaches(c, head, saved) for c in chains if c.path in home):
        known = max(saved, longest.steps if longest is not None else 0)
        notes.append(
            f"noisy steps that run {run_id[:8]} may have taken after its step {known} (the last one its records show): "
            f"no privacy ledger of the folder {checkpoint} was saved in records the run up to that checkpoint (the "
            "ledger was deleted, replaced or rewound, or the checkpoint was copied from another folder), so later "
            "steps cannot be counted"
        )
    if longest is not None and longest.base_steps > saved:
        raise CheckpointDPStateError(
            f"hf_dp: cannot resume {checkpoint}: the privacy ledger of its run ({longest.path}) was begun again at a "
            f"later checkpoint (step {longest.base_steps}), and the steps between them are known only to that "
            "checkpoint. Resume from the latest checkpoint (`resume_from_checkpoint=True`)."
        )
    if longest is None or longest.steps <= saved:
        return Reconciled(saved_history, 0, longest, _missing_lines(output_dir, run_id, longest), notes)
    history = _merge(saved_history, longest.history_after(saved))
    return Reconciled(history, longest.steps - saved, longest, _missing_lines(output_dir, run_id, longest), notes)


def _ledger_paths(output_dir: str, checkpoint: str) -> list[str]:
    """The ledgers a run writes as it goes: ``output_dir``'s, and the one of the folder the checkpoint was saved in."""
    parent = os.path.dirname(os.path.normpath(checkpoint)) or "."
    paths = [os.path.join(output_dir, LEDGER_NAME), os.path.join(parent, LEDGER_NAME)]
    return [os.path.abspath(p) for p in dict.fromkeys(os.path.abspath(p) for p in paths)]


def _agreeing_chain(chains: list[RunChain]) -> RunChain | None:
    """The longest chain, after checking that every other is the same chain, only shorter (copies are byte for byte
    copies of the run's lines: two ledgers that differ at a step hold two different histories of one run)."""
    if not chains:
        return None
    longest = max(chains, key=lambda c: c.steps)
    reference = longest.per_step()
    for chain in chains:
        for index, record in chain.per_step().items():
            other = reference.get(index)
            if other is not None and record_link(other) != record_link(record):
                raise CheckpointDPStateError(
                    f"hf_dp: cannot resume: the privacy ledgers of run {chain.run_id[:8]} disagree at step {index + 1} "
                    f"({chain.path} and {longest.path}): one of them was edited or replaced. Restore the run's "
                    "original dp_ledger.jsonl, or start over without `resume_from_checkpoint` in this `output_dir` "
                    "(the steps its ledger records are then carried as spent)."
                )
    return longest


def _check_on_chain(checkpoint: str, chain: RunChain, head: str | None, saved: int) -> None:
    """The checkpoint's ``ledger_head`` is the chain's after as many steps as the checkpoint's history counts."""
    if head is None:  # a checkpoint of an older hf_dp: its history is checked step by step only
        return
    at = chain.steps_up_to(head)
    if at is None or at != saved:
        where = "is not in" if at is None else f"is at step {at} of"
        raise CheckpointDPStateError(
            f"hf_dp: cannot resume: the DP state of {checkpoint} counts {saved} noisy steps, but its ledger position "
            f"{where} the privacy ledger of its run ({chain.path}): the checkpoint's DP state was edited, or belongs "
            "to another run. Resume from a checkpoint whose DP state agrees with the ledger, or start over without "
            "`resume_from_checkpoint` in this `output_dir` (the steps its ledger records are then carried as spent)."
        )


def _check_fields(checkpoint: str, attributes: Mapping[str, Any], chain: RunChain, saved: int) -> None:
    """Every step's sigma and q, and the checkpoint's C, delta, accountant, unit and k, are the ledger's."""
    steps = chain.per_step()
    index = 0
    for sigma, q, count in attributes["history"]:
        for _ in range(int(count)):
            record = steps.get(index)
            if record is not None:
                _same(checkpoint, chain, index, "noise_multiplier", sigma, record["noise_multiplier"])
                _same(checkpoint, chain, index, "sample_rate", q, record["sample_rate"])
            index += 1
    clip_norms = attributes.get("clip_norms") or []
    for index, clip in enumerate(clip_norms if len(clip_norms) == saved else []):  # adaptive: the C of every step
        if steps.get(index) is not None and steps[index].get("max_grad_norm") is not None:
            _same(checkpoint, chain, index, "max_grad_norm", clip, steps[index]["max_grad_norm"])
    last, plan = steps.get(saved - 1), attributes.get("plan") or {}
    if last is None or last.get("format", 1) < 2 or not plan:
        return
    fields = {"delta": "delta", "accountant": "accountant", "privacy_unit": "unit"}
    fields["max_examples_per_user"] = "max_examples_per_user"
    if not plan.get("adaptive_clipping"):
        fields["max_grad_norm"] = "max_grad_norm"
    for name, recorded in fields.items():
        if name in plan:
            _same(checkpoint, chain, saved - 1, name, plan[name], last.get(recorded))


def _same(checkpoint: str, chain: RunChain, index: int, name: str, saved: Any, recorded: Any) -> None:
    if saved == recorded or (
        isinstance(saved, int | float) and isinstance(recorded, int | float) and float(saved) == float(recorded)
    ):
        return
    raise CheckpointDPStateError(
        f"hf_dp: cannot resume: {checkpoint} says {name}={saved!r} for noisy step {index + 1}, but the privacy ledger "
        f"of the run ({chain.path}) recorded {name}={recorded!r} for it when the step ran: the checkpoint's DP state "
        "was edited. The ledger is the record of what ran: restore the checkpoint's trainer_state.json, resume from "
        "another checkpoint whose DP state agrees with the ledger, or start over without `resume_from_checkpoint` in "
        "this `output_dir` (the steps its ledger records are then carried as spent)."
    )


def _reaches(chain: RunChain, head: str | None, saved: int) -> bool:
    """Whether ``chain`` records the run at least up to the checkpoint."""
    if head is None:
        return chain.steps >= saved
    return chain.steps_up_to(head) is not None


def _merge(history: list[list[float]], after: list[list[float]]) -> list[list[float]]:
    merged = [list(s) for s in history]
    for sigma, q, n in after:
        if merged and (merged[-1][0], merged[-1][1]) == (sigma, q):
            merged[-1][2] += n
        else:
            merged.append([sigma, q, n])
    return merged


def _missing_lines(output_dir: str, run_id: str, chain: RunChain | None) -> list[str]:
    """The run's verified lines ``output_dir``'s ledger lacks (none if it already holds the chain, or a longer one)."""
    if chain is None:
        return []
    own = read_ledger(os.path.join(output_dir, LEDGER_NAME)).get(run_id)
    if own is None:
        return list(chain.lines) if chain.base_steps == 0 else []
    if own.steps >= chain.steps or own.base_steps != chain.base_steps:
        return []
    return list(chain.lines[len(own.records) :])
