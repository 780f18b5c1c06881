"""Privacy accounting for the Poisson-subsampled Gaussian mechanism: RDP and PRV (proven upper bounds) and GDP (a
central-limit estimate, for logs only).

Pure math lives in :mod:`.analysis`; :class:`PrivacyAccountant` holds the state of a run.
"""

from .accountant import PrivacyAccountant
from .functional import epsilon, noise_multiplier
from .methods import ACCOUNTANTS, PROVEN_ACCOUNTANTS, check_proven_accountant

__all__ = [
    "ACCOUNTANTS",
    "PROVEN_ACCOUNTANTS",
    "PrivacyAccountant",
    "check_proven_accountant",
    "epsilon",
    "noise_multiplier",
]
