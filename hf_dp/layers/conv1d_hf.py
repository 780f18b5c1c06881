"""transformers ``Conv1D`` (GPT-2): a linear layer whose weight is stored as ``(in, out)``: ``y_t = a_t W + b``.

Per example, ``dL_i/dW = sum_t a_t g_t^T`` — the transpose of :mod:`.linear`'s factors.
"""

from __future__ import annotations

from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from .base import Captured, LayerRule, flatten_sequence
from .grads import FactoredGrad, InstantiatedGrad, PerExampleGrad
from .registry import register_rule


@register_rule(Conv1D)
class HFConv1DRule(LayerRule):
    def per_example_grads(
        self, module: Conv1D, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        g = flatten_sequence(grad_output)
        grads: dict[nn.Parameter, PerExampleGrad] = {}
        if module.weight in trainable:
            a = flatten_sequence(captured.args[0])
            grads[module.weight] = FactoredGrad(left=a, right=g, shape=module.weight.shape)
        if module.bias is not None and module.bias in trainable:
            grads[module.bias] = InstantiatedGrad(g.sum(1))
        return grads
