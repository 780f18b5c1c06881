"""Deprecated location of the per-example gradient algebra: use :mod:`hf_dp.layers.grads`."""

import warnings

from ..layers.grads import *  # noqa: F403
from ..layers.grads import __all__  # noqa: F401

warnings.warn(
    "`hf_dp.engine.per_example` moved to `hf_dp.layers.grads`; the old path will be removed.",
    FutureWarning,
    stacklevel=2,
)
