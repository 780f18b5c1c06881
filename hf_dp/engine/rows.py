"""From a proven layout to the rows a rule reads, and back to per-example gradients.

A closed-form rule sees its input and output gradient with the example rows along dimension 0 (moved there from
wherever the layout says they are; a broadcast ``[1, ...]`` tensor expanded to the batch); its per-row gradients are
then folded into per-example ones (:func:`hf_dp.layers.grads.fold`). The same layout tells which rows of an output
gradient belong to example ``j``, which is how the engine checks that loss ``j`` depends on example ``j`` alone.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from ..layers import Captured, LayerRule, Layout
from ..layers.grads import PerExampleGrad, fold

__all__ = ["closed_form_grads", "foreign_rows", "grad_layout", "to_rows"]

#: Entries of an output gradient checked at a time by :func:`foreign_rows` (its two boolean masks are this long).
FLAG_CHUNK = 1 << 22


def to_rows(t: Tensor, layout: Layout, batch_size: int) -> Tensor:
    """``t`` with the rows of the examples along dimension 0 (``k * batch_size`` of them, example-contiguous)."""
    if layout.broadcast:
        return t.expand(batch_size * layout.repeat, *t.shape[1:])
    return t if layout.dim == 0 else t.movedim(layout.dim, 0)


def grad_layout(layout: Layout) -> Layout:
    """The layout of the gradient of an output with ``layout`` (a broadcast output is expanded before use)."""
    return Layout(0) if layout.broadcast else layout


def closed_form_grads(
    rule: LayerRule,
    module: nn.Module,
    captured: Captured,
    grad_output: Tensor,
    layout: Layout,
    batch_size: int,
    trainable: set[nn.Parameter],
) -> dict[nn.Parameter, PerExampleGrad]:
    """Per-example gradients of one call of a module with a closed-form rule, whose output has ``layout``."""
    if rule.layout in ("positionwise", "leading") and captured.args:
        captured = replace(captured, args=(to_rows(captured.args[0], layout, batch_size), *captured.args[1:]))
    g = to_rows(grad_output, grad_layout(layout), batch_size)
    grads = rule.per_example_grads(module, captured, g, trainable)
    return {p: fold(value, batch_size) for p, value in grads.items()}


def foreign_rows(grad: Tensor, layout: Layout, batch_size: int, example: int) -> Tensor | None:
    """How many entries of ``grad`` (the gradient of loss ``example`` alone) are non-zero in rows of other examples
    (a 0-dim integer tensor on ``grad``'s device: the caller reads it; ``None`` for a batch of one, which has no other
    rows).

    Non-finite entries are ignored: ``0 * inf`` is NaN in a backward pass through an example whose activations
    overflowed, which says nothing about coupling (and such an example gets weight 0 anyway).
    """
    g = to_rows(grad, grad_layout(layout), batch_size)
    k = g.shape[0] // batch_size
    # the rows before and after the example's, read where they lie and a few rows at a time (no copy of the gradient,
    # no isfinite pass, small temporaries: on the first batch this runs while the whole graph is kept, and the
    # lm_head's [B, T, V] gradient is the largest tensor there); a non-finite entry does not count as a use
    step = max(1, (FLAG_CHUNK * g.shape[0]) // max(g.numel(), 1))
    counts = [
        part.nan_to_num(0.0, 0.0, 0.0).count_nonzero()
        for lo, hi in ((0, example * k), ((example + 1) * k, g.shape[0]))
        for part in (g[i : min(i + step, hi)] for i in range(lo, hi, step))
    ]
    if len(counts) > 1:
        return torch.stack(counts).sum()
    return counts[0] if counts else None
