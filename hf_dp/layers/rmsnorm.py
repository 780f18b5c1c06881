"""RMSNorm family: ``torch.nn.RMSNorm``, transformers ``*RMSNorm`` classes (Llama, Mistral, Qwen, Gemma, ...) and
``T5LayerNorm``: ``y_t = xhat_t * h(w)`` with ``xhat_t = x_t / sqrt(mean(x_t^2) + eps)`` and ``h(w) = w`` or
``1 + w`` (Gemma). Either way ``dh/dw = 1``, so per example ``dL_i/dw = sum_t g_t * xhat_t``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import Captured, LayerRule, sum_positions
from .grads import InstantiatedGrad, PerExampleGrad, compute_dtype
from .registry import register_predicate_rule


def _epsilon(module: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, float | int):
            return float(value)
    return None


def is_rms_norm(module: nn.Module) -> bool:
    """``torch.nn.RMSNorm``, or a class named ``*RMSNorm``/``T5LayerNorm`` with one ``weight`` and an epsilon."""
    if isinstance(module, nn.RMSNorm):
        return True
    name = type(module).__name__
    if not (name.endswith("RMSNorm") or name == "T5LayerNorm"):
        return False
    own = dict(module.named_parameters(recurse=False))
    return set(own) == {"weight"} and own["weight"].dim() == 1 and _epsilon(module) is not None


@register_predicate_rule("rms_norm", is_rms_norm)
class RMSNormRule(LayerRule):
    param_names = ("weight",)

    def per_example_grads(
        self, module: nn.Module, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        weight = module.weight
        if weight is None or weight not in trainable:
            return {}
        x = captured.args[0]
        dtype = compute_dtype(x.dtype)
        eps = _epsilon(module)
        if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
            eps = torch.finfo(x.dtype).eps
        n = weight.dim()
        dims = tuple(range(x.dim() - n, x.dim()))
        xf = x.to(dtype)
        xhat = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
        return {weight: InstantiatedGrad(sum_positions(grad_output.to(dtype) * xhat, n))}
