"""The examples of a call of the root model: how many, and how to take a sub-batch of them.

The root model's tensor inputs carry the examples along dimension 0 (the Hugging Face convention: ``input_ids``,
``attention_mask``, ``pixel_values`` are ``[B, ...]``). One exception is understood: ``EmbeddingBag``-style inputs,
a flat 1-D ``input`` with ``offsets`` (and optional ``per_sample_weights``), where example ``b`` is the bag
``input[offsets[b]:offsets[b+1]]``. Whether the per-example loss really follows this convention is checked on the
first batch (see ``BookKeepingClipper.prepare``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..layers import UnsupportedModuleError

__all__ = ["RootBatch", "root_batch", "slice_batch"]

#: Keyword inputs whose first dimension is the batch, in order of preference.
BATCH_KWARGS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "decoder_input_ids")


@dataclass(frozen=True)
class _Bags:
    """Leaf positions of an EmbeddingBag-style call: flat ids, offsets, optional per-sample weights."""

    ids: int
    offsets: int
    weights: int | None
    include_last: bool


@dataclass(frozen=True)
class RootBatch:
    """``size`` examples; ``bags`` if they are bags of a flat input."""

    size: int
    bags: _Bags | None = None


def _is_packed(x) -> bool:
    return isinstance(x, PackedSequence)


def _flatten(args: tuple, kwargs: dict):
    return tree_flatten((tuple(args), dict(kwargs)), is_leaf=_is_packed)


def root_batch(model: nn.Module, args: tuple, kwargs: dict) -> RootBatch:
    """The number of examples in a call ``model(*args, **kwargs)``.

    Raises:
        UnsupportedModuleError: a ``PackedSequence`` input (its rows are sorted by length, not by example).
    """
    leaves, _ = _flatten(args, kwargs)
    if any(_is_packed(x) for x in leaves):
        raise UnsupportedModuleError(
            "The model got a PackedSequence: its rows are grouped by time step and sorted by length, so hf_dp cannot "
            "prove which rows belong to which example. Pass padded batch-first tensors (and the lengths) instead."
        )
    offsets = kwargs.get("offsets")
    if offsets is None and isinstance(model, nn.EmbeddingBag) and len(args) > 1:
        offsets = args[1]
    flat = kwargs.get("input", args[0] if args else None)
    if (
        isinstance(offsets, Tensor)
        and isinstance(flat, Tensor)
        and offsets.dim() == 1
        and flat.dim() == 1
        and not offsets.is_floating_point()
        and not flat.is_floating_point()
    ):
        include_last = any(isinstance(m, nn.EmbeddingBag) and m.include_last_offset for m in model.modules())
        ids_pos = next(i for i, x in enumerate(leaves) if x is flat)
        offsets_pos = next(i for i, x in enumerate(leaves) if x is offsets)
        weights = kwargs.get("per_sample_weights")
        weights_pos = next((i for i, x in enumerate(leaves) if x is weights), None) if weights is not None else None
        bags = _Bags(ids_pos, offsets_pos, weights_pos, include_last)
        return RootBatch(offsets.shape[0] - int(include_last), bags)
    for key in BATCH_KWARGS:
        value = kwargs.get(key)
        if isinstance(value, Tensor) and value.dim() > 0:
            return RootBatch(value.shape[0])
    for value in leaves:
        if isinstance(value, Tensor) and value.dim() > 0:
            return RootBatch(value.shape[0])
    raise UnsupportedModuleError("The model got no tensor input with a batch dimension.")


def _bag_bounds(offsets: Tensor, total: int, batch: RootBatch) -> list[tuple[int, int]]:
    starts = offsets.tolist()
    ends = starts[1:] if batch.bags.include_last else starts[1:] + [total]
    return list(zip(starts[: batch.size], ends[: batch.size], strict=True))


def slice_batch(args: tuple, kwargs: dict, batch: RootBatch, index: list[int]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` restricted to the examples ``index`` (in that order; repeats allowed).

    Every tensor whose first dimension is the batch is indexed along it; bags are cut out of the flat input (and its
    per-sample weights) and get new offsets; everything else is passed unchanged.
    """
    leaves, spec = _flatten(args, kwargs)
    out = list(leaves)
    skip: set[int] = set()
    if batch.bags is not None:
        bags = batch.bags
        ids, offsets = leaves[bags.ids], leaves[bags.offsets]
        bounds = _bag_bounds(offsets, ids.shape[0], batch)
        pieces = [torch.arange(*bounds[i], device=ids.device) for i in index]
        take = torch.cat(pieces) if pieces else ids.new_zeros(0)
        sizes = torch.tensor([len(p) for p in pieces], device=offsets.device, dtype=offsets.dtype)
        new_offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        out[bags.ids] = ids[take]
        out[bags.offsets] = new_offsets if bags.include_last else new_offsets[:-1]
        skip = {bags.ids, bags.offsets}
        if bags.weights is not None:
            out[bags.weights] = leaves[bags.weights][take]
            skip.add(bags.weights)
    for i, leaf in enumerate(leaves):
        if i in skip or not isinstance(leaf, Tensor) or leaf.dim() == 0 or leaf.shape[0] != batch.size:
            continue
        out[i] = leaf.index_select(0, torch.tensor(index, device=leaf.device, dtype=torch.long))
    new_args, new_kwargs = tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs)
