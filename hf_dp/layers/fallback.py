"""Generic rule for any module that directly owns trainable parameters and has no closed-form rule.

Per-example gradients come from ``torch.func``: ``vmap`` over the batch of ``grad`` of ``<f(params, x_i), g_i>``,
with ``f`` the module's own forward (``functional_call``) on a batch of one (compare Opacus ``functorch.py``).
This instantiates ``[B, *param.shape]`` and re-runs the module's forward once, so it is exact but slower than a
closed-form rule; the engine says once per module type when it uses it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..engine.per_example import InstantiatedGrad, PerExampleGrad
from .base import Captured, LayerRule, UnsupportedModuleError


class FallbackRule(LayerRule):
    needs_kwargs = True

    def parameters(self, module: nn.Module) -> list[nn.Parameter]:
        return [p for p in module.parameters(recurse=False)]

    def capture(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Captured:
        return Captured(args=args, kwargs=dict(kwargs))

    def per_example_grads(
        self, module: nn.Module, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        own = {name: p for name, p in module.named_parameters(recurse=False) if p in trainable}
        if not own:
            return {}
        batch_size = grad_output.shape[0]
        leaves, spec = tree_flatten((captured.args, captured.kwargs))
        is_batched = [isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == batch_size for x in leaves]
        batched_leaves = [x for x, b in zip(leaves, is_batched, strict=True) if b]
        if not batched_leaves:
            raise UnsupportedModuleError(
                f"{type(module).__name__}: no input has the batch dimension {batch_size}, so its per-example "
                "gradient is undefined. Pass inputs with a leading batch dimension."
            )
        params = {name: p.detach() for name, p in own.items()}

        def example_loss(params: dict[str, Tensor], example_leaves: list[Tensor], g: Tensor) -> Tensor:
            it = iter(example_leaves)
            rebuilt = [next(it).unsqueeze(0) if b else x for x, b in zip(leaves, is_batched, strict=True)]
            args, kwargs = tree_unflatten(rebuilt, spec)
            out = torch.func.functional_call(module, params, args, kwargs)
            if not isinstance(out, Tensor):
                raise UnsupportedModuleError(
                    f"{type(module).__name__} returns {type(out).__name__}; the torch.func fallback needs a module "
                    "that returns one tensor. Register a rule for it with `hf_dp.layers.register_rule`."
                )
            return (out * g.unsqueeze(0).to(out.dtype)).sum()

        per_example = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0, 0))(
            params, batched_leaves, grad_output
        )
        return {own[name]: InstantiatedGrad(value) for name, value in per_example.items()}


FALLBACK_RULE = FallbackRule()
