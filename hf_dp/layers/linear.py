"""``nn.Linear``: ``y_t = W a_t + b``.

Per example, ``dL_i/dW = sum_t g_t a_t^T`` (rows: output gradients ``g``, columns: inputs ``a``) and
``dL_i/db = sum_t g_t`` — the norm of the sum over positions, never the sum of per-position norms.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import Captured, LayerRule, flatten_sequence
from .grads import FactoredGrad, InstantiatedGrad, PerExampleGrad
from .registry import register_rule


@register_rule(nn.Linear)
class LinearRule(LayerRule):
    def per_example_grads(
        self, module: nn.Linear, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        g = flatten_sequence(grad_output)
        grads: dict[nn.Parameter, PerExampleGrad] = {}
        if module.weight in trainable:
            a = flatten_sequence(captured.args[0])
            grads[module.weight] = FactoredGrad(left=g, right=a, shape=module.weight.shape)
        if module.bias is not None and module.bias in trainable:
            grads[module.bias] = InstantiatedGrad(g.sum(1))
        return grads
