"""BandMF: noise correlated across steps by a banded Toeplitz matrix (Choquette-Choo et al. 2023).

* :mod:`.strategy`: :class:`BandedToeplitzStrategy` and :func:`optimize_banded_toeplitz`, the coefficients optimized
  for the run's workload (prefix sums, momentum, a learning-rate schedule), and the sensitivity under min-separation;
* :mod:`.workload`: the workload's expected squared error and its gradient (float64);
* :mod:`.noise`: :class:`CorrelatedNoiseSource`, row ``t`` of ``C^{-1} Z`` from the run's secret stream.
"""

from .noise import CorrelatedNoiseSource
from .strategy import MAX_SCHEDULE_STEPS, BandedToeplitzStrategy, banded_sensitivity, optimize_banded_toeplitz

__all__ = [
    "MAX_SCHEDULE_STEPS",
    "BandedToeplitzStrategy",
    "CorrelatedNoiseSource",
    "banded_sensitivity",
    "optimize_banded_toeplitz",
]
