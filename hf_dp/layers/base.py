"""The interface every layer rule implements."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .grads import PerExampleGrad, compute_dtype, norm_sq, weighted_sum

__all__ = [
    "LAYOUT_KINDS",
    "autocast_like",
    "autocast_state",
    "Captured",
    "Layout",
    "LayerRule",
    "NeedsFallback",
    "UnsupportedModuleError",
    "flatten_sequence",
    "own_named_parameters",
    "sum_positions",
]

#: How a rule's tensors carry the examples (``LayerRule.layout``).
LAYOUT_KINDS: dict[str, str] = {
    "positionwise": "the op acts on the last dimension(s) only: the examples may lie along any other dimension of "
    "the input and output (the same one for both), possibly several rows per example",
    "leading": "the examples lie along dimension 0 of the input and output (convolutions), possibly several rows each",
    "output": "the rule maps its inputs to output rows itself (EmbeddingBag bags): only the output's rows are proven",
    "any": "the torch.func fallback: every input and output tensor has its own proven layout",
}


class UnsupportedModuleError(ValueError):
    """A module whose trainable parameters hf_dp cannot clip per example."""


def named_refusal(err: UnsupportedModuleError, name: str, module: nn.Module) -> UnsupportedModuleError:
    """``err`` naming the module's path in the model (``name``) and its class, for a refusal raised where only the
    module was known (a rule's ``per_example_grads``, the fallback's re-run); ``err`` itself if it names the path."""
    message = str(err)
    if f"`{name}`" in message:
        return err
    return type(err)(f"`{name}` ({type(module).__name__}): {message}")


class NeedsFallback(UnsupportedModuleError):
    """Raised by a rule's ``check`` for a configuration its closed form does not cover but torch.func does."""


@dataclass(frozen=True)
class Layout:
    """Where the examples lie in one tensor of a call: along dimension ``dim``, whose size is ``k * B`` for ``B``
    examples, example ``i`` owning the contiguous rows ``i*k .. i*k+k-1`` (``k = 1``: a plain batch dimension; OPT's
    ``[B*T, d]``: ``k = T``). ``broadcast``: the tensor has size 1 along ``dim`` (= 0) and is the same for every
    example (HF position ids ``[1, T]``); the engine expands it to ``repeat`` rows per example (more than one when
    the model runs on several rows per example, e.g. multiple choice: ``[B * choices, T]``).
    """

    dim: int
    broadcast: bool = False
    repeat: int = 1

    def rows(self, t: Tensor, batch_size: int) -> int:
        """``k`` for ``t`` (raises ``ValueError`` if ``t`` does not fit this layout for ``batch_size`` examples)."""
        if self.broadcast:
            if t.dim() <= self.dim or t.shape[self.dim] != 1:
                raise ValueError(f"shape {tuple(t.shape)} is not a size-1 broadcast along dimension {self.dim}")
            return 1
        if t.dim() <= self.dim or batch_size <= 0 or t.shape[self.dim] % batch_size:
            raise ValueError(
                f"shape {tuple(t.shape)} has no dimension {self.dim} that is a multiple of the batch ({batch_size})"
            )
        return t.shape[self.dim] // batch_size


@dataclass
class Captured:
    """What the forward hook kept of one call of a module (book-keeping: references, never copies).

    ``layouts`` and ``batch_size`` are filled in by the engine for rules whose ``layout`` is ``"any"`` (the
    fallback): the proven layout of every input and output tensor, and the number of examples; ``autocast`` is the
    autocast state the call ran under (see :func:`autocast_state`), for rules that re-run the module; ``random`` the
    random draws of the call (:mod:`.replay`); ``expanded`` which outputs were ``[1, ...]`` and expanded to the
    examples' rows (a re-run returns them unexpanded).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    output: Any = None
    layouts: Any = None
    batch_size: int | None = None
    autocast: tuple = ()
    random: list = field(default_factory=list)
    expanded: tuple = ()


class LayerRule:
    """Per-example gradients of the parameters a module owns, from its inputs and its output gradient.

    Rules are pure: they return tensors keyed by parameter and set no attributes. The engine decides between the
    ghost norm and instantiation, handles parameters shared between modules, and clips after the backward pass.
    """

    #: Names of the module's own parameters this rule covers.
    param_names: tuple[str, ...] = ("weight", "bias")
    #: Whether the rule needs the call's keyword arguments and output (the fallback does; the others do not).
    needs_kwargs: bool = False
    #: Where the examples may lie in the tensors the rule reads (a key of :data:`LAYOUT_KINDS`). The engine proves
    #: the layout of every call (which dimension carries the examples, how many rows each) and hands the rule
    #: tensors whose dimension 0 holds whole rows of examples, rows of one example contiguous; it then folds the
    #: rule's row gradients into per-example ones (:func:`hf_dp.layers.grads.fold`).
    layout: str = "positionwise"
    #: Unused since the engine proves and expands broadcast (size-1) batch dimensions itself; kept for rules that
    #: set it.
    expands_batch_one: bool = False
    #: Whether the rule reads the random draws of each call (``captured.random``, recorded in the forward pass as for
    #: the fallback, :mod:`.replay`): a module whose draws decide what it computed (peft's LyCORIS module dropout).
    records_random: bool = False

    def check(self, module: nn.Module, name: str) -> None:
        """Raise :class:`UnsupportedModuleError` if this configuration of the module is not supported."""

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        """The parameters this rule covers for ``module`` (trainable or not)."""
        return [p for n, p in own_named_parameters(module) if n in self.param_names]

    def capture(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Captured:
        """Keep what :meth:`per_example_grads` needs (by default the first positional input).

        For ``"positionwise"`` and ``"leading"`` rules the engine rearranges ``args[0]`` of the returned object to
        the rows of the proven layout before calling :meth:`per_example_grads`.
        """
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


def own_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``list(module.named_parameters(recurse=False))``, read straight from ``module._parameters`` unless the class
    overrides ``named_parameters`` (the same pairs, in the same order: ``None`` entries and repeats left out)."""
    kind = type(module)
    if kind.named_parameters is not nn.Module.named_parameters or kind._named_members is not nn.Module._named_members:
        return list(module.named_parameters(recurse=False))
    seen: set[int] = set()
    out = []
    for name, p in module._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def flatten_sequence(x: Tensor) -> Tensor:
    """``[B, ..., n] -> [B, T, n]`` with ``T`` the product of the middle dimensions (1 for ``[B, n]``)."""
    return x if x.dim() == 3 else x.reshape(x.shape[0], -1, x.shape[-1])


def sum_positions(x: Tensor, feature_dims: int) -> Tensor:
    """Sum over every dimension between the batch and the last ``feature_dims`` (none for ``[B, *features]``)."""
    dims = tuple(range(1, x.dim() - feature_dims))
    return x.sum(dims) if dims else x


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """``(device type, dtype)`` of every device type with autocast on (accelerate enters it inside ``forward``)."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_like(state: tuple[tuple[str, torch.dtype], ...]):
    """Re-enter the autocast state a call ran under (a re-run of a module computes in the same precision)."""
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield
