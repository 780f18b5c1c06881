"""The model's modules and parameters, listed once for work that reads them several times in a row.

Constructing the clipper and proving a plan each read the model's module tree several times over (the refused hooks,
the names for messages, static coverage, the module state kept, the parameters' devices); each ``named_modules()``
walk is a recursive Python generator over the whole tree. A :class:`ModelListing` is that walk
done once, read by each of them, and made again wherever the tree may have changed in between (nothing in one listing
outlives the step that made it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelListing"]


@dataclass(frozen=True)
class ModelListing:
    """``model.named_modules()`` and ``model.named_parameters()`` at the moment of :meth:`of` (the model's own
    methods, so a class that lists its members otherwise is read as it says)."""

    named_modules: tuple[tuple[str, nn.Module], ...]
    named_parameters: tuple[tuple[str, nn.Parameter], ...]

    @classmethod
    def of(cls, model: nn.Module) -> ModelListing:
        return cls(tuple(model.named_modules()), tuple(model.named_parameters()))

    @functools.cached_property
    def modules(self) -> list[nn.Module]:
        """As ``model.modules()``."""
        return [m for _, m in self.named_modules]

    @functools.cached_property
    def parameters(self) -> list[nn.Parameter]:
        """As ``model.parameters()``."""
        return [p for _, p in self.named_parameters]

    def devices(self) -> list[torch.device]:
        """The devices of the parameters, sorted by name."""
        return sorted({p.device for p in self.parameters}, key=str)
