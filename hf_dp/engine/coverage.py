"""Static coverage: which module's rule covers which trainable parameter, before any forward pass.

Every module that owns a trainable parameter is hooked for it (closed-form rule, or the torch.func fallback for what
its rule does not cover), so a weight tied between an ``nn.Linear`` and an embedding subclass is covered in both;
unless another module's rule covers it for its owner (SpecAugment's mask embedding, :mod:`hf_dp.layers.spec_augment`).
This is the early check (BatchNorm, uncovered parameters); the engine then proves on the first batch that every
use of every parameter is covered exactly once (:mod:`.planner`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from ..layers import FALLBACK_RULE, LayerRule, NeedsFallback, RuleMatch, UnsupportedModuleError, match_rule
from ..layers.base import own_named_parameters
from ..layers.prefix import check_prefix_encoder
from .listing import ModelListing

logger = logging.getLogger(__name__)
_warned_fallback_types: set[type] = set()

__all__ = ["HookedModule", "plan_coverage", "trainable_parameters"]


@dataclass(eq=False)
class HookedModule:
    """A module the engine hooks, its rule, and the trainable parameters the rule covers there.

    ``promoted`` holds the parameters this module covers for uses inside its forward by other modules (a functional
    use, a table without a batch dimension): while it runs, no module inside it counts them (the outermost wins).
    """

    name: str
    module: nn.Module
    rule: LayerRule
    params: list[nn.Parameter]
    match: RuleMatch | None = None
    promoted: frozenset = field(default_factory=frozenset)

    @functools.cached_property
    def is_fallback(self) -> bool:
        """Whether the rule is the torch.func fallback (read per call: decided once, the rule never changes)."""
        return self.rule.layout == "any"


def trainable_parameters(model: nn.Module, listing: ModelListing | None = None) -> list[nn.Parameter]:
    """Unique parameters with ``requires_grad`` (tied parameters once); ``listing``: the model's, if the caller has
    just listed it."""
    return [p for p in (model.parameters() if listing is None else listing.parameters) if p.requires_grad]


_CONTAINERS = (nn.ParameterDict, nn.ParameterList)


def _own_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The module's own parameters, and those of the parameter containers it holds (peft keeps LoRA embedding
    factors in ``ParameterDict`` children, which are never called: the holder is the one that uses them)."""
    own = own_named_parameters(module)
    for child_name, child in module.named_children():
        if isinstance(child, _CONTAINERS):
            own += [(f"{child_name}.{n}", p) for n, p in child.named_parameters()]
    return own


def _reject_batch_statistics(named: list[tuple[str, nn.Module]]) -> None:
    for name, module in named:
        if isinstance(module, _BatchNorm):
            raise UnsupportedModuleError(
                f"Module `{name}` ({type(module).__name__}) is a BatchNorm layer: its output for one example depends "
                "on the others in the batch, so no per-example gradient exists and DP-SGD cannot bound the "
                "sensitivity (frozen or not: in training mode it normalises with the batch's statistics). Before "
                "training, call `model = hf_dp.replace_batchnorm(model)`: it replaces each `BatchNorm*d(num_channels)` "
                "with a per-example normalisation, `torch.nn.GroupNorm(num_groups, num_channels)` with its weight and "
                "bias (the conversion of Opacus `ModuleValidator.fix(model)`; the pretrained statistics are lost, so "
                'fine-tune after converting); `hf_dp.replace_batchnorm(model, strategy="frozen")` instead keeps each '
                "one in eval mode for good (running statistics fixed, weight and bias trainable). Or use `LayerNorm`, "
                "or choose a model without BatchNorm (vision: ViT, DeiT, BEiT, Swin, ConvNeXt, DINOv2 train with "
                "LayerNorm; ResNet, SegFormer, MobileNet, EfficientNet, RegNet use BatchNorm)."
            )
        if (
            isinstance(module, _InstanceNorm)
            and module.track_running_stats
            and any(p.requires_grad for p in module.parameters())
        ):
            raise UnsupportedModuleError(
                f"Module `{name}` ({type(module).__name__}) updates running statistics inside its forward pass, "
                "which hf_dp would have to re-run per example. Set `track_running_stats=False` or freeze it."
            )


def plan_coverage(
    model: nn.Module, *, allow_fallback: bool = True, listing: ModelListing | None = None
) -> list[HookedModule]:
    """Assign every trainable parameter of ``model`` to each module that owns it, with that module's rule.

    A parameter shared by several modules (tied weights) is covered by each of them; the engine adds the uses up
    exactly. A module whose rule does not cover all of its own trainable parameters gets the torch.func fallback
    for the rest.

    Args:
        model (`nn.Module`): the model.
        allow_fallback (`bool`, *optional*, defaults to `True`): use the fallback for parameters no rule covers.
        listing (`ModelListing`, *optional*): the model's modules and parameters, if the caller has just listed them.

    Returns:
        `list[HookedModule]`: the hooked modules, in ``named_modules`` order.

    Raises:
        UnsupportedModuleError: BatchNorm (or running statistics) in the model, an unsupported configuration of a
            layer, or a trainable parameter nothing covers with ``allow_fallback=False``.
    """
    named = list(model.named_modules()) if listing is None else listing.named_modules
    _reject_batch_statistics(named)
    trainable = {id(p) for p in trainable_parameters(model, listing)}
    matched: list[tuple[str, nn.Module, RuleMatch | None, list[tuple[str, nn.Parameter]]]] = []
    for name, module in named:
        check_prefix_encoder(module, name)
        if not isinstance(module, _CONTAINERS):  # a container is never called: the module that holds it uses them
            matched.append((name, module, _applicable_match(module, name), _own_parameters(module)))
    delegated = _delegated(matched)
    hooked: list[HookedModule] = []
    for name, module, match, own_params in matched:
        covered: set[int] = delegated
        if match is not None:
            params = [p for p in match.rule.parameters(module) if id(p) in trainable]
            covered = {id(p) for p in params} | delegated
            own = [n for n, p in own_params if id(p) in trainable and id(p) not in covered]
            if own and not match.exact:  # a guessed rule that does not cover the module: the fallback takes it all
                match, covered = None, delegated
            elif params:
                hooked.append(HookedModule(name, module, match.rule, params, match))
        own = [(n, p) for n, p in own_params if id(p) in trainable and id(p) not in covered]
        if own:
            hooked.append(_fallback_entry(name, module, own, rule_found=match is not None, allow=allow_fallback))
    return hooked


def _delegated(matched: list[tuple[str, nn.Module, RuleMatch | None, list[tuple[str, nn.Parameter]]]]) -> set[int]:
    """Ids of the parameters a module's rule covers for another module, their owner (SpecAugment's mask embedding:
    its owner's masking method runs as the call of a child, :mod:`hf_dp.layers.spec_augment`): the owner is not hooked
    for them. ``matched``: each module with its rule match and its own parameters."""
    delegated: set[int] = set()
    for _, module, match, own_params in matched:
        if match is not None:
            own = {id(p) for _, p in own_params}
            delegated |= {id(p) for p in match.rule.parameters(module) if id(p) not in own}
    return delegated


def _applicable_match(module: nn.Module, name: str) -> RuleMatch | None:
    """The rule matched for ``module``, unless it refuses this configuration of the module (``NeedsFallback``)."""
    match = match_rule(module)
    if match is not None:
        try:
            match.rule.check(module, name)
        except NeedsFallback as err:
            logger.info("%s", err)
            match = None
    return match


def _fallback_entry(
    name: str, module: nn.Module, own: list[tuple[str, nn.Parameter]], *, rule_found: bool, allow: bool
) -> HookedModule:
    """The torch.func fallback on ``module`` for its own trainable parameters ``own`` that no rule covers (refused
    where a rule was found for the module, or without ``allow``)."""
    names = [n for n, _ in own]
    if rule_found or not allow:
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
    return HookedModule(name, module, FALLBACK_RULE, [p for _, p in own])
