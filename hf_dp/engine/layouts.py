"""Layouts of every tensor of every module call, read off the probe runs, and what a rule can make of them.

A closed-form rule can read a call whose output (and, for position-wise and leading-dimension rules, first input)
has a proven :class:`~hf_dp.layers.Layout`; the fallback can re-run a call whose inputs are batched or shared and
whose floating-point outputs are batched or broadcast (caches proven empty are left out of the re-run).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    leaf, which outputs to expand from ``[1, ...]`` to the batch, and which inputs (key/value caches, proven empty
    for this call) the fallback's re-run leaves out.

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


def leaf_shapes(leaves: list) -> list:
    """The shape of every tensor leaf (``None`` for the others)."""
    return [tuple(x.shape) if isinstance(x, Tensor) else None for x in leaves]


def _leaf_fits(x, ref: tuple | None, layout, batch_size: int) -> bool:
    if ref is None or not isinstance(x, Tensor):
        return ref is None and not isinstance(x, Tensor)
    if x.dim() != len(ref):
        return False
    if isinstance(layout, Layout):
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
    """

    def __init__(
        self, one: ProbeRun, two: ProbeRun, three: ProbeRun | None = None, names: dict[int, str] | None = None
    ) -> None:
        relevant = _relevance(one)
        sig_one, sig_two = _signature(one, relevant), _signature(two, relevant)
        if [key for key, _ in sig_one] != [key for key, _ in sig_two]:
            raise UnsupportedModuleError(_control_flow_message(sig_one, sig_two, one, two, names or {}))
        if three is not None and [k for k, _ in _signature(three, relevant)] != [k for k, _ in sig_two]:
            three = None
        sig_three = _signature(three, relevant) if three is not None else None
        self.partner: list[int | None] = [None] * len(one.calls)
        self.inputs: list[list] = [[MIXED] * max(len(c.in_leaves), 1) for c in one.calls]
        self.outputs: list[list] = [[MIXED] * max(len(c.out_leaves), 1) for c in one.calls]
        self.fallback_memo: dict[int, CallLayout | None] = {}
        for k, ((_, i), (_, j)) in enumerate(zip(sig_one, sig_two, strict=True)):
            c1, c2 = one.calls[i], two.calls[j]
            c3 = three.calls[sig_three[k][1]] if sig_three is not None else None
            self.partner[i] = j
            self.inputs[i] = _pairwise(c1.in_leaves, c2.in_leaves, c3.in_leaves if c3 else None)
            self.outputs[i] = _pairwise(c1.out_leaves, c2.out_leaves, c3.out_leaves if c3 else None)


def _relevance(run: ProbeRun) -> Callable[[nn.Module], bool]:
    """Whether a module holds a parameter the probe traced (anywhere in its subtree)."""
    traced = set(run.traced) | {id(p) for p in run.uses}
    memo: dict[int, bool] = {}

    def relevant(module: nn.Module) -> bool:
        key = id(module)
        if key not in memo:
            memo[key] = any(id(p) in traced for p in module.parameters())
        return memo[key]

    return relevant


def _signature(run: ProbeRun, relevant: Callable[[nn.Module], bool]) -> list[tuple[tuple[int, int], int]]:
    """``((module, ordinal), index)`` of the run's calls of relevant modules, in order."""
    return [((id(c.module), c.ordinal), c.index) for c in run.calls if relevant(c.module)]


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


def _pairwise(one: list, two: list, three: list | None) -> list:
    if len(one) != len(two):
        return [MIXED] * max(len(one), len(two), 1)
    out = []
    for j, (a, b) in enumerate(zip(one, two, strict=True)):
        layout = infer_layout(a, b)
        if (
            layout is MIXED
            and three is not None
            and len(three) == len(two)
            and isinstance(a, Tensor) != isinstance(b, Tensor)
        ):
            layout = infer_layout(b, three[j], sizes=(2, 3))
        out.append(layout)
    return out


def is_float(x) -> bool:
    return isinstance(x, Tensor) and (x.is_floating_point() or x.is_complex())


def closed_form_layout(rule: LayerRule, call: CallRecord, layouts: Layouts) -> Layout | None:
    """The output layout if ``rule`` can read this call, else ``None``."""
    outs = layouts.outputs[call.index]
    if not isinstance(call.output, Tensor) or len(outs) != 1 or not isinstance(outs[0], Layout):
        return None
    out = outs[0]
    if rule.layout == "output":
        return out if out.dim == 0 and not out.broadcast else None
    if not call.args or not isinstance(call.args[0], Tensor):
        return None
    if layouts.inputs[call.index][0] != out:  # args[0] is the first input leaf
        return None
    if rule.layout == "leading" and (out.dim != 0 or out.broadcast):
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
