"""Account: the run's privacy record. The accountant's history lives in :class:`DPCallback` (saved with every
checkpoint), every noisy step is appended to the hash-chained privacy ledger before the optimizer applies it, every
checkpoint carries the ledger up to its step, and a resume checks them against each other (:mod:`.resume`), so the
privacy spent never goes down. The math is in :mod:`hf_dp.accounting`.

* :mod:`.callback`: :class:`DPCallback`, the accountant, the budget stop and the checks of the frozen settings;
* :mod:`.ledger`: :class:`PrivacyLedger` and :func:`read_ledger`, the ledger's records and their chain;
* :mod:`.fingerprint`: the training set's keyed fingerprint;
* :mod:`.checkpoint`: the checks of a checkpoint's DP state;
* :mod:`.resume`: the privacy spent, restored from a checkpoint and reconciled with the ledgers;
* :mod:`.earlier_runs`: the noisy steps of earlier runs in the same output folder (counted, or said not covered).
"""

from .callback import DPCallback
from .checkpoint import (
    CheckpointDPStateError,
    TrainingSetMismatchError,
    check_checkpoint_dp_state,
    history_steps,
    read_checkpoint_dp_state,
)
from .fingerprint import KEY_NAME, data_fingerprint, fingerprint_key, fingerprint_mismatch
from .ledger import LEDGER_NAME, PrivacyLedger, RunChain, ledger_history, new_run_id, read_ledger
from .resume import checkpoint_to_resume, restore_privacy_spent

__all__ = [
    "KEY_NAME",
    "LEDGER_NAME",
    "CheckpointDPStateError",
    "DPCallback",
    "PrivacyLedger",
    "RunChain",
    "TrainingSetMismatchError",
    "check_checkpoint_dp_state",
    "checkpoint_to_resume",
    "data_fingerprint",
    "fingerprint_key",
    "fingerprint_mismatch",
    "history_steps",
    "ledger_history",
    "new_run_id",
    "read_checkpoint_dp_state",
    "read_ledger",
    "restore_privacy_spent",
]
