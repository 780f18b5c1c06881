"""The book-keeping clipping engine."""

from .clipper import CLIPPING_MODES, BookKeepingClipper
from .coverage import plan_coverage
from .self_check import SELF_CHECK_TOLERANCE, SelfCheckError

__all__ = ["CLIPPING_MODES", "SELF_CHECK_TOLERANCE", "BookKeepingClipper", "SelfCheckError", "plan_coverage"]
