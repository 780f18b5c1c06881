"""Noisy steps of earlier runs in the same output folder: counted as spent, or said not to be covered.

A run that crashed before its first checkpoint leaves no checkpoint to resume, but its noisy steps ran on the training
data, and whatever it logged or evaluated depends on them; so does a run that finished in the same folder, when the next
one starts from its model. Their steps are in the folder's privacy ledger. When a run starts (or resumes), every other
run the ledger records is either

* counted (``earlier_runs="count"``, the default), when it trained on the same training set (the same fingerprint)
  with the same unit of privacy: its steps join the privacy spent, so the stated epsilon, the budget stop and the
  calibration of sigma cover them, and the card says so; or
* left out (``earlier_runs="exclude"``; a run on another training set, whose steps spend the privacy of this one's
  rows only where the two share rows; a run with another unit of privacy, whose guarantee does not compose with this
  one): the console and the card say that the stated epsilon does not cover them.

Runs counted by a checkpoint (its ``carried`` runs) stay counted on resume, wherever the checkpoint goes.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .ledger import LEDGER_NAME, RunChain, read_ledger

logger = logging.getLogger("hf_dp")

__all__ = ["EARLIER_RUNS_POLICIES", "account_earlier_runs", "earlier_runs"]

#: What a run does with the earlier runs of its output folder.
EARLIER_RUNS_POLICIES = ("count", "exclude")


def earlier_runs(output_dir: str, run_id: str | None, known: set[str]) -> list[RunChain]:
    """The runs ``output_dir``'s ledger records besides ``run_id`` and the ``known`` ones (already counted)."""
    chains = read_ledger(os.path.join(output_dir, LEDGER_NAME))
    return [c for rid, c in chains.items() if rid != run_id and rid not in known and c.steps > 0]


def account_earlier_runs(
    chains: list[RunChain], *, policy: str, privacy_unit: str, fingerprint: dict[str, Any]
) -> tuple[list[dict[str, Any]], list[str]]:
    """``(carried, not_covered)``: the runs of ``chains`` to count as spent (``{"run", "history"}``), and a sentence
    for each step left out (with a WARNING for each). ``fingerprint``: this run's training set's."""
    carried, notes = [], []
    for chain in chains:
        unit = next((r.get("unit") for r in chain.records if r.get("unit")), privacy_unit)
        steps = chain.steps
        name = f"earlier run {chain.run_id[:8]} in this output folder ({chain.path})"
        other_data = _other_training_set(chain, fingerprint)
        if chain.problem:
            notes.append(f"noisy steps of {name} recorded after a damaged line ({chain.problem})")
        if chain.base_steps:
            notes.append(f"the first {chain.base_steps} noisy steps of {name} (its ledger lines before them are lost)")
        if policy == "count" and unit == privacy_unit and other_data is None:
            carried.append({"run": chain.run_id, "history": chain.history()})
            logger.warning(
                "hf_dp: counting the %d noisy steps of %s as spent: the stated epsilon covers them too (set "
                "`earlier_runs='exclude'` to leave them out; the card then says they are not covered).",
                steps - chain.base_steps,
                name,
            )
            continue
        if policy != "count":
            why = "`earlier_runs='exclude'`"
        elif other_data is not None:
            why = f"it trained on another training set: {other_data}; its steps spend the privacy of rows both share"
        else:
            why = f"its unit of privacy is {unit!r}, not {privacy_unit!r}"
        notes.append(f"{steps} noisy steps of {name}, left out ({why})")
    for note in notes:
        logger.warning("hf_dp: not covered by the stated epsilon: %s.", note)
    return carried, notes


def _other_training_set(chain: RunChain, fingerprint: dict[str, Any]) -> str | None:
    """How the training set of ``chain``'s run differs from this run's (`None`: the same, as far as can be told)."""
    record = chain.records[-1] if chain.records else {}
    n, data = record.get("num_examples"), record.get("data")
    if n is not None and n != fingerprint.get("num_examples"):
        return f"N={n} rows, this run's N={fingerprint.get('num_examples')}"
    mine = fingerprint.get("rows") or fingerprint.get("datasets")
    if data and mine and data != mine:
        return f"N={n} rows like this run's, but another content (or a fingerprint keyed in another folder)"
    return None
