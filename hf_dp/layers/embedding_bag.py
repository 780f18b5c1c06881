"""``nn.EmbeddingBag``: bag ``b`` reduces the rows of its ids, ``y_b = sum_j w_j E[id_j]`` over the bag's ids ``j``.

``w_j`` is the per-sample weight (``mode="sum"``), ``1 / n_b`` with ``n_b`` the bag's non-padding ids
(``mode="mean"``), or 1. Per bag, ``dL_b/dE = sum_j e_{id_j} (w_j g_b)^T``: a one-hot row factor over the bag's ids,
as for :mod:`.embedding`, with the output gradient repeated and weighted per id. ``mode="max"`` takes, for each
column ``c``, the row ``r_c`` that attains the maximum: ``dL_b/dE = sum_c e_{r_c} (g_{b,c} e_c)^T``.

Bags come from a 2-D input (one row per bag) or a 1-D input with ``offsets`` (bag ``b`` is
``input[offsets[b]:offsets[b+1]]``); ``padding_idx`` ids are excluded from the bags, as in torch. The rule works on
bags; the engine proves which output rows (bags) belong to which example.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from .base import Captured, LayerRule, UnsupportedModuleError
from .grads import FactoredGrad, IndexFactor, PerExampleGrad
from .registry import register_rule

_SIGNATURE = inspect.signature(nn.EmbeddingBag.forward)


def padded_bags(
    module: nn.EmbeddingBag, ids: Tensor, offsets: Tensor | None, weights: Tensor | None, num_bags: int
) -> tuple[Tensor, Tensor | None]:
    """``[num_bags, L]`` ids of each bag (``-1``: no id, or ``padding_idx``) and the matching per-sample weights."""
    if ids.dim() == 2:
        bag_ids, bag_weights = ids.clone(), weights
    else:
        starts = offsets[:-1] if module.include_last_offset else offsets
        end = int(offsets[-1]) if module.include_last_offset else ids.shape[0]
        positions = torch.arange(end, device=ids.device)
        bag = torch.bucketize(positions, starts, right=True) - 1
        lengths = torch.diff(starts, append=starts.new_tensor([end]))
        width = max(int(lengths.max()) if lengths.numel() else 0, 1)
        within = positions - starts[bag]
        bag_ids = ids.new_full((num_bags, width), -1)
        bag_ids[bag, within] = ids[:end]
        bag_weights = None
        if weights is not None:
            bag_weights = weights.new_zeros((num_bags, width))
            bag_weights[bag, within] = weights[:end]
    if module.padding_idx is not None:
        bag_ids = bag_ids.masked_fill(bag_ids == module.padding_idx, -1)
    return bag_ids, bag_weights


@register_rule(nn.EmbeddingBag)
class EmbeddingBagRule(LayerRule):
    param_names = ("weight",)
    layout = "output"

    def check(self, module: nn.EmbeddingBag, name: str) -> None:
        if module.max_norm is not None:
            raise UnsupportedModuleError(
                f"EmbeddingBag `{name}` has max_norm={module.max_norm}: it renormalises rows in place inside the "
                "forward pass, so the per-example gradient is not the book-kept one. Set `max_norm=None`."
            )
        if module.scale_grad_by_freq:
            raise UnsupportedModuleError(
                f"EmbeddingBag `{name}` has scale_grad_by_freq=True: the gradient scale depends on the whole batch, "
                "which couples examples. Set `scale_grad_by_freq=False`."
            )
        if module.sparse:
            raise UnsupportedModuleError(f"EmbeddingBag `{name}` has sparse=True; hf_dp needs dense gradients.")

    def capture(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Captured:
        bound = _SIGNATURE.bind(module, *args, **kwargs)
        bound.apply_defaults()
        return Captured(
            args=(bound.arguments["input"], bound.arguments["offsets"], bound.arguments["per_sample_weights"])
        )

    def per_example_grads(
        self, module: nn.EmbeddingBag, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        if module.weight not in trainable:
            return {}
        ids, offsets, weights = captured.args
        g = grad_output  # [bags, d]
        bag_ids, bag_weights = padded_bags(module, ids, offsets, weights, g.shape[0])
        valid = bag_ids >= 0
        if module.mode == "max":
            values = module.weight.detach()[bag_ids.clamp_min(0)].to(g.dtype)  # [bags, L, d]
            values = values.masked_fill(~valid.unsqueeze(-1), float("-inf"))
            best = values.argmax(1)  # [bags, d]: the position of the maximum, per column
            rows = bag_ids.gather(1, best)
            rows = rows.masked_fill(~valid.any(1, keepdim=True), -1)  # an empty bag has no gradient
            left = IndexFactor(rows, module.num_embeddings)
            return {module.weight: FactoredGrad(left=left, right=torch.diag_embed(g), shape=module.weight.shape)}
        scale = valid.to(g.dtype)
        if module.mode == "mean":
            scale = scale / scale.sum(1, keepdim=True).clamp_min(1)
        elif bag_weights is not None:
            scale = scale * bag_weights.to(g.dtype)
        right = g.unsqueeze(1) * scale.unsqueeze(-1)  # [bags, L, d]
        left = IndexFactor(bag_ids, module.num_embeddings)
        return {module.weight: FactoredGrad(left=left, right=right, shape=module.weight.shape)}
