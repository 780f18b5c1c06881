"""The probe: run the model on sub-batches of 1 and 2 examples and record every module call.

From the two runs (examples ``[0]`` and ``[1, 0]`` of the real batch; ``[0, 0]`` for a batch of one), in eval mode
without gradients, the planner reads for every tensor that enters or leaves a module which dimension scales with the
number of examples and whether the rows of example 0 are the same in both runs: that proves where the examples lie
(a batch dimension, ``k`` contiguous rows per example, a broadcast ``[1, ...]`` tensor, or a tensor shared by every
example) instead of guessing it from a size (DESIGN §4.13). The first run also records which module call every
trainable parameter is used in (a :class:`~torch.overrides.TorchFunctionMode` sees every torch function that takes
it), which is what coverage is checked against (DESIGN §4.12).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ..layers import Layout
from ..layers.base import autocast_state
from .batch import LEAF_TYPES
from .probe_modes import eval_mode, frozen_rng, probe_mode
from .routing import RowTracker

__all__ = [
    "MIXED",
    "CallRecord",
    "ProbeRun",
    "Prober",
    "UseRecorder",
    "eval_mode",
    "frozen_rng",
    "probe_mode",
    "infer_layout",
    "run_expanded",
    "run_probe",
    "same_values",
    "tolerance",
]

#: A tensor whose sub-batch values do not match (examples mixed, or rows not contiguous): nothing proven.
MIXED = "mixed"

#: Torch functions that read a parameter without using its value differentiably.
_NOT_USES = {
    torch.Tensor.detach,
    torch.detach,
    torch.Tensor.detach_,
    torch.Tensor.requires_grad_,
    torch.Tensor.data.__get__,
    torch.Tensor.grad.__get__,
    torch.Tensor.__deepcopy__,
    torch.Tensor.__reduce_ex__,
}


def tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance for comparing two computations of the same values in ``dtype``."""
    if dtype == torch.float64:
        return 1e-6
    if dtype == torch.float32:
        return 1e-3
    return 5e-2


_SEQUENCES = (list, tuple)


def _params_in(args: tuple, kwargs: dict, params: dict[int, nn.Parameter]) -> list[nn.Parameter]:
    """The ``params`` among the arguments of a torch function (top level, and inside a top-level list or tuple)."""
    found = []
    get = params.get
    for x in (*args, *kwargs.values()) if kwargs else args:
        p = get(id(x))
        if p is not None:
            if p is x:
                found.append(p)
        elif isinstance(x, _SEQUENCES):
            for y in x:
                q = get(id(y))
                if q is not None and q is y:
                    found.append(q)
    return found


def _differentiable(out) -> bool:
    if isinstance(out, Tensor):
        return out.is_floating_point() or out.is_complex()
    if isinstance(out, list | tuple):
        return any(_differentiable(o) for o in out)
    return False


class UseRecorder(TorchFunctionMode):
    """Calls ``on_use(param, func)`` for every torch function that takes a trainable parameter and returns a
    floating-point tensor (a use whose gradient flows), optionally only while gradients are enabled; and
    ``observer(func, args, kwargs, out)``, if given, for every torch function."""

    def __init__(
        self,
        params: dict[int, nn.Parameter],
        on_use: Callable[[nn.Parameter, Any], None],
        *,
        grad_mode_only: bool = False,
        observer: Callable[[Any, tuple, dict | None, Any], None] | None = None,
    ) -> None:
        super().__init__()
        self.params = params
        self.on_use = on_use
        self.grad_mode_only = grad_mode_only
        self.observer = observer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if self.observer is not None:
            self.observer(func, args, kwargs, out)
        if func in _NOT_USES or not self.params:  # no params: none found
            return out
        found = _params_in(args, kwargs, self.params)
        if found and (not self.grad_mode_only or torch.is_grad_enabled()) and _differentiable(out):
            for p in found:
                self.on_use(p, func)
        return out


def _is_packed(x) -> bool:
    return isinstance(x, PackedSequence)


def _leaves(x, out: list) -> None:
    """Append the leaves of ``x`` in ``tree_flatten`` order (``PackedSequence`` a leaf): plain tuples, lists and
    dicts are walked here, every other type is handed to ``tree_leaves`` (same leaves, same order)."""
    kind = type(x)
    if kind in LEAF_TYPES:
        out.append(x)
    elif kind is tuple or kind is list:
        for y in x:
            _leaves(y, out)
    elif kind is dict:
        for y in x.values():
            _leaves(y, out)
    else:
        out.extend(tree_leaves(x, is_leaf=_is_packed))


def flatten_call(args: tuple, kwargs: dict) -> list:
    """The leaves of a call's ``(args, kwargs)``, as ``tree_flatten((tuple(args), dict(kwargs)))`` lists them."""
    if LEAF_TYPES.issuperset(map(type, args)):  # every argument a leaf (the common call)
        leaves = list(args)
    else:
        leaves = []
        for x in args:
            _leaves(x, leaves)
    if kwargs:
        values = kwargs.values()
        if LEAF_TYPES.issuperset(map(type, values)):
            leaves += values
        else:
            for x in values:
                _leaves(x, leaves)
    return leaves


def flatten_output(output) -> list:
    """The leaves of a call's output, as ``tree_flatten(output)`` lists them."""
    if type(output) in LEAF_TYPES:
        return [output]
    leaves: list = []
    _leaves(output, leaves)
    return leaves


@dataclass(eq=False, slots=True)
class CallRecord:
    """One call of one module in a probe run (references to its inputs and outputs)."""

    index: int
    module: nn.Module
    parent: int | None
    ordinal: int  # earlier calls of the same module in this run
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: Any = None
    in_leaves: list = field(default_factory=list)
    out_leaves: list = field(default_factory=list)
    autocast: tuple = ()  # the autocast state the call ran under


@dataclass
class ProbeRun:
    """All module calls of one run, and the calls in which each trainable parameter was used."""

    calls: list[CallRecord]
    uses: dict[nn.Parameter, list[int]]
    output: Any
    traced: frozenset[int] = frozenset()  # ids of the parameters whose uses were recorded
    routed: frozenset[int] = frozenset()  # calls whose rows the data's values chose (:mod:`.routing`), if tracked


class Prober:
    """Probe runs of one model (:func:`run_probe`), with the hooks that record them registered once for all of them
    (a pre-hook appended and a post-hook prepended on every module, as for a single run).

    Use as a context manager, inside :func:`eval_mode` (the runs are in eval mode, and the model stays there across
    them); :meth:`run` records one run. Between runs the hooks stand aside."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.handles: list = []
        self._calls: list[CallRecord] | None = None  # the run in progress
        self._stack: list[int] = []
        self._counts: dict[int, int] = {}
        self._uses: dict[nn.Parameter, list[int]] = {}
        self._output_hook: Callable[[CallRecord, Any], Any] | None = None
        self._rows: RowTracker | None = None
        self._routing = False  # an earlier run found routed calls: the later runs track rows too

    def __enter__(self) -> Prober:
        handles, pre, post = self.handles, self._pre, self._post
        for module in self.model.modules():
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True, prepend=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _pre(self, module, args, kwargs):
        calls = self._calls
        if calls is None:
            return
        counts, key = self._counts, id(module)
        ordinal = counts.get(key, 0)
        counts[key] = ordinal + 1
        stack = self._stack
        index, parent, in_leaves = len(calls), stack[-1] if stack else None, flatten_call(args, kwargs)
        record = CallRecord(
            index, module, parent, ordinal, tuple(args), dict(kwargs), None, in_leaves, [], autocast_state()
        )
        calls.append(record)
        stack.append(index)
        if self._rows is not None:
            self._rows.enter(index, parent, in_leaves)

    def _post(self, module, args, kwargs, output):
        calls, stack = self._calls, self._stack
        if calls is None or not stack or calls[stack[-1]].module is not module:
            return None
        record = calls[stack.pop()]
        if self._output_hook is not None:
            replaced = self._output_hook(record, output)
            if replaced is not None:
                output = replaced
        record.output = output
        record.out_leaves = flatten_output(output)
        if self._rows is not None:
            self._rows.leave(record.index, record.out_leaves)
        return output

    def _on_use(self, p: nn.Parameter, func) -> None:
        stack = self._stack
        if stack:
            where = self._uses.setdefault(p, [])
            if not where or where[-1] != stack[-1]:
                where.append(stack[-1])

    def run(
        self,
        args: tuple,
        kwargs: dict,
        params: dict[int, nn.Parameter],
        *,
        uses: bool = True,
        output_hook: Callable[[CallRecord, Any], Any] | None = None,
        rows: bool | None = None,
    ) -> ProbeRun:
        """One run of ``model(*args, **kwargs)`` without gradients, recording every module call, (``uses``) every
        use of the ``params`` by the innermost module call in progress, and (``rows``; by default with ``uses``, or
        when an earlier run found some) the calls whose rows the data's values chose (:class:`~.routing.RowTracker`:
        left out when the runs' calls are matched, since which experts run may differ)."""
        if self._calls is not None:
            raise RuntimeError("a probe run is already in progress")
        calls: list[CallRecord] = []
        self._calls, self._stack, self._counts, self._uses = calls, [], {}, {}
        self._output_hook = output_hook
        recorded = self._uses
        track = (uses or self._routing) if rows is None else rows
        tracker = self._rows = RowTracker.for_model(self.model) if track else None
        observer = None if tracker is None else tracker.observe
        try:
            recorder = UseRecorder(params if uses else {}, self._on_use, observer=observer)
            with torch.no_grad(), recorder if uses or tracker else contextlib.nullcontext():
                output = self.model(*args, **kwargs)
        finally:
            self._calls, self._stack, self._counts, self._uses, self._output_hook = None, [], {}, {}, None
            self._rows = None
        routed = frozenset(tracker.routed_calls) if tracker is not None else frozenset()
        self._routing = self._routing or bool(routed)
        return ProbeRun(calls, recorded, output, frozenset(params) if uses else frozenset(), routed)


def run_probe(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    params: dict[int, nn.Parameter],
    *,
    uses: bool = True,
    output_hook: Callable[[CallRecord, Any], Any] | None = None,
    training_like: bool = False,
) -> ProbeRun:
    """Run ``model(*args, **kwargs)`` in eval mode (or :func:`probe_mode`'s training-like mode) without gradients,
    recording every module call and (``uses``) every use of the ``params`` (by the innermost module call in
    progress). ``output_hook(record, output)`` may replace a call's output. Several runs on one model:
    :class:`Prober`."""
    with probe_mode(model, training_like), Prober(model) as prober:
        return prober.run(args, kwargs, params, uses=uses, output_hook=output_hook)


def run_expanded(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    modules: list[nn.Module],
    output_hook: Callable[[CallRecord, Any], Any],
    *,
    in_eval_mode: bool = False,
    with_grad: bool = False,
) -> Any:
    """The output of ``model(*args, **kwargs)`` in eval mode without gradients (``with_grad``: with them), each call
    of ``modules`` passed through ``output_hook(record, output)`` (a record with the call's module and ordinal only;
    ``None``: keep the output), as :func:`run_probe` would pass it, without recording anything else.
    ``in_eval_mode``: the caller already holds the model in :func:`eval_mode`."""
    counts: dict[int, int] = {}
    stack: list[tuple[nn.Module, int]] = []

    def pre(module, args):
        ordinal = counts.get(id(module), 0)
        counts[id(module)] = ordinal + 1
        stack.append((module, ordinal))

    def post(module, args, output):
        if not stack or stack[-1][0] is not module:
            return None
        _, ordinal = stack.pop()
        replaced = output_hook(CallRecord(0, module, None, ordinal), output)
        return output if replaced is None else replaced

    handles = []
    seen: set[int] = set()
    for module in modules:
        if id(module) not in seen:
            seen.add(id(module))
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post, always_call=True, prepend=True))
    try:
        with contextlib.nullcontext() if in_eval_mode else eval_mode(model), torch.set_grad_enabled(with_grad):
            return model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()


def infer_layout(one, two, sizes: tuple[int, int] = (1, 2)):
    """The layout proven by the same tensor in two runs whose last example is example 0.

    ``one`` and ``two`` come from runs on ``sizes`` examples (by default ``[0]`` and ``[1, 0]``). Returns a
    :class:`Layout` (batched, or ``broadcast`` for a ``[1, ...]`` tensor equal in both runs), ``None`` for a
    non-tensor or a tensor equal in both runs (shared by every example), or :data:`MIXED`.
    """
    if not isinstance(one, Tensor) or not isinstance(two, Tensor):
        return None if type(one) is type(two) else MIXED
    a, b = sizes
    s1, s2 = tuple(one.shape), tuple(two.shape)
    if len(s1) == len(s2):
        for d in range(len(s1)):
            if s1[d] == 0 or s1[d] % a or s2[d] * a != s1[d] * b:
                continue
            if any(s1[j] != s2[j] for j in range(len(s1)) if j != d):
                continue
            k = s1[d] // a
            # example 0 is the last block of rows in both runs
            mine = one if a == 1 else one.narrow(d, (a - 1) * k, k)  # (all of `one` for a run on one example)
            return Layout(d) if same_values(two.narrow(d, (b - 1) * k, k), mine) else MIXED
    if s1 == s2:
        if not same_values(one, two):
            return MIXED
        return Layout(0, broadcast=True) if one.dim() > 0 and s1[0] == 1 else None
    return MIXED


def same_values(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` hold the same values: exactly for integers, within :func:`tolerance` of their dtype (relative
    to the largest magnitude) for floats, with infinities and NaNs in the same places."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    # a forward hook may make a probe output require grad (enable_input_require_grads)
    a, b = (a.detach() if a.requires_grad else a), (b.detach() if b.requires_grad else b)
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    if a.numel() == 0 or torch.equal(a, b):  # equal (no NaN): within any tolerance
        return True
    if a.is_floating_point():
        # every entry finite in both (else some difference is inf or NaN, and the general comparison decides):
        # the largest difference against the largest magnitude, as below with every entry finite
        x, y = a.double(), b.double()
        diff, scale = torch.stack([(x - y).abs().max(), y.abs().max()]).tolist()
        if math.isfinite(diff):
            return diff <= tolerance(a.dtype) * max(scale, 1e-30)
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    inf_a, inf_b = torch.isinf(a), torch.isinf(b)
    if not torch.equal(inf_a, inf_b) or not torch.equal(a[inf_a], b[inf_b]):
        return False
    finite = ~(nan_b | inf_b)
    x, y = a[finite].double(), b[finite].double()
    if x.numel() == 0:
        return True
    scale = float(y.abs().max())
    return float((x - y).abs().max()) <= tolerance(a.dtype) * max(scale, 1e-30)
