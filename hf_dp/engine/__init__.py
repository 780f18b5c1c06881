"""The book-keeping clipping engine."""

from .clipper import CLIPPING_MODES, BookKeepingClipper
from .coverage import plan_coverage
from .policy import CLIPPING_FNS, CLIPPING_STYLES, ClippingPolicy
from .self_check import SELF_CHECK_TOLERANCE, SelfCheckError

__all__ = [
    "CLIPPING_FNS",
    "CLIPPING_MODES",
    "CLIPPING_STYLES",
    "SELF_CHECK_TOLERANCE",
    "BookKeepingClipper",
    "ClippingPolicy",
    "SelfCheckError",
    "plan_coverage",
]
