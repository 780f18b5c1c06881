"""The layer-rule registry: exact module types, then named predicates, then the torch.func fallback."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .base import LayerRule

__all__ = ["RULES", "PREDICATE_RULES", "find_rule", "register_predicate_rule", "register_rule"]

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


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule for ``module`` by exact type, then by predicate; ``None`` if neither matches."""
    rule = RULES.get(type(module))
    if rule is not None:
        return rule
    for predicate, predicate_rule in PREDICATE_RULES.values():
        if predicate(module):
            return predicate_rule
    return None
