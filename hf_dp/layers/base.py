"""The interface every layer rule implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from ..engine.per_example import PerExampleGrad, compute_dtype, norm_sq, weighted_sum

__all__ = ["Captured", "LayerRule", "NeedsFallback", "UnsupportedModuleError", "flatten_sequence"]


class UnsupportedModuleError(ValueError):
    """A module whose trainable parameters hf_dp cannot clip per example."""


class NeedsFallback(UnsupportedModuleError):
    """Raised by a rule's ``check`` for a configuration its closed form does not cover but torch.func does."""


@dataclass
class Captured:
    """What the forward hook kept of one call of a module (book-keeping: references, never copies)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    output: Tensor | None = None


class LayerRule:
    """Per-example gradients of the parameters a module owns, from its inputs and its output gradient.

    Rules are pure: they return tensors keyed by parameter and set no attributes. The engine decides between the
    ghost norm and instantiation, handles parameters shared between modules, and clips after the backward pass.
    """

    #: Names of the module's own parameters this rule covers.
    param_names: tuple[str, ...] = ("weight", "bias")
    #: Whether the rule needs the call's keyword arguments and output (the fallback does; the others do not).
    needs_kwargs: bool = False
    #: Whether the module is a pure lookup of integer ids, so that a ``[1, T]`` input (HF position ids) can be
    #: expanded to the batch without changing the result.
    expands_batch_one: bool = False

    def check(self, module: nn.Module, name: str) -> None:
        """Raise :class:`UnsupportedModuleError` if this configuration of the module is not supported."""

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The parameters this rule covers for ``module`` (trainable or not)."""
        return [p for n, p in module.named_parameters(recurse=False) if n in self.param_names and p is not None]

    def capture(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Captured:
        """Keep what :meth:`per_example_grads` needs (by default the first positional input)."""
        return Captured(args=args[:1])

    def per_example_grads(
        self, module: nn.Module, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        """Per-example gradients of the ``trainable`` parameters of one call of ``module``."""
        raise NotImplementedError

    # Convenience forms of the two quantities the engine needs, for a module used once.
    def norm_sq(self, module: nn.Module, captured: Captured, grad_output: Tensor) -> dict[nn.Parameter, Tensor]:
        """``[B]`` squared per-example gradient norms of each trainable parameter."""
        grads = self.per_example_grads(module, captured, grad_output, set(self.parameters(module)))
        return {p: norm_sq(g, compute_dtype(p.dtype)) for p, g in grads.items()}

    def clipped_sum(
        self, module: nn.Module, captured: Captured, grad_output: Tensor, coef: Tensor
    ) -> dict[nn.Parameter, Tensor]:
        """``sum_i coef_i G_i`` for each trainable parameter."""
        grads = self.per_example_grads(module, captured, grad_output, set(self.parameters(module)))
        return {p: weighted_sum(g, coef, p.dtype) for p, g in grads.items()}


def flatten_sequence(x: Tensor) -> Tensor:
    """``[B, ..., n] -> [B, T, n]`` with ``T`` the product of the middle dimensions (1 for ``[B, n]``)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def sum_positions(x: Tensor, feature_dims: int) -> Tensor:
    """Sum over every dimension between the batch and the last ``feature_dims`` (none for ``[B, *features]``)."""
    dims = tuple(range(1, x.dim() - feature_dims))
    return x.sum(dims) if dims else x
