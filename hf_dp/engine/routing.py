"""Module calls whose rows the values of the data choose (an MoE's token rows of one expert): no run on sub-batches
proves where the examples lie in them.

The probe proves a layout by comparing example 0's rows in runs on ``[0]`` and ``[1, 0]``. That proves a structure
only if the order of the rows does not depend on the values. An MoE that runs one expert module on the token rows
routed to it (``hidden[top_x]``, ``top_x`` from the router's ``argmax`` or ``topk``) orders them by the router's
choice first: when every token of the probed examples picks the same expert, the rows happen to be contiguous per
example and the comparison passes; on a batch whose examples route differently the rows of one example are no longer
a block, and a closed-form rule reading them as one gives every example a share of the others' gradients (nllb-moe's
decoder with LoRA on its experts: 0.2 relative error). The tracker follows two marks through a probe run:

* *value-derived*: an integer or boolean tensor computed from floating-point values (a comparison, ``argmax``,
  ``topk`` indices, a cast), from a random draw, or from another value-derived tensor;
* *routed*: rows selected along dimension 0 by a value-derived index (``x[idx]``, ``x[mask]``,
  ``index_select(0, .)``, ``gather(0, .)``, ``take``, ``masked_select``, ``repeat_interleave``), and every tensor
  computed from routed ones, until they are written back into rows that are not routed (``index_add_``,
  ``index_copy_``, ``scatter_add_``, ``x[idx] = .``) or returned by a call that is not routed (whose output layout
  the comparison then proves as for any call).

A call that takes a routed tensor, and every call inside it, is *routed*: it gets no layout, so the parameters it uses
are covered by the smallest enclosing module whose own inputs and outputs carry the examples (the experts container,
through the torch.func fallback, which re-runs it per example). Indices computed from integer inputs alone (token
ids, attention masks) are not value-derived: the rows they select are proven by the comparison as before.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RowTracker"]

T = torch.Tensor

#: In-place and out-of-place writes of rows into a target: the result has the target's rows (routed only if it is).
_WRITES = frozenset(
    {
        T.index_add_, T.index_add, torch.index_add, T.index_copy_, T.index_copy, torch.index_copy,
        T.index_put_, T.index_put, torch.index_put, T.index_fill_, T.index_fill, torch.index_fill,
        T.scatter_, T.scatter, torch.scatter, T.scatter_add_, T.scatter_add, torch.scatter_add,
        T.scatter_reduce_, T.scatter_reduce, torch.scatter_reduce, T.masked_scatter_, T.masked_scatter,
        torch.masked_scatter, T.index_reduce_, T.index_reduce, torch.index_reduce, T.__setitem__,
    }
)  # fmt: skip
#: Functions that read only the shape, dtype and device of their tensor arguments.
_SHAPE_ONLY = frozenset(
    {
        torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, T.new_zeros, T.new_ones, T.new_empty,
        T.new_full, T.size, T.dim, T.numel, torch.numel, T.stride, T.data_ptr,
    }
)  # fmt: skip
#: Random draws: their values say nothing the comparison of two runs could prove.
_RANDOM = frozenset(
    {
        torch.rand, torch.randn, torch.randint, torch.randperm, torch.rand_like, torch.randn_like, torch.randint_like,
        torch.bernoulli, T.bernoulli, T.bernoulli_, torch.multinomial, T.multinomial, torch.normal, T.uniform_,
        T.normal_, T.exponential_, T.random_, T.geometric_, T.cauchy_, T.log_normal_,
    }
)  # fmt: skip
#: ``func -> (position, name)`` of the dimension argument of a gather along a dimension (dimension 0 routes rows).
_ALONG_DIM = {
    torch.index_select: (1, "dim"),
    T.index_select: (1, "dim"),
    torch.gather: (1, "dim"),
    T.gather: (1, "dim"),
    torch.take_along_dim: (2, "dim"),
    T.take_along_dim: (2, "dim"),
}
#: ``func -> (position, name)`` of the index of every function that selects rows by an index.
_INDEX_ARG = {
    T.__getitem__: (1, "indices"),
    torch.index_select: (2, "index"),
    T.index_select: (2, "index"),
    torch.gather: (2, "index"),
    T.gather: (2, "index"),
    torch.take_along_dim: (1, "indices"),
    T.take_along_dim: (1, "indices"),
    torch.take: (1, "index"),
    T.take: (1, "index"),
    torch.masked_select: (1, "mask"),
    T.masked_select: (1, "mask"),
    torch.repeat_interleave: (1, "repeats"),
    T.repeat_interleave: (1, "repeats"),
}


def _arg(args: tuple, kwargs: dict | None, position: int, name: str, default: Any = None) -> Any:
    if len(args) > position:
        return args[position]
    return (kwargs or {}).get(name, default)


_SEQUENCES = (list, tuple)


def _tensors(args: tuple, kwargs: dict | None) -> list[Tensor]:
    """The tensors among a call's arguments (top level, and inside a top-level list or tuple)."""
    found = []
    for x in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(x, Tensor):
            found.append(x)
        elif isinstance(x, _SEQUENCES):
            found += [y for y in x if isinstance(y, Tensor)]
    return found


def _outputs(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, _SEQUENCES):
        return [y for y in out if isinstance(y, Tensor)]
    return []


def _first_index(src: Any, index: Any) -> Any:
    """The part of a ``__getitem__`` index that applies to dimension 0 of ``src`` (``None``: dimension 0 is not
    indexed)."""
    items = index if isinstance(index, tuple) else (index,)
    real = [x for x in items if x is not None]
    if not real:
        return None
    if real[0] is Ellipsis:
        rest = real[1:]
        # the ellipsis covers no dimension only when the other entries index every dimension
        return rest[0] if rest and isinstance(src, Tensor) and len(rest) >= src.dim() else None
    return real[0]


class RowTracker:
    """The marks of one probe run (see the module docstring) and the calls it found routed.

    ``observe(func, args, kwargs, out)`` is called for every torch function of the run; ``enter(index, parent,
    in_leaves)`` and ``leave(index, out_leaves)`` around every module call. ``tables``: the ids of the model's
    parameters and buffers, whose rows a value-derived index selects as an embedding does (the rows follow the index,
    whose layout the comparison proves)."""

    def __init__(self, tables: frozenset[int] = frozenset()) -> None:
        self._tables = tables  # ids of the model's parameters and buffers
        self._derived: dict[int, weakref.ref] = {}
        self._routed: dict[int, weakref.ref] = {}
        self.routed_calls: set[int] = set()

    @classmethod
    def for_model(cls, model: nn.Module) -> RowTracker:
        """A tracker for a run of ``model`` (its parameters and buffers are its tables)."""
        return cls(frozenset(map(id, itertools.chain(model.parameters(), model.buffers()))))

    @staticmethod
    def _has(marks: dict[int, weakref.ref], t: Tensor) -> bool:
        ref = marks.get(id(t))
        return ref is not None and ref() is t

    @staticmethod
    def _mark(marks: dict[int, weakref.ref], tensors: list[Tensor]) -> None:
        for t in tensors:
            marks[id(t)] = weakref.ref(t)

    def _selects_by_value(self, func, args: tuple, kwargs: dict | None) -> bool:
        """Whether ``func`` selects rows along dimension 0 by a value-derived index."""
        where = _INDEX_ARG.get(func)
        if where is None:
            return False
        index = _arg(args, kwargs, *where)
        src = args[0] if args else None
        if isinstance(src, Tensor) and (id(src) in self._tables or id(src._base) in self._tables):
            return False
        if func is T.__getitem__:
            index = _first_index(args[0] if args else None, index)
        elif func in _ALONG_DIM:
            dim = _arg(args, kwargs, *_ALONG_DIM[func])
            if isinstance(dim, int) and isinstance(src, Tensor) and dim % max(src.dim(), 1) != 0:
                return False
        return isinstance(index, Tensor) and self._has(self._derived, index)

    def observe(self, func, args: tuple, kwargs: dict | None, out: Any) -> None:
        if isinstance(out, Tensor):
            # the common call marks nothing: nothing is routed yet, no selection by a value-derived index starts
            # here, and its one output is floating-point (only integer and boolean tensors are marked value-derived)
            routing = self._routed or (self._derived and func in _INDEX_ARG)
            if not routing and (out.is_floating_point() or out.is_complex()):
                return
            outputs = (out,)
        else:
            outputs = _outputs(out)
        if not outputs:  # a call that returns no tensor marks nothing
            return
        # routed: only while some tensor is marked routed, or an index is value-derived (else nothing can be)
        if self._routed or (self._derived and func in _INDEX_ARG):
            if self._routes(func, args, kwargs, _tensors(args, kwargs)):
                self._mark(self._routed, outputs)
        if func in _SHAPE_ONLY:
            return
        if func in _RANDOM or self._derives(args, kwargs):
            marks = self._derived
            for t in outputs:
                if not (t.is_floating_point() or t.is_complex()):
                    marks[id(t)] = weakref.ref(t)

    def _derives(self, args: tuple, kwargs: dict | None) -> bool:
        """Whether some tensor argument (in :func:`_tensors`' order) is floating-point, complex or value-derived."""
        marks = self._derived
        for x in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(x, Tensor):
                if x.is_floating_point() or x.is_complex() or (marks and self._has(marks, x)):
                    return True
            elif isinstance(x, _SEQUENCES):
                for y in x:
                    if isinstance(y, Tensor) and (
                        y.is_floating_point() or y.is_complex() or (marks and self._has(marks, y))
                    ):
                        return True
        return False

    def _routes(self, func, args: tuple, kwargs: dict | None, tensors: list[Tensor]) -> bool:
        """Whether the outputs of ``func`` are routed (see the module docstring)."""
        if func in _WRITES:
            target = args[0] if args else None
            return isinstance(target, Tensor) and self._has(self._routed, target)
        return any(self._has(self._routed, t) for t in tensors) or self._selects_by_value(func, args, kwargs)

    def enter(self, index: int, parent: int | None, in_leaves: list) -> None:
        """A module call starts: it is routed if its caller is, or if it takes a routed tensor."""
        if parent in self.routed_calls or (
            self._routed and any(isinstance(x, Tensor) and self._has(self._routed, x) for x in in_leaves)
        ):
            self.routed_calls.add(index)

    def leave(self, index: int, out_leaves: list) -> None:
        """A module call returns: the output of a call that is not routed is proven as any other (the comparison of
        the runs decides), not routed."""
        if self._routed and index not in self.routed_calls:
            for x in out_leaves:
                if isinstance(x, Tensor):
                    self._routed.pop(id(x), None)
