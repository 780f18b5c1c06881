"""``nn.Embedding``: ``y_t = E[id_t]``.

Per example, ``dL_i/dE = sum_t e_{id_t} g_t^T``: a one-hot row factor. In the ghost norm the Gram matrix of the
one-hot factors is ``[id_t == id_s]``, so repeated ids are merged exactly:
``||dL_i/dE||^2 = sum_{t,s: id_t = id_s} g_t . g_s``.
Positions holding ``padding_idx`` get no gradient (as in ``torch.nn.functional.embedding``): they are dropped from
both the norm and the update.

Worked example: ids ``[5, 5]`` with output gradients ``g_1, g_2`` give row 5 the gradient ``g_1 + g_2`` and the norm
``||g_1 + g_2||``, not ``sqrt(||g_1||^2 + ||g_2||^2)``.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import Captured, LayerRule, UnsupportedModuleError, flatten_sequence
from .grads import FactoredGrad, IndexFactor, PerExampleGrad
from .registry import register_rule


def one_hot_ids(ids: Tensor, num_rows: int, padding_idx: int | None) -> IndexFactor:
    """Flatten ``ids`` to ``[B, T]`` and mark ``padding_idx`` positions as contributing nothing."""
    flat = ids.reshape(ids.shape[0], -1)
    if padding_idx is not None:
        pad = padding_idx if padding_idx >= 0 else num_rows + padding_idx
        flat = flat.masked_fill(flat == pad, -1)
    return IndexFactor(flat, num_rows)


@register_rule(nn.Embedding)
class EmbeddingRule(LayerRule):
    param_names = ("weight",)

    def check(self, module: nn.Embedding, name: str) -> None:
        if module.max_norm is not None:
            raise UnsupportedModuleError(
                f"Embedding `{name}` has max_norm={module.max_norm}: it renormalises rows in place inside the "
                "forward pass, so the per-example gradient is not the book-kept one. Set `max_norm=None`."
            )
        if module.scale_grad_by_freq:
            raise UnsupportedModuleError(
                f"Embedding `{name}` has scale_grad_by_freq=True: the gradient scale depends on the whole batch, "
                "which couples examples and breaks the privacy bound. Set `scale_grad_by_freq=False`."
            )
        if module.sparse:
            raise UnsupportedModuleError(f"Embedding `{name}` has sparse=True; hf_dp needs dense gradients.")

    def per_example_grads(
        self, module: nn.Embedding, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        if module.weight not in trainable:
            return {}
        ids = one_hot_ids(captured.args[0], module.num_embeddings, module.padding_idx)
        g = flatten_sequence(grad_output)
        return {module.weight: FactoredGrad(left=ids, right=g, shape=module.weight.shape)}
