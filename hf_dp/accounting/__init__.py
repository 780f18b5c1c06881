"""Privacy accounting for the Poisson-subsampled Gaussian mechanism: RDP and PRV (proven upper bounds) and GDP (a
central-limit estimate, for logs only).

Pure math lives in :mod:`.analysis`; :class:`PrivacyAccountant` holds the state of a run; :mod:`.banded` maps BandMF
(banded matrix-factorization noise under cyclic Poisson sampling) to the equivalent DP-SGD history.
"""

from .accountant import PrivacyAccountant
from .banded import (
    banded_participations,
    banded_segments,
    epsilon_banded,
    epsilon_banded_unamplified,
    sigma_for_banded,
)
from .functional import epsilon, noise_multiplier
from .methods import ACCOUNTANTS, PROVEN_ACCOUNTANTS, check_proven_accountant

__all__ = [
    "ACCOUNTANTS",
    "PROVEN_ACCOUNTANTS",
    "PrivacyAccountant",
    "banded_participations",
    "banded_segments",
    "check_proven_accountant",
    "epsilon",
    "epsilon_banded",
    "epsilon_banded_unamplified",
    "noise_multiplier",
    "sigma_for_banded",
]
