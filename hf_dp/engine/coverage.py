"""Which rule covers which trainable parameter; errors for what nothing covers."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..layers import FALLBACK_RULE, LayerRule, NeedsFallback, UnsupportedModuleError, find_rule
from ..layers.prefix import check_prefix_encoder

logger = logging.getLogger(__name__)
_warned_fallback_types: set[type] = set()

__all__ = ["HookedModule", "plan_coverage", "trainable_parameters"]


@dataclass(eq=False)
class HookedModule:
    """A module the engine hooks, its rule, and the trainable parameters the rule covers there."""

    name: str
    module: nn.Module
    rule: LayerRule
    params: list[nn.Parameter]


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Unique parameters with ``requires_grad`` (tied parameters once)."""
    return [p for p in model.parameters() if p.requires_grad]


def _reject_batch_norm(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm):
            raise UnsupportedModuleError(
                f"Module `{name}` ({type(module).__name__}) is a BatchNorm layer: its output for one example depends "
                "on the others in the batch, so no per-example gradient exists and DP-SGD cannot bound the "
                "sensitivity. Replace it with GroupNorm or LayerNorm (Opacus `ModuleValidator.fix` does this)."
            )


def plan_coverage(model: nn.Module, *, allow_fallback: bool = True) -> list[HookedModule]:
    """Assign every trainable parameter of ``model`` to the module(s) whose rule computes its per-example gradient.

    A parameter shared by several modules (tied weights) is covered by each of them; the engine adds the uses up
    exactly. Raises :class:`UnsupportedModuleError` for BatchNorm and for a trainable parameter nothing covers.
    """
    _reject_batch_norm(model)
    trainable = set(trainable_parameters(model))
    hooked: list[HookedModule] = []
    covered: set[nn.Parameter] = set()
    ruled_modules: set[nn.Module] = set()
    for name, module in model.named_modules():
        check_prefix_encoder(module, name)
        rule = find_rule(module)
        if rule is None:
            continue
        try:
            rule.check(module, name)
        except NeedsFallback as err:
            logger.info("%s", err)
            continue
        ruled_modules.add(module)
        params = [p for p in rule.parameters(module) if p in trainable]
        if params:
            hooked.append(HookedModule(name, module, rule, params))
            covered.update(params)
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p in trainable and p not in covered]
        if not own:
            continue
        own_ids = {id(p) for p in own}
        names = [n for n, p in module.named_parameters(recurse=False) if id(p) in own_ids]
        if module in ruled_modules or not allow_fallback:
            raise UnsupportedModuleError(
                f"Trainable parameter(s) {names} of module `{name}` ({type(module).__name__}) are not covered by any "
                "layer rule. Freeze them (`requires_grad_(False)`), register a rule with "
                "`hf_dp.layers.register_rule`, or allow the torch.func fallback (`allow_fallback=True`)."
            )
        if type(module) not in _warned_fallback_types:
            _warned_fallback_types.add(type(module))
            logger.warning(
                "hf_dp: no closed-form rule for %s (e.g. `%s`); using the torch.func fallback, which instantiates "
                "per-example gradients for its own parameters %s.",
                type(module).__name__,
                name,
                names,
            )
        hooked.append(HookedModule(name, module, FALLBACK_RULE, own))
        covered.update(own)
    missing = trainable - covered
    if missing:  # unreachable with the fallback on: every parameter has an owning module
        raise UnsupportedModuleError(f"{len(missing)} trainable parameters are not covered by any rule.")
    return hooked
