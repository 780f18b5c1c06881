"""The layer-rule registry: exact module types, then named predicates, then registered base classes, then the
torch.func fallback."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .base import LayerRule

__all__ = [
    "PREDICATE_RULES",
    "RULES",
    "RuleMatch",
    "find_rule",
    "match_rule",
    "register_predicate_rule",
    "register_rule",
]

#: Exact module type -> rule instance.
RULES: dict[type, LayerRule] = {}
#: Name -> (predicate, rule), for per-model classes such as ``LlamaRMSNorm``.
PREDICATE_RULES: dict[str, tuple[Callable[[nn.Module], bool], LayerRule]] = {}


def register_rule(*module_types: type, override: bool = False):
    """Class decorator: register a rule for exact module types.

    Example:
        ```python
        @register_rule(nn.Linear)
        class LinearRule(LayerRule): ...
        ```
    """

    def wrap(cls: type[LayerRule]) -> type[LayerRule]:
        rule = cls()
        for module_type in module_types:
            if module_type in RULES and not override:
                raise ValueError(
                    f"A rule for {module_type.__name__} is already registered ({type(RULES[module_type]).__name__}). "
                    "Pass `override=True` to replace it."
                )
            RULES[module_type] = rule
        return cls

    return wrap


def register_predicate_rule(name: str, predicate: Callable[[nn.Module], bool], override: bool = False):
    """Class decorator: register a rule for every module for which ``predicate(module)`` is true."""

    def wrap(cls: type[LayerRule]) -> type[LayerRule]:
        if name in PREDICATE_RULES and not override:
            raise ValueError(f"A predicate rule named {name!r} is already registered. Pass `override=True`.")
        PREDICATE_RULES[name] = (predicate, cls())
        return cls

    return wrap


@dataclass(frozen=True)
class RuleMatch:
    """How a rule was found for a module.

    ``exact`` is true when the rule was registered for the module's own type and the instance keeps its class's
    ``forward``: the rule is then asserted to hold, and a numerical disagreement with autograd is an error. Otherwise
    (a predicate such as a class name, or a registered base class of a subclass) the rule is a guess that the engine
    verifies on the first batch; a subclass whose ``forward`` differs from ``base``'s is tried as ``base``'s output
    times a constant, and goes to the fallback if that does not hold.
    """

    rule: LayerRule
    exact: bool
    base: type | None = None  # the registered base class, for a subclass


def match_rule(module: nn.Module) -> RuleMatch | None:
    """The rule for ``module``: exact type, then predicates, then the nearest registered base class; else ``None``."""
    own_forward = "forward" in vars(module)
    rule = RULES.get(type(module))
    if rule is not None:
        return RuleMatch(rule, exact=not own_forward)
    for predicate, predicate_rule in PREDICATE_RULES.values():
        if predicate(module):
            return RuleMatch(predicate_rule, exact=False)
    for base in type(module).__mro__[1:]:
        rule = RULES.get(base)
        if rule is not None:
            return RuleMatch(rule, exact=False, base=base)
    return None


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule for ``module`` (see :func:`match_rule`); ``None`` if nothing matches."""
    match = match_rule(module)
    return None if match is None else match.rule
