"""``nn.Conv1d`` / ``nn.Conv2d``: im2col (``unfold``) turns a convolution into a linear layer over patches.

With patches ``P_i`` of shape ``[L, C_in/groups * prod(k)]`` and output gradients ``g_i`` of shape ``[L, C_out]``,
``dL_i/dW = g_i^T P_i`` (Lee & Kifer 2021; Opacus ``conv.py``) and ``dL_i/db = sum_l g_{i,l}``.
Grouped convolutions and non-zero padding modes are left to the torch.func fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import Captured, LayerRule, NeedsFallback
from .grads import FactoredGrad, InstantiatedGrad, PerExampleGrad
from .registry import register_rule


def _patches(module: nn.Conv1d | nn.Conv2d, x: Tensor) -> Tensor:
    """``[B, L, C_in * prod(kernel)]`` patches, in the weight's flattening order."""
    if isinstance(module, nn.Conv1d):
        x = x.unsqueeze(2)
        kernel, dilation = (1, module.kernel_size[0]), (1, module.dilation[0])
        stride = (1, module.stride[0])
        padding = (0, module.padding[0]) if not isinstance(module.padding, str) else module.padding
    else:
        kernel, dilation, stride, padding = module.kernel_size, module.dilation, module.stride, module.padding
    if isinstance(padding, str):  # "same": pad as torch does (left = total // 2), then no padding in unfold
        if padding == "valid":
            padding = (0, 0)
        else:
            pads = []
            for d, k in zip(reversed(dilation), reversed(kernel), strict=True):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            x = torch.nn.functional.pad(x, pads)
            padding = (0, 0)
    cols = torch.nn.functional.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    return cols.transpose(1, 2)


@register_rule(nn.Conv1d, nn.Conv2d)
class ConvRule(LayerRule):
    layout = "leading"

    def check(self, module: nn.Module, name: str) -> None:
        if module.groups != 1 or module.padding_mode != "zeros":
            raise NeedsFallback(
                f"Conv `{name}` has groups={module.groups}, padding_mode={module.padding_mode!r}; the im2col rule "
                "supports groups=1 with zero padding (the torch.func fallback handles the rest)."
            )

    def per_example_grads(
        self, module: nn.Module, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        g = grad_output.reshape(grad_output.shape[0], grad_output.shape[1], -1).transpose(1, 2)  # [B, L, C_out]
        grads: dict[nn.Parameter, PerExampleGrad] = {}
        if module.weight in trainable:
            patches = _patches(module, captured.args[0])
            grads[module.weight] = FactoredGrad(left=g, right=patches, shape=module.weight.shape)
        if module.bias is not None and module.bias in trainable:
            grads[module.bias] = InstantiatedGrad(g.sum(1))
        return grads
