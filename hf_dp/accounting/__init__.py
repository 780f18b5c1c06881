"""Privacy accounting for the Poisson-subsampled Gaussian mechanism: RDP, GDP (CLT) and PRV.

Pure math lives in :mod:`.analysis`; :class:`PrivacyAccountant` holds the state of a run.
"""

from .accountant import PrivacyAccountant
from .functional import epsilon, noise_multiplier
from .methods import ACCOUNTANTS

__all__ = ["ACCOUNTANTS", "PrivacyAccountant", "epsilon", "noise_multiplier"]
