"""Layer rules: per-example gradients of each supported module type, one file per rule.

Importing this package registers every built-in rule.
"""

from . import conv, conv1d_hf, embedding, layernorm, linear, lora, prefix, rmsnorm  # noqa: F401  (registration)
from .base import Captured, LayerRule, NeedsFallback, UnsupportedModuleError
from .fallback import FALLBACK_RULE, FallbackRule
from .registry import PREDICATE_RULES, RULES, find_rule, register_predicate_rule, register_rule

__all__ = [
    "FALLBACK_RULE",
    "PREDICATE_RULES",
    "RULES",
    "Captured",
    "FallbackRule",
    "LayerRule",
    "NeedsFallback",
    "UnsupportedModuleError",
    "find_rule",
    "register_predicate_rule",
    "register_rule",
]
