"""Layer rules: per-example gradients of each supported module type, one file per rule.

Importing this package registers every built-in rule.
"""

from . import (  # noqa: F401
    conv,
    conv1d_hf,
    embedding,
    embedding_bag,
    layernorm,
    linear,
    loha,
    lokr,
    lora,
    prefix,
    rmsnorm,
    spec_augment,
)
from .base import LAYOUT_KINDS, Captured, LayerRule, Layout, NeedsFallback, UnsupportedModuleError
from .fallback import FALLBACK_RULE, FallbackRule
from .registry import (
    PREDICATE_RULES,
    RULES,
    RuleMatch,
    find_rule,
    match_rule,
    register_predicate_rule,
    register_rule,
)
from .scaled import ScaledRule

__all__ = [
    "FALLBACK_RULE",
    "LAYOUT_KINDS",
    "PREDICATE_RULES",
    "RULES",
    "Captured",
    "FallbackRule",
    "LayerRule",
    "Layout",
    "NeedsFallback",
    "RuleMatch",
    "ScaledRule",
    "UnsupportedModuleError",
    "find_rule",
    "match_rule",
    "register_predicate_rule",
    "register_rule",
]
