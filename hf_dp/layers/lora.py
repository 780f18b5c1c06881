"""PEFT LoRA.

``lora.Linear`` keeps its adapters as ``nn.Linear`` modules (``lora_A``, ``lora_B``), which :mod:`.linear` covers;
the input ``lora_A`` sees is the dropped-out input, which is what its hook captures.

``lora.Embedding`` keeps raw parameters ``A`` (``r x V``) and ``B`` (``d x r``) and computes
``y_t = base(id_t) + s * B A[:, id_t]`` (``s`` = scaling, times the base layer's ``embed_scale`` if any).
With ``u_t = A[:, id_t]`` and output gradient ``g_t``:
``dL_i/dB = sum_t (s g_t) u_t^T`` and ``dL_i/dA = sum_t (s B^T g_t) e_{id_t}^T`` (a one-hot column factor).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import Captured, LayerRule, UnsupportedModuleError, flatten_sequence
from .embedding import one_hot_ids
from .grads import FactoredGrad, PerExampleGrad
from .registry import register_rule

try:
    from peft.tuners.lora.layer import Embedding as LoraEmbedding
except ImportError:  # peft is a dependency, but keep the registry importable without it
    LoraEmbedding = None


def _active_adapters(module: nn.Module) -> list[str]:
    return [name for name in module.active_adapters if name in module.lora_embedding_A]


if LoraEmbedding is not None:

    @register_rule(LoraEmbedding)
    class LoraEmbeddingRule(LayerRule):
        def parameters(self, module: nn.Module) -> list[nn.Parameter]:
            return [p for d in (module.lora_embedding_A, module.lora_embedding_B) for p in d.values()]

        def check(self, module: nn.Module, name: str) -> None:
            if any(adapter in module.lora_variant for adapter in _active_adapters(module)):
                raise UnsupportedModuleError(
                    f"LoRA embedding `{name}` uses a LoRA variant (e.g. DoRA); hf_dp supports vanilla LoRA "
                    "embeddings only. Set `use_dora=False` or leave the embedding out of `target_modules`."
                )

        def per_example_grads(
            self, module: nn.Module, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
        ) -> dict[nn.Parameter, PerExampleGrad]:
            if module.disable_adapters or module.merged:
                return {}
            base = module.get_base_layer()
            ids = captured.args[0]
            g = flatten_sequence(grad_output)
            embed_scale = module._get_embed_scale()
            grads: dict[nn.Parameter, PerExampleGrad] = {}
            for adapter in _active_adapters(module):
                a_param = module.lora_embedding_A[adapter]  # r x V
                b_param = module.lora_embedding_B[adapter]  # d x r
                scale = module.scaling[adapter]
                if embed_scale is not None:
                    scale = scale * embed_scale.to(g.dtype)
                scaled_g = g * scale
                if b_param in trainable:
                    after_a = flatten_sequence(
                        torch.nn.functional.embedding(ids, a_param.T, padding_idx=base.padding_idx)
                    )
                    grads[b_param] = FactoredGrad(left=scaled_g, right=after_a, shape=b_param.shape)
                if a_param in trainable:
                    ids_factor = one_hot_ids(ids, a_param.shape[1], base.padding_idx)
                    grads[a_param] = FactoredGrad(
                        left=scaled_g @ b_param.to(g.dtype), right=ids_factor, shape=a_param.shape
                    )
            return grads
