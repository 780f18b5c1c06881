"""Clipping policy: how trainable parameters are grouped and how a group's per-example norm becomes a coefficient.

Group-wise clipping (He et al. 2022, "Exploring the Limits of Differentially Private Deep Learning with Group-wise
Clipping"): the trainable parameters are split into ``G`` groups; example ``i``'s gradient restricted to group ``g``,
``g_{i,g}``, is clipped on its own at ``C_g = C / sqrt(G)``. Since ``sum_g C_g^2 = C^2``, the clipped per-example
gradient still has norm at most ``C``: the sensitivity of the sum, and so the privacy guarantee, is unchanged.

Coefficients (``c_{i,g}`` multiplies ``g_{i,g}``):

* ``"abadi"`` (Abadi et al. 2016): ``min(1, C_g / (||g_{i,g}|| + 1e-6))``;
* ``"automatic"`` (Bu, Wang, Zha, Karypis, NeurIPS 2023, "Automatic Clipping"): ``C_g / (||g_{i,g}|| + gamma)``,
  which normalises every per-example gradient (``||c g|| < C_g`` for any ``gamma > 0``).

An example whose group norm is not finite gets coefficient 0 in that group.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["CLIPPING_FNS", "CLIPPING_STYLES", "ClippingPolicy", "ParameterGroups"]

#: Named ways of grouping the trainable parameters (a list of groups of name patterns is the other way).
CLIPPING_STYLES: dict[str, str] = {
    "all-layer": "one group: the norm over every trainable parameter",
    "layer-wise": "one group per module that owns trainable parameters (modules sharing a parameter: one group)",
    "param-wise": "one group per trainable parameter",
}
#: Coefficient functions.
CLIPPING_FNS: dict[str, str] = {
    "abadi": "min(1, C_g / (||g_i|| + 1e-6))",
    "automatic": "C_g / (||g_i|| + gamma) (Bu et al. 2023)",
}

_CONTAINERS = (nn.ParameterDict, nn.ParameterList)


@dataclass(frozen=True)
class ParameterGroups:
    """The clipping groups of a model's trainable parameters: ``params[g]`` (in ``model.parameters()`` order) and
    their names ``names[g]`` (the first name of each parameter)."""

    params: tuple[tuple[nn.Parameter, ...], ...]
    names: tuple[tuple[str, ...], ...]

    def __len__(self) -> int:
        return len(self.params)

    def index(self) -> dict[nn.Parameter, int]:
        """The group of every trainable parameter."""
        return {p: g for g, group in enumerate(self.params) for p in group}


def _all_names(model: nn.Module) -> dict[nn.Parameter, list[str]]:
    names: dict[nn.Parameter, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    return names


def _own_trainable(module: nn.Module, trainable: set) -> list[nn.Parameter]:
    """A module's own trainable parameters, those of the parameter containers it holds included (peft keeps LoRA
    embedding factors in ``ParameterDict`` children: the holder uses them)."""
    own = [p for p in module.parameters(recurse=False)]
    for child in module.children():
        if isinstance(child, _CONTAINERS):
            own += list(child.parameters())
    return [p for p in own if p in trainable]


def _layer_groups(model: nn.Module, trainable: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """One group per module owning trainable parameters; modules sharing a parameter are merged (union-find)."""
    wanted = set(trainable)
    parent: dict[nn.Parameter, nn.Parameter] = {}

    def find(p):
        while parent[p] is not p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    for module in model.modules():
        if isinstance(module, _CONTAINERS):
            continue
        own = _own_trainable(module, wanted)
        for p in own:
            parent.setdefault(p, p)
        for p in own[1:]:
            parent[find(p)] = find(own[0])
    groups: dict[nn.Parameter, list[nn.Parameter]] = {}
    for p in trainable:
        parent.setdefault(p, p)  # a parameter no module owns (cannot happen for nn.Module trees): its own group
        groups.setdefault(find(p), []).append(p)
    return list(groups.values())


def _pattern_groups(
    patterns: Sequence[Sequence[str]], trainable: list[nn.Parameter], names: dict[nn.Parameter, list[str]]
) -> list[list[nn.Parameter]]:
    groups: list[list[nn.Parameter]] = [[] for _ in patterns]
    missing, doubled = [], []
    for p in trainable:
        hits = [
            g
            for g, group in enumerate(patterns)
            if any(fnmatch.fnmatchcase(name, pattern) for name in names[p] for pattern in group)
        ]
        if not hits:
            missing.append(names[p][0])
        elif len(hits) > 1:
            doubled.append(f"{names[p][0]} (groups {hits})")
        else:
            groups[hits[0]].append(p)
    if missing or doubled:
        parts = []
        if missing:
            parts.append(f"in no group: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if doubled:
            parts.append(f"in several groups: {doubled[:8]}{' ...' if len(doubled) > 8 else ''}")
        raise ValueError(
            f"`clipping_style` groups must put every trainable parameter in exactly one group; trainable parameters "
            f"{'; '.join(parts)}. Each parameter would otherwise be left unclipped or clipped twice. Add or narrow "
            "the `fnmatch` patterns (matched against `model.named_parameters()` names), or freeze the parameters."
        )
    empty = [list(patterns[g]) for g, group in enumerate(groups) if not group]
    if empty:
        raise ValueError(
            f"`clipping_style` groups {empty} match no trainable parameter: an empty group would take a share "
            "C / sqrt(G) of the clipping norm for nothing. Remove them or fix their patterns."
        )
    return groups


def _check_style(style) -> str | tuple[tuple[str, ...], ...]:
    if isinstance(style, str):
        if style not in CLIPPING_STYLES:
            raise ValueError(
                f"Unknown `clipping_style` {style!r}. Choose one of {sorted(CLIPPING_STYLES)}, or pass groups of "
                "parameter-name patterns (a list of lists of `fnmatch` patterns)."
            )
        return style
    if not isinstance(style, Sequence) or not style:
        raise TypeError(
            "`clipping_style` must be one of "
            f"{sorted(CLIPPING_STYLES)} or a non-empty list of lists of parameter-name patterns, got "
            f"{type(style).__name__}"
        )
    groups = []
    for group in style:
        if isinstance(group, str) or not isinstance(group, Sequence) or not group:
            raise TypeError(
                "Each `clipping_style` group must be a non-empty list of parameter-name patterns (strings), got "
                f"{type(group).__name__}"
            )
        if not all(isinstance(x, str) for x in group):
            raise TypeError(f"`clipping_style` patterns must be strings, got {[type(x).__name__ for x in group]}")
        groups.append(tuple(group))
    return tuple(groups)


class ClippingPolicy:
    """How per-example gradients are clipped: the grouping of the parameters and the coefficient function.

    Args:
        max_grad_norm (`float`): the total clipping norm ``C`` (> 0).
        style (`str` or `list[list[str]]`, *optional*, defaults to `"all-layer"`): one of :data:`CLIPPING_STYLES`,
            or groups of ``fnmatch`` patterns over ``model.named_parameters()`` names (every name of a tied
            parameter counts); every trainable parameter must match exactly one group.
        fn (`str`, *optional*, defaults to `"abadi"`): one of :data:`CLIPPING_FNS`.
        gamma (`float`, *optional*, defaults to 0.01): the stability constant of automatic clipping (> 0).

    Raises:
        ValueError: an unknown style or function, a non-positive ``C`` or ``gamma``.
        TypeError: a style that is neither a name nor a list of lists of strings.

    Example:
        ```python
        policy = ClippingPolicy(max_grad_norm=1.0, style="layer-wise", fn="automatic")
        groups = policy.groups(model)
        coef = policy.coefficients(norms, len(groups))  # norms: [G, B]
        ```
    """

    def __init__(self, *, max_grad_norm: float, style="all-layer", fn: str = "abadi", gamma: float = 0.01) -> None:
        if not max_grad_norm > 0:
            raise ValueError(f"`max_grad_norm` must be > 0, got {max_grad_norm}.")
        if fn not in CLIPPING_FNS:
            raise ValueError(f"Unknown `clipping_fn` {fn!r}. Choose one of {sorted(CLIPPING_FNS)}.")
        if not gamma > 0:
            raise ValueError(
                f"`gamma` must be > 0, got {gamma}: automatic clipping divides by ||g_i|| + gamma, and gamma = 0 "
                "would blow up examples with a tiny gradient."
            )
        self.max_grad_norm = float(max_grad_norm)
        self.style = _check_style(style)
        self.fn = fn
        self.gamma = float(gamma)

    def __repr__(self) -> str:
        return f"ClippingPolicy(max_grad_norm={self.max_grad_norm}, style={self.style!r}, fn={self.fn!r}" + (
            f", gamma={self.gamma})" if self.fn == "automatic" else ")"
        )

    @property
    def is_all_layer(self) -> bool:
        return self.style == "all-layer"

    def groups(self, model: nn.Module, trainable: list[nn.Parameter] | None = None) -> ParameterGroups:
        """The clipping groups of ``model``'s trainable parameters (``trainable``, in ``model.parameters()`` order).

        Raises:
            ValueError: pattern groups that leave a trainable parameter out, put one in several groups, or match
                nothing.
        """
        if trainable is None:
            trainable = [p for p in model.parameters() if p.requires_grad]
        names = _all_names(model)
        if self.style == "all-layer":
            groups = [list(trainable)]
        elif self.style == "param-wise":
            groups = [[p] for p in trainable]
        elif self.style == "layer-wise":
            groups = _layer_groups(model, trainable)
        else:
            groups = _pattern_groups(self.style, trainable, names)
        return ParameterGroups(
            params=tuple(tuple(g) for g in groups),
            names=tuple(tuple(names[p][0] for p in g) for g in groups),
        )

    def threshold(self, num_groups: int) -> float:
        """``C_g = C / sqrt(G)``: equal shares whose squares add up to ``C^2``."""
        return self.max_grad_norm / max(num_groups, 1) ** 0.5

    def coefficients(self, norms: Tensor, num_groups: int) -> Tensor:
        """Per-example coefficients for the (unclipped) group norms ``norms`` (any shape; 0 where not finite)."""
        c = self.threshold(num_groups)
        if self.fn == "automatic":
            coef = c / (norms + self.gamma)
        else:
            coef = (c / (norms + 1e-6)).clamp(max=1.0)
        return torch.where(torch.isfinite(norms), coef, torch.zeros_like(coef))
