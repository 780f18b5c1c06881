"""Account: the run's privacy record. The accountant's history lives in :class:`DPCallback` (saved with every
checkpoint), every noisy step is appended to the privacy ledger before the optimizer applies it, and a resume takes
the larger of the two (:mod:`.resume`), so the privacy spent never goes down. The math is in :mod:`hf_dp.accounting`.

* :mod:`.callback`: :class:`DPCallback`, the accountant, the budget stop and the checks of the frozen settings;
* :mod:`.ledger`: :class:`PrivacyLedger`, the training set's fingerprint and the checks of a checkpoint's DP state;
* :mod:`.resume`: the privacy spent, restored from a checkpoint and reconciled with the ledger.
"""

from .callback import DPCallback
from .ledger import (
    LEDGER_NAME,
    CheckpointDPStateError,
    PrivacyLedger,
    TrainingSetMismatchError,
    check_checkpoint_dp_state,
    data_fingerprint,
    fingerprint_key,
    fingerprint_mismatch,
    history_steps,
    ledger_history,
    new_run_id,
    read_checkpoint_dp_state,
)
from .resume import checkpoint_to_resume, restore_privacy_spent

__all__ = [
    "LEDGER_NAME",
    "CheckpointDPStateError",
    "DPCallback",
    "PrivacyLedger",
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
    "restore_privacy_spent",
]
