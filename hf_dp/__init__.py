"""hf_dp: differentially private fine-tuning of Hugging Face models with book-keeping clipping."""

from .engine import CLIPPING_MODES, BookKeepingClipper
from .layers import LayerRule, UnsupportedModuleError, register_rule

__version__ = "0.1.0"

__all__ = [
    "CLIPPING_MODES",
    "BookKeepingClipper",
    "LayerRule",
    "UnsupportedModuleError",
    "register_rule",
]
