"""A subclass whose ``forward`` is its base class's output times a constant: ``y = s * f(x; theta)``.

Many models scale their token embeddings (BART's ``BartScaledWordEmbedding`` multiplies by ``sqrt(d_model)``,
Gemma-3's ``Gemma3TextScaledWordEmbedding`` by its ``embed_scale``). With ``y = s f`` and output gradient ``g``,
``dL/dtheta = (s g)^T df/dtheta``: the base rule applied to the output gradient ``s g``. The engine measures ``s``
on the first batch (the ratio of the subclass's output to the base class's ``forward`` on the same input) and
checks the result numerically against autograd before using it; otherwise the module goes to the fallback.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .base import Captured, LayerRule
from .grads import PerExampleGrad

__all__ = ["ScaledRule"]


class ScaledRule(LayerRule):
    """The rule ``base`` for a module whose output is ``scale`` times what ``base`` describes.

    Args:
        base (`LayerRule`): the rule of the registered base class.
        scale (`float`): the constant ``s``.
    """

    def __init__(self, base: LayerRule, scale: float) -> None:
        self.base = base
        self.scale = float(scale)
        self.param_names = base.param_names
        self.needs_kwargs = base.needs_kwargs
        self.layout = base.layout

    def __repr__(self) -> str:
        return f"ScaledRule({type(self.base).__name__}, scale={self.scale:.6g})"

    def check(self, module: nn.Module, name: str) -> None:
        self.base.check(module, name)

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        return self.base.parameters(module)

    def capture(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Captured:
        return self.base.capture(module, args, kwargs, output)

    def per_example_grads(
        self, module: nn.Module, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        return self.base.per_example_grads(module, captured, grad_output * self.scale, trainable)
