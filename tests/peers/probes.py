"""Building blocks for single-layer configurations: a wrapper model, seeded inputs, and the per-example loss."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from harness import Case, project
from torch import Tensor, nn


class Probe(nn.Module):
    """Wraps a layer as a model: ``pre`` (optional) then the layer; a tuple output gives its first element."""

    def __init__(self, layer: nn.Module, pre: nn.Module | None = None) -> None:
        super().__init__()
        self.pre = pre
        self.layer = layer

    def forward(self, x, **kwargs) -> Tensor:
        if self.pre is not None:
            x = self.pre(x)
        out = self.layer(x, **kwargs)
        if isinstance(out, tuple):
            out = out[0]
        if isinstance(out, nn.utils.rnn.PackedSequence):
            out = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
        return out


def floats(*shapes: Sequence[int], seed: int = 0) -> Callable[[], list[dict]]:
    """Micro-batches ``{"x": randn(shape)}``, one per shape, from a fixed generator."""

    def make() -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        return [{"x": torch.randn(tuple(s), generator=g, dtype=torch.float64)} for s in shapes]

    return make


def ids(vocab: int, *shapes: Sequence[int], seed: int = 0) -> Callable[[], list[dict]]:
    """Micro-batches ``{"x": randint(vocab, shape)}`` with repeated ids (a small vocabulary)."""

    def make() -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        return [{"x": torch.randint(0, vocab, tuple(s), generator=g)} for s in shapes]

    return make


def probe_loss(batch_dim: int = 0):
    """``(model, batch) -> [B]``: the fixed random projection of ``model(batch["x"], **batch.get("kw", {}))``."""

    def loss_fn(model: nn.Module, batch: dict) -> Tensor:
        return project(model(batch["x"], **batch.get("kw", {})), batch_dim)

    return loss_fn


def layer_case(
    make_layer: Callable[[], nn.Module],
    batches: Callable[[], list[dict]],
    *,
    batch_dim: int = 0,
    pre: Callable[[], nn.Module] | None = None,
    refusable: str | None = None,
) -> Case:
    """A configuration that wraps one layer in :class:`Probe` (``batch_dim=1``: examples along dim 1)."""
    if batch_dim != 0 and refusable is None:
        refusable = "batch-second layout"
    return Case(
        build=lambda: Probe(make_layer(), pre() if pre is not None else None),
        batches=batches,
        loss_fn=probe_loss(batch_dim),
        refusable=refusable,
    )
