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
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..layers import Layout
from ..layers.base import autocast_state

__all__ = [
    "MIXED",
    "CallRecord",
    "ProbeRun",
    "UseRecorder",
    "eval_mode",
    "frozen_rng",
    "infer_layout",
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


def _params_in(args: tuple, kwargs: dict, params: dict[int, nn.Parameter]) -> Iterator[nn.Parameter]:
    for x in itertools.chain(args, kwargs.values()):
        if isinstance(x, list | tuple):
            for y in x:
                if id(y) in params and params[id(y)] is y:
                    yield y
        elif id(x) in params and params[id(x)] is x:
            yield x


def _differentiable(out) -> bool:
    if isinstance(out, Tensor):
        return out.is_floating_point() or out.is_complex()
    if isinstance(out, list | tuple):
        return any(_differentiable(o) for o in out)
    return False


class UseRecorder(TorchFunctionMode):
    """Calls ``on_use(param, func)`` for every torch function that takes a trainable parameter and returns a
    floating-point tensor (a use whose gradient flows), optionally only while gradients are enabled."""

    def __init__(
        self,
        params: dict[int, nn.Parameter],
        on_use: Callable[[nn.Parameter, Any], None],
        *,
        grad_mode_only: bool = False,
    ) -> None:
        super().__init__()
        self.params = params
        self.on_use = on_use
        self.grad_mode_only = grad_mode_only

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _NOT_USES and (not self.grad_mode_only or torch.is_grad_enabled()):
            found = list(_params_in(args, kwargs, self.params))
            if found and _differentiable(out):
                for p in found:
                    self.on_use(p, func)
        return out


def flatten_call(args: tuple, kwargs: dict) -> list:
    leaves, _ = tree_flatten((tuple(args), dict(kwargs)), is_leaf=lambda x: isinstance(x, PackedSequence))
    return leaves


def flatten_output(output) -> list:
    leaves, _ = tree_flatten(output, is_leaf=lambda x: isinstance(x, PackedSequence))
    return leaves


@dataclass(eq=False)
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


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Every submodule in eval mode (dropout off), each one's own flag restored afterwards."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in flags:
            m.training = flag


@contextlib.contextmanager
def frozen_rng(devices: list[torch.device]):
    """Run code that may draw random numbers without changing what training draws afterwards."""
    cpu = torch.get_rng_state()
    cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda"]
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        for d, state in cuda:
            torch.cuda.set_rng_state(state, d)


def run_probe(
    model: nn.Module,
    args: tuple,
    kwargs: dict,
    params: dict[int, nn.Parameter],
    *,
    output_hook: Callable[[CallRecord, Any], Any] | None = None,
) -> ProbeRun:
    """Run ``model(*args, **kwargs)`` in eval mode without gradients, recording every module call and every use of
    the ``params`` (by the innermost module call in progress). ``output_hook(record, output)`` may replace a call's
    output (the planner uses it to try the broadcast expansions)."""
    calls: list[CallRecord] = []
    stack: list[int] = []
    counts: dict[int, int] = {}
    uses: dict[nn.Parameter, list[int]] = {}

    def pre(module, args, kwargs):
        ordinal = counts.get(id(module), 0)
        counts[id(module)] = ordinal + 1
        record = CallRecord(len(calls), module, stack[-1] if stack else None, ordinal, tuple(args), dict(kwargs))
        record.in_leaves = flatten_call(args, kwargs)
        record.autocast = autocast_state()
        calls.append(record)
        stack.append(record.index)

    def post(module, args, kwargs, output):
        if not stack or calls[stack[-1]].module is not module:
            return None
        record = calls[stack.pop()]
        if output_hook is not None:
            replaced = output_hook(record, output)
            if replaced is not None:
                output = replaced
        record.output = output
        record.out_leaves = flatten_output(output)
        return output

    def on_use(p: nn.Parameter, func) -> None:
        if stack:
            where = uses.setdefault(p, [])
            if not where or where[-1] != stack[-1]:
                where.append(stack[-1])

    handles = []
    seen: set[int] = set()
    for module in model.modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True, prepend=True))
    try:
        with eval_mode(model), torch.no_grad(), UseRecorder(params, on_use):
            output = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return ProbeRun(calls, uses, output, frozenset(params))


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
            return Layout(d) if same_values(two.narrow(d, (b - 1) * k, k), one.narrow(d, (a - 1) * k, k)) else MIXED
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
    a, b = a.detach(), b.detach()  # a forward hook may make a probe output require grad (enable_input_require_grads)
    if not (a.is_floating_point() or a.is_complex()):
        return bool(torch.equal(a, b))
    if a.numel() == 0:
        return True
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
