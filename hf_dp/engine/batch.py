"""The examples of a call of the root model: how many, and how to take a sub-batch of them.

The root model's tensor inputs carry the examples along dimension 0 (the Hugging Face convention: ``input_ids``,
``attention_mask``, ``pixel_values`` are ``[B, ...]``). One exception is understood: ``EmbeddingBag``-style inputs,
a flat 1-D ``input`` of concatenated ids with ``offsets`` (and optional ``per_sample_weights``, one per id), where
example ``b`` is the bag ``input[offsets[b]:offsets[b+1]]`` (``include_last_offset``: ``offsets`` has one more entry,
the end of the last bag). Such inputs are read off

* the root's own signature, when the root is an ``nn.EmbeddingBag``;
* the keyword ``offsets`` (with ``input``, or the first positional input, and ``per_sample_weights``);
* else, in a model that has an ``nn.EmbeddingBag``, the order of its inputs: a 1-D integer input followed by another
  (the ids and their offsets, as ``EmbeddingBag`` takes them; ``model((input, offsets))`` or ``model(ids, offsets)``),
  then, if it follows, a 1-D floating input of one entry per id (the per-sample weights). Several such groups (one
  per feature of a recommendation model) must hold the same number of bags.

The structure of the call decides (never the values), so every batch of one structure is read the same way. That an
``EmbeddingBag`` of the model really takes these bags is proven on the probe (:func:`check_bags`), and whether the
per-example loss follows the convention is checked on the first batch (see ``BookKeepingClipper.prepare``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..layers import UnsupportedModuleError

__all__ = ["LEAF_TYPES", "RootBatch", "check_bags", "describe", "root_batch", "slice_batch"]

#: Types that ``tree_flatten`` keeps whole (pytree leaves).
LEAF_TYPES = frozenset({Tensor, nn.Parameter, int, float, bool, str, type(None), torch.dtype, torch.device})

#: Keyword inputs whose first dimension is the batch, in order of preference.
BATCH_KWARGS = ("input_ids", "inputs_embeds", "pixel_values", "input_values", "input_features", "decoder_input_ids")

_BAG_SIGNATURE = inspect.signature(nn.EmbeddingBag.forward)


@dataclass(frozen=True)
class _Bags:
    """Leaf positions of an EmbeddingBag-style input: flat ids, offsets, optional per-sample weights."""

    ids: int
    offsets: int
    weights: int | None
    include_last: bool


@dataclass(frozen=True)
class RootBatch:
    """``size`` examples; ``bags``: the EmbeddingBag-style inputs, if the examples are bags of flat inputs."""

    size: int
    bags: tuple[_Bags, ...] = ()


def _is_packed(x) -> bool:
    return isinstance(x, PackedSequence)


def _flatten(args: tuple, kwargs: dict):
    return tree_flatten((tuple(args), dict(kwargs)), is_leaf=_is_packed)


def _is_ids(x) -> bool:
    """A 1-D integer tensor (flat ids, or offsets)."""
    return (
        isinstance(x, Tensor)
        and x.dim() == 1
        and not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
    )


def _position(leaves: list, x) -> int | None:
    return next((i for i, leaf in enumerate(leaves) if leaf is x), None) if isinstance(x, Tensor) else None


def _bags_of(leaves: list, flat, offsets, weights, include_last: bool) -> tuple[_Bags, ...]:
    if not (_is_ids(flat) and _is_ids(offsets)) or flat is offsets:
        return ()
    return (_Bags(_position(leaves, flat), _position(leaves, offsets), _position(leaves, weights), include_last),)


def _root_bags(model: nn.Module, args: tuple, kwargs: dict, leaves: list) -> tuple[_Bags, ...]:
    """The EmbeddingBag-style inputs of a call of ``model`` (see the module docstring), by structure alone."""
    if isinstance(model, nn.EmbeddingBag):
        try:
            bound = _BAG_SIGNATURE.bind(model, *args, **kwargs).arguments
        except TypeError:
            return ()
        weights = bound.get("per_sample_weights")
        return _bags_of(leaves, bound.get("input"), bound.get("offsets"), weights, model.include_last_offset)
    if "offsets" in kwargs:
        include_last = any(isinstance(m, nn.EmbeddingBag) and m.include_last_offset for m in model.modules())
        flat = kwargs.get("input", args[0] if args else None)
        return _bags_of(leaves, flat, kwargs["offsets"], kwargs.get("per_sample_weights"), include_last)
    ids = [i for i, x in enumerate(leaves) if _is_ids(x)]
    if not any(b == a + 1 for a, b in zip(ids, ids[1:], strict=False)):
        return ()  # no 1-D integer input followed by another: the common case, decided without visiting the model
    modules = [m for m in model.modules() if isinstance(m, nn.EmbeddingBag)]
    return _adjacent_bags(leaves, {m.include_last_offset for m in modules}) if modules else ()


def _adjacent_bags(leaves: list, flags: set[bool]) -> tuple[_Bags, ...]:
    """Each 1-D integer input followed by another (ids, offsets), with the 1-D floating input of one entry per id
    that follows them, if any (per-sample weights); ``flags``: the model's ``include_last_offset`` values."""
    found, i = [], 0
    while i + 1 < len(leaves):
        if not (_is_ids(leaves[i]) and _is_ids(leaves[i + 1])):
            i += 1
            continue
        w = leaves[i + 2] if i + 2 < len(leaves) else None
        weighted = isinstance(w, Tensor) and w.dim() == 1 and w.is_floating_point() and w.shape == leaves[i].shape
        found.append(_Bags(i, i + 1, i + 2 if weighted else None, False))
        i += 3 if weighted else 2
    return _with_last_offset(found, flags, leaves)


def _with_last_offset(found: list[_Bags], flags: set[bool], leaves: list) -> tuple[_Bags, ...]:
    """``found`` with ``include_last`` set: the model's ``include_last_offset`` if its EmbeddingBags agree; else, the
    one number of bags that every group's offsets allow (``n`` or ``n - 1`` entries), if there is one."""
    lengths = [leaves[b.offsets].shape[0] for b in found]
    common = set.intersection(*({n, n - 1} for n in lengths))
    if len(flags) > 1 and len(common) == 1:
        count = common.pop()
        return tuple(replace(b, include_last=n == count + 1) for b, n in zip(found, lengths, strict=True))
    return tuple(replace(b, include_last=True in flags) for b in found)


def _bag_count(bags: tuple[_Bags, ...], leaves: list) -> int:
    counts = {leaves[b.offsets].shape[0] - int(b.include_last) for b in bags}
    if len(counts) > 1:
        raise UnsupportedModuleError(
            f"The model got {len(bags)} EmbeddingBag-style inputs (a flat 1-D input and its offsets: its inputs "
            f"{[(b.ids, b.offsets) for b in bags]}, flattened in order from 0) with different numbers of bags "
            f"({sorted(counts)}): hf_dp takes bag i of each for example i, so each must hold one bag per example. "
            "Pass them with one bag per example each, or as batch-first [B, L] ids."
        )
    return max(counts.pop(), 0)


def root_batch(model: nn.Module, args: tuple, kwargs: dict) -> RootBatch:
    """The number of examples in a call ``model(*args, **kwargs)``.

    Raises:
        UnsupportedModuleError: a ``PackedSequence`` input (its rows are sorted by length, not by example), or
            EmbeddingBag-style inputs that disagree on the number of bags.
    """
    leaves, _ = _flatten(args, kwargs)
    if any(_is_packed(x) for x in leaves):
        raise UnsupportedModuleError(
            "The model got a PackedSequence: its rows are grouped by time step and sorted by length, so hf_dp cannot "
            "prove which rows belong to which example. Pass padded batch-first tensors (and the lengths) instead."
        )
    bags = _root_bags(model, args, kwargs, leaves)
    if bags:
        return RootBatch(_bag_count(bags, leaves), bags)
    for key in BATCH_KWARGS:
        value = kwargs.get(key)
        if isinstance(value, Tensor) and value.dim() > 0:
            return RootBatch(value.shape[0])
    for value in leaves:
        if isinstance(value, Tensor) and value.dim() > 0:
            return RootBatch(value.shape[0])
    raise UnsupportedModuleError("The model got no tensor input with a batch dimension.")


def describe(batch: RootBatch) -> str:
    """How the examples of ``batch`` are cut out of its inputs, for messages."""
    rows = f"dimension 0 of every input of size {batch.size}"
    if not batch.bags:
        return rows
    where = ", ".join(f"{b.ids} and {b.offsets}" for b in batch.bags)
    return f"bag i of the flat input and offsets that are the model's inputs {where} (flattened, from 0), and {rows}"


def _bag_bounds(offsets: Tensor, total: int, include_last: bool) -> list[tuple[int, int]]:
    """``(start, end)`` of every bag cut by ``offsets`` out of a flat input of ``total`` ids."""
    starts = offsets.tolist()
    if include_last:
        return list(zip(starts[:-1], starts[1:], strict=True))
    return list(zip(starts, starts[1:] + [total], strict=True))


def _not_bags(bags: _Bags, why: str) -> UnsupportedModuleError:
    last = " (with the last offset)" if bags.include_last else ""
    return UnsupportedModuleError(
        f"hf_dp took the model's 1-D integer inputs {bags.ids} and {bags.offsets} (its inputs flattened in "
        f"order, from 0) for an EmbeddingBag's flat input and offsets{last}, and bag i for example i; but {why}. Pass "
        "the EmbeddingBag's `input` and `offsets` (one bag per example, `include_last_offset` as the module's) to "
        "the model as they are, or batch-first [B, L] ids."
    )


def _cut(leaves: list, bags: _Bags) -> list[tuple[int, int]]:
    """The bags of a root call's EmbeddingBag-style input (checked: offsets, not lengths)."""
    total = leaves[bags.ids].shape[0]
    bounds = _bag_bounds(leaves[bags.offsets], total, bags.include_last)
    if bounds and (bounds[0][0] != 0 or any(a > b for a, b in bounds) or bounds[-1][1] > total):
        raise _not_bags(bags, "these are no offsets: they must start at 0, never decrease and end within the input")
    return bounds


def slice_batch(args: tuple, kwargs: dict, batch: RootBatch, index: list[int]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` restricted to the examples ``index`` (in that order; repeats allowed).

    Every tensor whose first dimension is the batch is indexed along it; bags are cut out of the flat input (and its
    per-sample weights) and get new offsets; everything else is passed unchanged.
    """
    if not batch.bags and LEAF_TYPES.issuperset(map(type, args)) and LEAF_TYPES.issuperset(map(type, kwargs.values())):
        # every input a leaf (the common call): what the general path below does, without flattening
        rows: dict = {}  # device -> the index, made once per device
        new_args = tuple([_rows_of(x, batch.size, index, rows) for x in args])
        return new_args, {k: _rows_of(v, batch.size, index, rows) for k, v in kwargs.items()}
    leaves, spec = _flatten(args, kwargs)
    out = list(leaves)
    skip: set[int] = set()
    for bags in batch.bags:
        ids, offsets = leaves[bags.ids], leaves[bags.offsets]
        bounds = _cut(leaves, bags)
        pieces = [torch.arange(*bounds[i], device=ids.device) for i in index]
        take = torch.cat(pieces) if pieces else ids.new_zeros(0)
        sizes = torch.tensor([len(p) for p in pieces], device=offsets.device, dtype=offsets.dtype)
        new_offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        out[bags.ids] = ids[take]
        out[bags.offsets] = new_offsets if bags.include_last else new_offsets[:-1]
        skip |= {bags.ids, bags.offsets}
        if bags.weights is not None:
            out[bags.weights] = leaves[bags.weights][take]
            skip.add(bags.weights)
    rows: dict = {}
    for i, leaf in enumerate(leaves):
        if i not in skip:
            out[i] = _rows_of(leaf, batch.size, index, rows)
    new_args, new_kwargs = tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs)


def _rows_of(leaf, size: int, index: list[int], rows: dict):
    """``leaf``'s rows ``index`` if it is a tensor whose first dimension is the batch of ``size`` examples, else
    ``leaf``; ``rows``: the index tensors made so far, by device."""
    if not isinstance(leaf, Tensor) or leaf.dim() == 0 or leaf.shape[0] != size:
        return leaf
    device = leaf.device
    take = rows.get(device)
    if take is None:
        take = rows[device] = torch.tensor(index, device=device, dtype=torch.long)
    return leaf.index_select(0, take)


def _call_bags(record) -> tuple[list[tuple[int, int]], Tensor | None] | None:
    """The bags (``(start, end)`` of each) and per-sample weights of a probe call of an ``nn.EmbeddingBag`` with a
    flat input and offsets (``None`` for any other call)."""
    if not isinstance(record.module, nn.EmbeddingBag):
        return None
    try:
        bound = _BAG_SIGNATURE.bind(record.module, *record.args, **record.kwargs).arguments
    except TypeError:
        return None
    flat, offsets = bound.get("input"), bound.get("offsets")
    if not (_is_ids(flat) and _is_ids(offsets)):
        return None
    return _bag_bounds(offsets, flat.shape[0], record.module.include_last_offset), bound.get("per_sample_weights")


def _same_weights(taken: Tensor | None, own: Tensor | None) -> bool:
    """The call takes per-sample weights (one per id, maybe scaled) if some were cut out of the model's input."""
    return own is None or (taken is not None and taken.shape == own.shape)


def check_bags(batch: RootBatch, args: tuple, kwargs: dict, calls: list) -> None:
    """Prove, on a probe run of the sub-batch ``(args, kwargs)`` cut by :func:`slice_batch`, that each of
    ``batch``'s EmbeddingBag-style inputs is the input of an ``nn.EmbeddingBag`` call of the run (``calls``, the probe
    run's records): the same bags (its ids may be mapped, e.g. hashed) and per-sample weights.

    Raises:
        UnsupportedModuleError: no call takes them (the inputs are no bags, or bags of another ``include_last_offset``).
    """
    if not batch.bags:
        return
    leaves, _ = _flatten(args, kwargs)
    taken = [c for c in (_call_bags(record) for record in calls) if c is not None]
    for bags in batch.bags:
        own = _bag_bounds(leaves[bags.offsets], leaves[bags.ids].shape[0], bags.include_last)
        weights = leaves[bags.weights] if bags.weights is not None else None
        if any(bounds == own and _same_weights(w, weights) for bounds, w in taken):
            continue
        which = " and per-sample weights" if weights is not None else ""
        raise _not_bags(bags, f"on a sub-batch no nn.EmbeddingBag of the model takes these bags{which}")
