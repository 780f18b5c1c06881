"""``nn.LayerNorm``: ``y_t = xhat_t * w + b`` with ``xhat_t = (x_t - mean) / sqrt(var + eps)``.

Per example, ``dL_i/dw = sum_t g_t * xhat_t`` and ``dL_i/db = sum_t g_t`` (elementwise; cheap to instantiate).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import Captured, LayerRule, sum_positions
from .grads import InstantiatedGrad, PerExampleGrad, compute_dtype
from .registry import register_rule


@register_rule(nn.LayerNorm)
class LayerNormRule(LayerRule):
    def per_example_grads(
        self, module: nn.LayerNorm, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        x = captured.args[0]
        n = len(module.normalized_shape)
        grads: dict[nn.Parameter, PerExampleGrad] = {}
        if module.weight is not None and module.weight in trainable:
            dtype = compute_dtype(x.dtype)
            xhat = torch.nn.functional.layer_norm(x.to(dtype), module.normalized_shape, eps=module.eps)
            grads[module.weight] = InstantiatedGrad(sum_positions(grad_output.to(dtype) * xhat, n))
        if module.bias is not None and module.bias in trainable:
            grads[module.bias] = InstantiatedGrad(sum_positions(grad_output, n))
        return grads
