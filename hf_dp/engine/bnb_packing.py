"""bitsandbytes' 4-bit layers on CPU: their inference repacking, kept off while the clipper is attached.

On a CPU with AVX512-BF16, ``bitsandbytes.nn.Linear4bit`` (0.50) repacks its 4-bit weight in place, for a faster
inference kernel, the first time it runs in eval mode on an input that does not require gradients: the way hf_dp runs
the model to prove where the examples lie (eval mode, no gradients), and the way the Trainer evaluates. Its backward
then dequantizes the repacked weight as if it were not repacked: every gradient that flows through the layer is wrong
(a tiny QLoRA Llama: LoRA gradients 42% off, while the loss moves by 2e-3), for plain autograd and for hf_dp alike.
So the clipper turns the repacking off on every such layer for as long as it is attached
(``support_avx512bf16_for_cpu``, the flag bitsandbytes reads before repacking; ``remove()`` restores it), and refuses
a layer already repacked.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..layers.base import UnsupportedModuleError

_FLAG = "support_avx512bf16_for_cpu"  # bitsandbytes' Linear4bit: repack the weight in an eval-mode, no-grad forward

__all__ = ["hold_cpu_repacking", "release_cpu_repacking"]


def hold_cpu_repacking(
    model: nn.Module, named_modules: Iterable[tuple[str, nn.Module]] | None = None
) -> list[tuple[nn.Module, bool]]:
    """Turn bitsandbytes' CPU repacking off on every 4-bit layer of ``model``; returns what
    :func:`release_cpu_repacking` restores. Raises ``UnsupportedModuleError`` (changing nothing) if a layer's weight
    is repacked already. ``named_modules``: ``model.named_modules()``, if the caller has just listed them."""
    named = model.named_modules() if named_modules is None else named_modules
    layers = [(name, m) for name, m in named if hasattr(m, _FLAG)]
    for name, module in layers:
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if getattr(state, "packing_format_for_cpu", False):
            raise UnsupportedModuleError(
                f"The 4-bit weight of `{name}` ({type(module).__name__}) is in bitsandbytes' CPU inference layout (it "
                "repacks it in place when the model runs in eval mode without gradients, e.g. an evaluation or "
                "generation on a CPU with AVX512-BF16), and bitsandbytes' backward through a repacked weight is "
                "wrong, so no gradient through it can be exact. Load the model again before training (an evaluation "
                "inside `train()` is safe: hf_dp keeps the repacking off while it is attached)."
            )
    held = [(module, getattr(module, _FLAG)) for _, module in layers]
    for module, _ in held:
        setattr(module, _FLAG, False)
    return held


def release_cpu_repacking(held: list[tuple[nn.Module, bool]]) -> None:
    """Restore the flags :func:`hold_cpu_repacking` turned off."""
    for module, flag in held:
        setattr(module, _FLAG, flag)
