"""SpecAugment's mask embedding (wav2vec2 and the models that share its ``_mask_hidden_states``).

wav2vec2-style models (wav2vec2, HuBERT, WavLM, Data2VecAudio, UniSpeech(-SAT), SEW(-D), Wav2Vec2-Conformer,
Wav2Vec2-BERT, SpeechT5's speech prenet) own a vector ``masked_spec_embed`` that their ``_mask_hidden_states`` writes
into the frames SpecAugment masks: ``h[mask_time_indices] = masked_spec_embed.to(h.dtype)``, the mask drawn from
numpy in training (or passed as ``mask_time_indices``), then ``h[mask_feature_indices] = 0`` for the masked features.
Per example, ``dL_i/de = sum_{t masked in example i} g_{i,t}``, with ``g`` the gradient of ``h`` right after the
write: the output gradient with the positions a later write overwrote set to 0. No re-run, so no redraw of the mask.

While a clipper is installed, ``_mask_hidden_states`` of each such module (its instance only) runs as a call of a
:class:`SpecAugmentMask` child, which the engine hooks like any layer: the uses of ``masked_spec_embed`` happen inside
that call, its output is the written ``h``, and the call records every write into ``h`` as it happens (a torch
function mode over the original method): the mask the forward pass actually applied. Anything but that pattern is
refused when the call is book-kept: another use of the embedding, a write of it into another tensor or not of whole
rows, an in-place change of ``h`` the record does not explain, a later write of a tensor. :func:`install` and
:func:`uninstall` put the child and the method in place and take them out (``BookKeepingClipper.remove()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .base import Captured, LayerRule, UnsupportedModuleError, sum_positions
from .grads import InstantiatedGrad, PerExampleGrad, compute_dtype
from .registry import register_rule

__all__ = ["MaskWrites", "SpecAugmentMask", "SpecAugmentRule", "install", "uninstall"]

#: The parameter, the method that writes it, and the name of the child module that runs the method while installed.
PARAMETER, METHOD, CHILD = "masked_spec_embed", "_mask_hidden_states", "hf_dp_spec_augment"
_SETITEM, _TO = torch.Tensor.__setitem__, torch.Tensor.to
_NUMBERS = (bool, int, float)


def _version(t: Tensor) -> int | None:
    try:
        return t._version
    except Exception:  # noqa: BLE001  (a tensor of a functorch transform has none)
        return None


@dataclass(eq=False)
class _Write:
    target: Tensor
    index: Any
    value: Any  # the value written (``None`` for the embedding)
    embedding: bool
    versions: tuple[int | None, int | None]  # the target's version before and after


@dataclass(eq=False)
class MaskWrites:
    """What one call of ``_mask_hidden_states`` did: every ``Tensor.__setitem__`` in order, and the first use of the
    embedding that is neither a conversion (``.to``) nor a value written (``other_use``)."""

    writes: list[_Write] = field(default_factory=list)
    other_use: str | None = None

    def steps(self, output: Tensor, embedding: Tensor, name: str) -> list[tuple[bool, Tensor]]:
        """``(writes the embedding, bool index)`` of each write into ``output`` from the first write of the embedding
        on, once checked to be the pattern the rule differentiates (else :class:`UnsupportedModuleError`)."""

        def refuse(why: str) -> UnsupportedModuleError:
            return UnsupportedModuleError(
                f"`{name}` ({PARAMETER} of SpecAugment): {why}, where hf_dp expects `h[mask] = {PARAMETER}` into the "
                f"hidden states it returns. Freeze it (`{PARAMETER}.requires_grad_(False)`) or turn SpecAugment off "
                "(`mask_time_prob=0`)."
            )

        if self.other_use is not None:
            raise refuse(f"the embedding is used by `{self.other_use}`")
        first = next((k for k, w in enumerate(self.writes) if w.embedding), None)
        if first is None:
            return []
        steps, version = [], self.writes[first].versions[0]
        for w in self.writes[first:]:
            if w.target is not output:
                if w.embedding:
                    raise refuse("the embedding is written into another tensor than the one returned")
                continue
            if version is None or w.versions[0] != version:
                raise refuse("the hidden states are changed in place by something else than an indexed write")
            version = w.versions[1]
            index = w.index
            if (
                not (isinstance(index, Tensor) and index.dtype == torch.bool)
                or index.shape != output.shape[: index.dim()]
            ):
                raise refuse("a write is indexed by something else than a boolean mask of leading dimensions")
            if w.embedding and (index.dim() != output.dim() - 1 or embedding.shape != output.shape[-1:]):
                raise refuse("the embedding is written into something else than whole rows")
            if not w.embedding and not isinstance(w.value, _NUMBERS):
                raise refuse("a tensor is written over the masked hidden states")
            steps.append((w.embedding, index))
        if _version(output) != version:
            raise refuse("the hidden states are changed in place after the last indexed write")
        return steps


class _Recorder(TorchFunctionMode):
    """Records into ``record`` every ``Tensor.__setitem__`` and every use of ``embedding`` (and of its ``.to``
    conversions) while the original ``_mask_hidden_states`` runs."""

    def __init__(self, embedding: Tensor, record: MaskWrites) -> None:
        super().__init__()
        self.values = [] if embedding is None else [embedding]
        self.record = record

    def _is_value(self, x) -> bool:
        return any(x is v for v in self.values)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SETITEM and len(args) == 3 and not kwargs and isinstance(args[0], Tensor):
            target, index, value = args
            embedding = isinstance(value, Tensor) and self._is_value(value)
            before = _version(target)
            out = func(*args)
            write = _Write(target, index, None if embedding else value, embedding, (before, _version(target)))
            self.record.writes.append(write)
            return out
        out = func(*args, **kwargs)
        if not (isinstance(out, Tensor) and out.is_floating_point()):
            return out  # not a use whose gradient flows
        if any(map(self._is_value, tree_leaves((args, kwargs)))):
            if func is _TO and self._is_value(args[0]):
                self.values.append(out)
            elif self.record.other_use is None:
                self.record.other_use = getattr(func, "__name__", str(func))
        return out


class SpecAugmentMask(nn.Module):
    """``owner._mask_hidden_states`` as a module call (a child of ``owner`` while a clipper is installed), whose
    output is the hidden states it wrote and whose ``writes`` keyword receives what it wrote."""

    def __init__(self, owner: nn.Module, original=None) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # not a submodule: its parameters stay the owner's
        object.__setattr__(self, "original", original)  # the instance's own method before install, if it had one

    def embedding(self) -> Tensor | None:
        return self.owner._parameters.get(PARAMETER)

    def parameters(self, recurse: bool = True):
        """The embedding its call uses (the owner's: ``named_parameters`` and the model's listings leave it out here,
        so it is saved and counted once, under its owner)."""
        embedding = self.embedding()
        if embedding is not None:
            yield embedding

    def mask_hidden_states(self, hidden_states, *args, **kwargs):
        """What the owner calls instead of its ``_mask_hidden_states``."""
        return self(hidden_states, *args, writes=MaskWrites(), **kwargs)

    def forward(self, hidden_states, *args, writes: MaskWrites, **kwargs):
        writes.writes, writes.other_use = [], None
        method = self.original or getattr(type(self.owner), METHOD).__get__(self.owner)
        embedding = self.owner.masked_spec_embed  # (a re-run under torch.func may have swapped it)
        with _Recorder(embedding, writes):
            return method(hidden_states, *args, **kwargs)


@register_rule(SpecAugmentMask)
class SpecAugmentRule(LayerRule):
    """``dL_i/de = sum over the rows of example i that the embedding was written into of the gradient of h right after
    that write`` (the output gradient, 0 where a later write overwrote it)."""

    param_names = (PARAMETER,)
    layout = "leading"

    def parameters(self, module: SpecAugmentMask) -> list[nn.Parameter]:
        p = module.embedding()
        return [] if p is None else [p]

    def capture(self, module: SpecAugmentMask, args: tuple, kwargs: dict, output: Any) -> Captured:
        embedding = module.embedding()
        name = f"{type(module.owner).__name__}.{PARAMETER}"
        return Captured(args=(), kwargs={"steps": kwargs["writes"].steps(output, embedding, name)})

    def per_example_grads(
        self, module: SpecAugmentMask, captured: Captured, grad_output: Tensor, trainable: set[nn.Parameter]
    ) -> dict[nn.Parameter, PerExampleGrad]:
        embedding = module.embedding()
        if embedding is None or embedding not in trainable:
            return {}
        g = grad_output.to(compute_dtype(embedding.dtype))
        total = g.new_zeros(g.shape[0], g.shape[-1])
        overwritten = None  # positions a later write replaced: no gradient reaches the earlier value there
        for writes_embedding, index in reversed(captured.kwargs["steps"]):
            full = index.reshape(*index.shape, *([1] * (g.dim() - index.dim()))).expand(g.shape)
            if writes_embedding:
                kept = full if overwritten is None else full & ~overwritten
                total += sum_positions(g * kept, 1)
            overwritten = full if overwritten is None else overwritten | full
        return {embedding: InstantiatedGrad(total)}


def _writes_spec_embedding(module: nn.Module) -> bool:
    p = module._parameters.get(PARAMETER) if isinstance(module._parameters, dict) else None
    return isinstance(p, Tensor) and p.dim() == 1 and callable(getattr(type(module), METHOD, None))


def install(model: nn.Module, modules: list[nn.Module] | None = None) -> list[SpecAugmentMask]:
    """Route ``_mask_hidden_states`` of every module of ``model`` that owns ``masked_spec_embed`` through a
    :class:`SpecAugmentMask` child (not twice: a module another clipper routes is left to it). ``modules``:
    ``model.modules()``, if the caller has just listed them."""
    installed = []
    for module in list(model.modules()) if modules is None else list(modules):
        current = module.__dict__.get(METHOD)
        if not _writes_spec_embedding(module) or isinstance(getattr(current, "__self__", None), SpecAugmentMask):
            continue
        if CHILD in module._modules or hasattr(module, CHILD):
            continue
        helper = SpecAugmentMask(module, current)
        module.add_module(CHILD, helper)
        module.__dict__[METHOD] = helper.mask_hidden_states
        installed.append(helper)
    return installed


def uninstall(installed: list[SpecAugmentMask]) -> None:
    """Undo :func:`install`: the owners are plain modules again (their own method, no child)."""
    for helper in installed:
        owner = helper.owner
        if owner._modules.get(CHILD) is helper:
            del owner._modules[CHILD]
        if getattr(owner.__dict__.get(METHOD), "__self__", None) is helper:
            if helper.original is None:
                del owner.__dict__[METHOD]
            else:
                owner.__dict__[METHOD] = helper.original
