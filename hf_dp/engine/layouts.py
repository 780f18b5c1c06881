"""Layouts of every tensor of every module call, read off the probe runs, and what a rule can make of them.

A closed-form rule can read a call whose output (and, for position-wise and leading-dimension rules, first input)
has a proven :class:`~hf_dp.layers.Layout`; the fallback can re-run a call whose inputs are batched or shared and
whose floating-point outputs are batched or broadcast (caches proven empty are left out of the re-run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..layers import LayerRule, Layout, UnsupportedModuleError
from ..layers.base import autocast_like
from .probe import MIXED, CallRecord, ProbeRun, eval_mode, flatten_output, infer_layout, same_values

try:
    from transformers.cache_utils import Cache
except ImportError:  # transformers is a dependency; keep the engine importable without it
    Cache = None

__all__ = [
    "CallLayout",
    "Layouts",
    "closed_form_layout",
    "describe_layout",
    "fallback_layout",
    "fits",
    "is_float",
    "leaf_shapes",
    "needs_third_run",
]


@dataclass
class CallLayout:
    """How the engine reads one call of a hooked module: the layout of each output (and, for the fallback, input)
    leaf, which outputs to expand from ``[1, ...]`` to the batch (or, ``deferred``, to leave as they are and follow
    to the model's copies of them along the batch: :mod:`.shared_outputs`), and which inputs (key/value caches, proven
    empty for this call) the fallback's re-run leaves out.

    ``shapes`` holds the shapes of the leaves the layout was proven on (the probe run on two examples; ``None`` for a
    leaf that was not a tensor): the layout holds for a later call only if :func:`fits` says so. A model can take
    another path on another batch (an attention mask built only when some example is padded), and then the call
    needs a layout proven on examples that take that path.
    """

    outputs: list
    inputs: list | None = None
    expand: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()
    shapes: tuple[list, list] | None = None  # (input leaves, output leaves); closed forms: output leaves only
    deferred: bool = False  # the `expand` outputs stay [1, ...]: their copies along the batch are hooked instead


def leaf_shapes(leaves: list) -> list:
    """The shape of every tensor leaf (``None`` for the others)."""
    return [tuple(x.shape) if isinstance(x, Tensor) else None for x in leaves]


def _leaf_fits(x, ref: tuple | None, layout, batch_size: int) -> bool:
    if ref is None or not isinstance(x, Tensor):
        return ref is None and not isinstance(x, Tensor)
    if x.dim() != len(ref):
        return False
    if isinstance(layout, Layout):
        if layout.broadcast and x.dim() > layout.dim and x.shape[layout.dim] == batch_size * layout.repeat:
            return True  # a [1, ...] tensor expanded upstream (its input was): its rows are the examples' copies
        try:
            layout.rows(x, batch_size)
        except ValueError:
            return False
        return True
    # proven shared by every example: a [1, ...] tensor that grew a larger first dimension is not the same tensor
    return not (ref and ref[0] == 1 and x.shape[0] != 1)


def fits(layout: CallLayout, in_leaves: list | None, out_leaves: list, batch_size: int) -> bool:
    """Whether a call with these leaves has the structure ``layout`` was proven on: the same leaves are tensors, of
    the same number of dimensions, batched ones split into the batch's examples, shared ``[1, ...]`` ones still of
    size 1 (``in_leaves=None``: a closed-form call, whose inputs the rule reads through the output's layout)."""
    if layout.shapes is None:
        return True
    ref_in, ref_out = layout.shapes
    if len(out_leaves) != len(ref_out) or len(out_leaves) != len(layout.outputs):
        return False
    for x, ref, lay in zip(out_leaves, ref_out, layout.outputs, strict=True):
        if not _leaf_fits(x, ref, lay, batch_size):
            return False
    if in_leaves is None or layout.inputs is None:
        return True
    if len(in_leaves) != len(ref_in) or len(in_leaves) != len(layout.inputs):
        return False
    for i, (x, ref, lay) in enumerate(zip(in_leaves, ref_in, layout.inputs, strict=True)):
        if i in layout.drop:
            continue
        if not _leaf_fits(x, ref, lay, batch_size):
            return False
    return True


def describe_layout(layout) -> str:
    if layout is MIXED:
        return "its rows for one example differ between sub-batches (examples are mixed, or not contiguous)"
    if layout is None:
        return "it is the same for every example (no dimension carries the examples)"
    if layout.broadcast:
        return "it has size 1 along dimension 0 and is shared by every example"
    return f"the examples lie along dimension {layout.dim}"


class Layouts:
    """Layouts of every leaf of every call, from the runs on examples ``[0]`` and ``[1, 0]``.

    A leaf that is a tensor in one run and not in the other (an attention mask built only when some example is
    padded) is read from the runs on ``[1, 0]`` and ``[1, 1, 0]`` instead, when a third run is given.

    Calls are matched between runs among the calls of modules that hold a traced parameter (in their own subtree);
    calls of other modules (activations, an MoE's per-expert gathers) may differ with the data, get no layout
    (``MIXED``), and are never hooked. ``partner[i]``: the index in ``two`` of call ``i`` of ``one`` (``None`` for an
    unmatched call).

    ``inputs[i]`` and ``outputs[i]`` (the layouts of call ``i``'s input and output leaves) are worked out when first
    read: the plan reads those of the calls it may hook or cover. ``three`` may be a function that makes the third
    run: it is called when the first leaf that needs it is read (a plan that reads no such leaf needs no third run).
    """

    def __init__(
        self,
        one: ProbeRun,
        two: ProbeRun,
        three: ProbeRun | Callable[[], ProbeRun | None] | None = None,
        names: dict[int, str] | None = None,
    ) -> None:
        relevant = _relevance(one)
        sig_one, sig_two = _signature(one, relevant), _signature(two, relevant)
        if [key for key, _ in sig_one] != [key for key, _ in sig_two]:
            raise UnsupportedModuleError(_control_flow_message(sig_one, sig_two, one, two, names or {}))
        self.one, self.two = one, two
        self._relevant = relevant
        self._keys_two = [key for key, _ in sig_two]
        self._make_three = three if callable(three) else None
        self._three: list | None = None  # the third run's calls, matched to the relevant calls of `two`
        if not callable(three):
            self._set_three(three)
        self.partner: list[int | None] = [None] * len(one.calls)
        self._order: dict[int, int] = {}  # call of `one` -> its position among the matched calls
        for k, ((_, i), (_, j)) in enumerate(zip(sig_one, sig_two, strict=True)):
            self.partner[i] = j
            self._order[i] = k
        self._pairs: dict[tuple[int, int, int], Any] = {}  # (call, 0 inputs / 1 outputs, leaf) -> from `one`, `two`
        self._inferred: dict[tuple, Any] = {}  # (id, id, sizes) of two leaves -> their layout
        self._lists: dict[int, tuple[list, list]] = {}
        self.fallback_memo: dict[int, CallLayout | None] = {}
        self.closed_form_memo: dict[tuple[int, str], Layout | None] = {}  # (call, rule.layout) -> its layout

    # (made when read, not held: a column held here would be a reference cycle, which would keep both runs, with
    # every tensor they recorded, alive until the garbage collector's next pass)
    @property
    def inputs(self) -> _Column:
        """``inputs[i]``: the layouts of call ``i``'s input leaves."""
        return _Column(self, 0)

    @property
    def outputs(self) -> _Column:
        """``outputs[i]``: the layouts of call ``i``'s output leaves."""
        return _Column(self, 1)

    def _set_three(self, three: ProbeRun | None) -> None:
        if three is not None and [k for k, _ in _signature(three, self._relevant)] != self._keys_two:
            three = None
        self._three = None if three is None else [three.calls[j] for _, j in _signature(three, self._relevant)]

    def _third(self, i: int) -> CallRecord | None:
        """Call ``i``'s partner in the third run (made now if it was not), or ``None`` without a usable one."""
        if self._make_three is not None:
            make, self._make_three = self._make_three, None
            self._set_three(make())
        return None if self._three is None else self._three[self._order[i]]

    def _leaves(self, i: int, side: int) -> tuple[list, list]:
        c1, c2 = self.one.calls[i], self.two.calls[self.partner[i]]
        return (c1.in_leaves, c2.in_leaves) if side == 0 else (c1.out_leaves, c2.out_leaves)

    def _pair(self, i: int, side: int, j: int, a, b):
        """The layout leaf ``j`` proves in the runs on one and two examples."""
        key = (i, side, j)
        pairs = self._pairs
        if key not in pairs:
            pairs[key] = self._infer(a, b)
        return pairs[key]

    def _infer(self, a, b, sizes: tuple[int, int] = (1, 2)):
        """:func:`infer_layout` of two leaves, once per pair of objects: a tensor one call returns is often what
        the next calls take (the runs keep every leaf alive, so the same pair of objects is the same question)."""
        key = (id(a), id(b), sizes)
        if key not in self._inferred:
            self._inferred[key] = infer_layout(a, b, sizes)
        return self._inferred[key]

    def lists(self, i: int) -> tuple[list, list]:
        """``(inputs, outputs)`` of call ``i``."""
        if i not in self._lists:
            if self.partner[i] is None:
                c = self.one.calls[i]
                self._lists[i] = ([MIXED] * max(len(c.in_leaves), 1), [MIXED] * max(len(c.out_leaves), 1))
            else:
                self._lists[i] = (self._pairwise(i, 0), self._pairwise(i, 1))
        return self._lists[i]

    def _pairwise(self, i: int, side: int) -> list:
        one, two = self._leaves(i, side)
        if len(one) != len(two):
            return [MIXED] * max(len(one), len(two), 1)
        out = []
        for j, (a, b) in enumerate(zip(one, two, strict=True)):
            layout = self._pair(i, side, j, a, b)
            if layout is MIXED and isinstance(a, Tensor) != isinstance(b, Tensor):
                c3 = self._third(i)
                three = None if c3 is None else (c3.in_leaves if side == 0 else c3.out_leaves)
                if three is not None and len(three) == len(two):
                    layout = self._infer(b, three[j], sizes=(2, 3))
            out.append(layout)
        return out

    def batched_rows(self) -> set[int]:
        """The rows per example (``> 1``) of every leaf of run one paired with a layout batched along dimension 0:
        each call's leaves zipped with its ``inputs + outputs``. Where both runs have the same number of leaves, only
        the leaves that are tensors with more than one row in run one are compared, and their layouts are read
        without the third run: a leaf's layout comes from the third run only when the leaf is a tensor in one of the
        first two runs and not in the other, so for a tensor of run one it is the layout of a non-tensor of run two
        against run three, never a batched one."""
        rows: set[int] = set()
        for call in self.one.calls:
            i = call.index
            if self.partner[i] is None:
                continue  # every layout MIXED
            leaves = call.in_leaves + call.out_leaves
            sides = [self._leaves(i, 0), self._leaves(i, 1)]
            if any(len(a) != len(b) for a, b in sides):  # lists of MIXED of another length: zip them as they are
                ins, outs = self.lists(i)
                pairs = zip(leaves, ins + outs, strict=False)
            else:
                n_in = len(sides[0][0])
                pairs = (
                    (leaf, self._pair(i, 0, p, leaf, sides[0][1][p]))
                    if p < n_in
                    else (leaf, self._pair(i, 1, p - n_in, leaf, sides[1][1][p - n_in]))
                    for p, leaf in enumerate(leaves)
                    if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] > 1
                )
            for leaf, layout in pairs:
                batched = isinstance(layout, Layout) and layout.dim == 0 and not layout.broadcast
                if batched and isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] > 1:
                    rows.add(leaf.shape[0])
        return rows


class _Column:
    """``inputs`` or ``outputs`` of :class:`Layouts`, indexed by call."""

    def __init__(self, layouts: Layouts, side: int) -> None:
        self.layouts, self.side = layouts, side

    def __getitem__(self, i: int) -> list:
        return self.layouts.lists(i)[self.side]


def _relevance(run: ProbeRun) -> Callable[[nn.Module], bool]:
    """Whether a module holds a parameter the probe traced (anywhere in its subtree)."""
    traced = set(run.traced) | {id(p) for p in run.uses}
    memo: dict[int, bool] = {}

    def relevant(module: nn.Module) -> bool:
        key = id(module)
        if key not in memo:
            answer = _holds(module, traced, memo, set())
            memo[key] = any(id(p) in traced for p in module.parameters()) if answer is None else answer
        return memo[key]

    return relevant


def _holds(module: nn.Module, traced: set[int], memo: dict[int, bool], open_: set[int]) -> bool | None:
    """``any(id(p) in traced for p in module.parameters())`` from the module's own parameters and its children's
    answers (``None``: a class that overrides how its parameters or submodules are listed, or a cycle). (A function
    of the module, not a closure: a closure that calls itself is a reference cycle.)"""
    key = id(module)
    if key in memo:
        return memo[key]
    kind = type(module)
    if key in open_ or any(getattr(kind, n) is not getattr(nn.Module, n) for n in _LISTING):
        return None
    if any(p is not None and id(p) in traced for p in module._parameters.values()):
        memo[key] = True
        return True
    open_.add(key)
    found = False
    for child in module._modules.values():
        if child is None:
            continue
        answer = _holds(child, traced, memo, open_)
        if answer is None:
            return None
        if answer:
            found = True
            break
    open_.discard(key)
    memo[key] = found
    return found


#: The ``nn.Module`` methods through which ``module.parameters()`` lists a subtree's parameters.
_LISTING = ("parameters", "named_parameters", "_named_members", "named_modules", "modules")


def _signature(run: ProbeRun, relevant: Callable[[nn.Module], bool]) -> list[tuple[tuple[int, int], int]]:
    """``((module, ordinal), index)`` of the run's calls of relevant modules, in order. Routed calls (rows chosen by
    the data's values, :mod:`.routing`) are left out: they get no layout, and which of them run (the experts a
    token picks) may differ between the runs."""
    return [((id(c.module), c.ordinal), c.index) for c in run.calls if relevant(c.module) and c.index not in run.routed]


def _control_flow_message(sig_one, sig_two, one: ProbeRun, two: ProbeRun, names: dict[int, str]) -> str:
    """Which module's calls differ between the runs on one example and on two."""
    k = next(
        (k for k, (a, b) in enumerate(zip(sig_one, sig_two, strict=False)) if a[0] != b[0]),
        min(len(sig_one), len(sig_two)),
    )
    differing = [one.calls[sig_one[k][1]].module] if k < len(sig_one) else []
    differing += [two.calls[sig_two[k][1]].module] if k < len(sig_two) else []
    shown = ", ".join(f"`{names.get(id(m), '?')}` ({type(m).__name__})" for m in differing)
    return (
        f"The model calls its modules with trainable parameters differently for one example and for two (first at "
        f"{shown}; data-dependent control flow, e.g. an MoE that runs one expert module per expert hit): hf_dp cannot "
        "match the calls to prove where the examples are. For MoE models use the fused experts "
        '(`experts_implementation="grouped_mm"` or `"batched_mm"`, one module for all experts), or freeze those '
        "modules' parameters."
    )


def needs_third_run(one: ProbeRun, two: ProbeRun) -> bool:
    """Whether some leaf is a tensor in one run only (see :class:`_Layouts`)."""
    for c1, c2 in zip(one.calls, two.calls, strict=False):
        for x, y in zip(c1.in_leaves + c1.out_leaves, c2.in_leaves + c2.out_leaves, strict=False):
            if isinstance(x, Tensor) != isinstance(y, Tensor):
                return True
    return False


def is_float(x) -> bool:
    return isinstance(x, Tensor) and (x.is_floating_point() or x.is_complex())


def closed_form_layout(rule: LayerRule, call: CallRecord, layouts: Layouts) -> Layout | None:
    """The output layout if ``rule`` can read this call, else ``None`` (once per call of the first run and kind of
    rule: it depends on nothing else)."""
    i, kind = call.index, rule.layout
    memo = layouts.closed_form_memo
    if (i, kind) in memo and call is layouts.one.calls[i]:
        return memo[(i, kind)]
    layout = _closed_form_layout(kind, call, layouts)
    if call is layouts.one.calls[i]:
        memo[(i, kind)] = layout
    return layout


def _closed_form_layout(kind: str, call: CallRecord, layouts: Layouts) -> Layout | None:
    ins, outs = layouts.lists(call.index)
    if not isinstance(call.output, Tensor) or len(outs) != 1 or not isinstance(outs[0], Layout):
        return None
    out = outs[0]
    if kind == "output":
        return out if out.dim == 0 and not out.broadcast else None
    if not call.args or not isinstance(call.args[0], Tensor):
        return None
    if ins[0] != out:  # args[0] is the first input leaf
        return None
    if kind == "leading" and (out.dim != 0 or out.broadcast):
        return None
    return out


def _is_state(x) -> bool:
    """A stateful input the forward mutates (a transformers key/value cache): a re-run must not see it."""
    return Cache is not None and isinstance(x, Cache)


def _runs_without_state(call: CallRecord, drop: tuple[int, ...]) -> bool:
    """Whether the call gives the same output with its caches left out (no past entries when it ran)."""
    from torch.utils._pytree import tree_flatten as flatten
    from torch.utils._pytree import tree_unflatten as unflatten

    leaves, spec = flatten((tuple(call.args), dict(call.kwargs)))
    leaves = [None if i in drop else x for i, x in enumerate(leaves)]
    args, kwargs = unflatten(leaves, spec)
    try:
        with torch.no_grad(), autocast_like(call.autocast):
            out = call.module(*args, **kwargs)
    except Exception:  # noqa: BLE001  (the module needs its cache: not re-runnable)
        return False

    again = flatten_output(out)
    if len(again) != len(call.out_leaves):
        return False
    for x, y in zip(again, call.out_leaves, strict=True):
        if isinstance(y, Tensor) and (not isinstance(x, Tensor) or not same_values(x, y)):
            return False
    return True


def reruns_alone(call: CallRecord) -> bool:
    """Whether the call, re-run on its own inputs outside the call that made it, gives the output it gave there (in
    eval mode, as the probe ran)."""
    leaves = [x for x in call.in_leaves if _is_state(x)]
    if leaves:
        return False
    try:
        with torch.no_grad(), autocast_like(call.autocast), eval_mode(call.module):
            again = flatten_output(call.module(*call.args, **call.kwargs))
    except Exception:  # noqa: BLE001  (it cannot run alone)
        return False
    if len(again) != len(call.out_leaves):
        return False
    return all(
        not isinstance(y, Tensor) or (isinstance(x, Tensor) and same_values(x, y))
        for x, y in zip(again, call.out_leaves, strict=True)
    )


def fallback_layout(call: CallRecord, layouts: Layouts) -> CallLayout | None:
    """The layouts if the fallback can re-run this call per example, else ``None``."""
    memo = layouts.fallback_memo
    if call.index not in memo:
        memo[call.index] = _fallback_layout(call, layouts)
    return memo[call.index]


def _fallback_layout(call: CallRecord, layouts: Layouts) -> CallLayout | None:
    inputs = layouts.inputs[call.index]
    if any(x is MIXED for x in inputs):
        return None
    outputs = []
    for leaf, layout in zip(call.out_leaves, layouts.outputs[call.index], strict=False):
        if not is_float(leaf):
            outputs.append(None)
        elif not isinstance(layout, Layout):
            return None
        else:
            outputs.append(layout)
    if not any(isinstance(x, Layout) for x in outputs):
        return None
    inputs = [x if isinstance(x, Layout) and not x.broadcast else None for x in inputs]
    expand = tuple(j for j, x in enumerate(outputs) if x is not None and x.broadcast)
    drop = tuple(i for i, x in enumerate(call.in_leaves) if _is_state(x))
    if drop and not _runs_without_state(call, drop):
        return None
    return CallLayout(outputs=outputs, inputs=inputs, expand=expand, drop=drop)
