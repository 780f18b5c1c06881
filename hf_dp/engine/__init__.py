"""The book-keeping clipping engine."""

from .clipper import CLIPPING_MODES, BookKeepingClipper
from .coverage import plan_coverage

__all__ = ["CLIPPING_MODES", "BookKeepingClipper", "plan_coverage"]
