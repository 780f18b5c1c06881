"""The plan: from two probe runs, which module covers each use of each trainable parameter, and how to read it.

Steps (each is exact or raises; see DESIGN §4.12, §4.13):

1. **Layouts.** Every tensor entering or leaving a module call gets a :class:`~hf_dp.layers.Layout` from the runs on
   one and two examples (:func:`~.probe.infer_layout`), or is shared by every example, or is unprovable.
2. **Rules.** A rule registered for the module's exact type is checked against autograd on the one-example run; a
   mismatch raises :class:`~.self_check.SelfCheckError`. A guessed rule (a predicate such as a class name, a
   registered base class) is checked the same way and replaced by the fallback when it disagrees; a subclass whose
   ``forward`` differs from its base's is first tried as the base's output times a measured constant
   (:class:`~hf_dp.layers.ScaledRule`).
3. **Coverage.** For each use of each parameter (the innermost module call it happened in), the innermost module on
   the call path that can account for it: the parameter's owner if its rule applies to that call's layout, else the
   smallest enclosing module whose own inputs and outputs carry the examples, through the fallback (a position
   table indexed by ``[q, k]`` ids is covered by the attention module that adds it to the batch's scores; a weight
   read by a parent's functional call, by that parent). A fallback covers every use of its parameters inside its
   forward, so inside it no other module counts them.
4. **Broadcasts.** Outputs proven to be ``[1, ...]`` and shared (HF position embeddings of ``[1, T]`` ids) are
   expanded to the batch, so that their gradient is per example; a third run checks that the model's output is
   unchanged by the expansion.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..layers import FALLBACK_RULE, LayerRule, Layout, ScaledRule, UnsupportedModuleError
from ..layers.base import autocast_like
from ..layers.grads import compute_dtype, instantiate, norm_sq
from .coverage import HookedModule
from .probe import MIXED, CallRecord, ProbeRun, infer_layout, same_values, tolerance
from .rows import closed_form_grads
from .self_check import SelfCheckError

try:
    from transformers.cache_utils import Cache
except ImportError:  # transformers is a dependency; keep the engine importable without it
    Cache = None

logger = logging.getLogger(__name__)

__all__ = ["CallLayout", "Plan", "build_plan", "describe_layout", "needs_third_run"]


@dataclass
class CallLayout:
    """How the engine reads one call of a hooked module: the layout of each output (and, for the fallback, input)
    leaf, which outputs to expand from ``[1, ...]`` to the batch, and which inputs (key/value caches, proven empty
    for this call) the fallback's re-run leaves out."""

    outputs: list
    inputs: list | None = None
    expand: tuple[int, ...] = ()
    drop: tuple[int, ...] = ()


@dataclass
class Plan:
    """The hooked modules and the layout of each of their calls, keyed by ``(id(entry), ordinal)``.

    ``shadowing`` maps a fallback entry to the parameters for which it shadows the modules called inside it;
    ``shadowed`` maps an entry to the parameters it must skip while such a fallback is running.
    """

    hooked: list[HookedModule]
    calls: dict[tuple[int, int], CallLayout]
    shadowing: dict[int, set[nn.Parameter]] = field(default_factory=dict)
    shadowed: dict[int, set[nn.Parameter]] = field(default_factory=dict)
    repeats: tuple[int, ...] = (1,)  # rows per example seen along dimension 0: how far a broadcast may expand


def describe_layout(layout) -> str:
    if layout is MIXED:
        return "its rows for one example differ between sub-batches (examples are mixed, or not contiguous)"
    if layout is None:
        return "it is the same for every example (no dimension carries the examples)"
    if layout.broadcast:
        return "it has size 1 along dimension 0 and is shared by every example"
    return f"the examples lie along dimension {layout.dim}"


class _Layouts:
    """Layouts of every leaf of every call, from the runs on examples ``[0]`` and ``[1, 0]``.

    A leaf that is a tensor in one run and not in the other (an attention mask built only when some example is
    padded) is read from the runs on ``[1, 0]`` and ``[1, 1, 0]`` instead, when a third run is given.
    """

    def __init__(self, one: ProbeRun, two: ProbeRun, three: ProbeRun | None = None) -> None:
        if _signature(one) != _signature(two):
            raise UnsupportedModuleError(
                "The model calls different modules for one example and for two (data-dependent control flow), so "
                "hf_dp cannot match the calls to prove where the examples are."
            )
        if three is not None and _signature(three) != _signature(two):
            three = None
        self.inputs: list[list] = []
        self.outputs: list[list] = []
        self.fallback_memo: dict[int, CallLayout | None] = {}
        for i, (c1, c2) in enumerate(zip(one.calls, two.calls, strict=True)):
            c3 = three.calls[i] if three is not None else None
            self.inputs.append(_pairwise(c1.in_leaves, c2.in_leaves, c3.in_leaves if c3 else None))
            self.outputs.append(_pairwise(c1.out_leaves, c2.out_leaves, c3.out_leaves if c3 else None))


def _signature(run: ProbeRun) -> list[tuple[int, int]]:
    return [(id(c.module), c.ordinal) for c in run.calls]


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


def _is_float(x) -> bool:
    return isinstance(x, Tensor) and (x.is_floating_point() or x.is_complex())


def closed_form_layout(rule: LayerRule, call: CallRecord, layouts: _Layouts) -> Layout | None:
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
    from .probe import flatten_output

    again = flatten_output(out)
    if len(again) != len(call.out_leaves):
        return False
    for x, y in zip(again, call.out_leaves, strict=True):
        if isinstance(y, Tensor) and (not isinstance(x, Tensor) or not same_values(x, y)):
            return False
    return True


def fallback_layout(call: CallRecord, layouts: _Layouts) -> CallLayout | None:
    """The layouts if the fallback can re-run this call per example, else ``None``."""
    memo = layouts.fallback_memo
    if call.index not in memo:
        memo[call.index] = _fallback_layout(call, layouts)
    return memo[call.index]


def _fallback_layout(call: CallRecord, layouts: _Layouts) -> CallLayout | None:
    inputs = layouts.inputs[call.index]
    if any(x is MIXED for x in inputs):
        return None
    outputs = []
    for leaf, layout in zip(call.out_leaves, layouts.outputs[call.index], strict=False):
        if not _is_float(leaf):
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


def _random_like(t: Tensor, seed: int) -> Tensor:
    g = torch.Generator(device=t.device).manual_seed(seed)
    return torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).to(t.dtype)


def rule_disagreement(entry: HookedModule, rule: LayerRule, call: CallRecord, layout: Layout) -> str | None:
    """Compare ``rule`` with autograd on the probe's one-example call; a description of the mismatch, or ``None``.

    The rule's per-example gradient (and its ghost norm) for a random output gradient must match the vector-Jacobian
    product of the module's own forward with respect to each covered parameter.
    """
    module, output = entry.module, call.output
    params = set(entry.params)
    g = _random_like(output, seed=17)
    captured = rule.capture(module, call.args, call.kwargs, output)
    with torch.no_grad():
        grads = closed_form_grads(rule, module, captured, g, layout, 1, params)
    named = {n: p for n, p in module.named_parameters() if p in params}
    with torch.enable_grad(), autocast_like(call.autocast):
        leaves = {n: p.detach().requires_grad_(True) for n, p in named.items()}
        out = torch.func.functional_call(module, leaves, call.args, call.kwargs)
        if not isinstance(out, Tensor) or out.shape != output.shape:
            return f"its forward returned {type(out).__name__} when re-run"
        ref = torch.autograd.grad((out * g).sum(), list(leaves.values()), allow_unused=True)
    ref = {named[n]: (torch.zeros_like(p) if r is None else r) for (n, p), r in zip(leaves.items(), ref, strict=True)}
    scale = float(sum(r.double().pow(2).sum() for r in ref.values()) ** 0.5) or 1.0
    # under autocast the call computes in a lower precision than its parameters: the lowest one sets the tolerance
    computed = [t.dtype for t in (output, *call.args) if isinstance(t, Tensor) and t.is_floating_point()]
    for name, p in named.items():
        tol = max(tolerance(dtype) for dtype in (p.dtype, *computed))
        expected = ref[p].double()
        got = grads.get(p)
        if got is None:
            if float(expected.norm()) > tol * scale:
                return f"it gives no gradient for `{name}`"
            continue
        dense = instantiate(got, compute_dtype(p.dtype)).value[0].double()
        err = float((dense - expected).norm())
        if err > tol * max(float(expected.norm()), 1e-3 * scale):
            return f"its gradient of `{name}` is off by {err / max(float(expected.norm()), 1e-30):.2e} (relative)"
        norm = float(norm_sq(got, torch.float64)[0].sqrt())
        if abs(norm - float(expected.norm())) > tol * max(float(expected.norm()), 1e-3 * scale):
            return f"its per-example norm of `{name}` is {norm:.6g}, autograd's {float(expected.norm()):.6g}"
    return None


def _measure_scale(module: nn.Module, base: type, call: CallRecord) -> float | None:
    """``s`` if the module's output on the probe is ``s`` times its base class's ``forward`` on the same input."""
    try:
        with torch.no_grad(), autocast_like(call.autocast):
            ref = base.forward(module, *call.args, **call.kwargs)
    except Exception:  # noqa: BLE001  (the base class cannot run this call: not a scaled subclass)
        return None
    out = call.output
    if not isinstance(out, Tensor) or not isinstance(ref, Tensor) or out.shape != ref.shape or not _is_float(out):
        return None
    o, r = out.double(), ref.double()
    denom = float((r * r).sum())
    if denom == 0.0:
        return None
    s = float((o * r).sum()) / denom
    if float((o - s * r).norm()) > tolerance(out.dtype) * float(o.norm()):
        return None
    return s


def _forward_differs(module: nn.Module, base: type) -> bool:
    return "forward" in vars(module) or type(module).forward is not base.forward


def _choose_rule(entry: HookedModule, calls: list[CallRecord], layouts: _Layouts) -> LayerRule:
    """The rule to use for ``entry``: its own, a scaled version, or the fallback (guessed rules that disagree)."""
    if entry.is_fallback or not calls:
        return entry.rule
    match = entry.match
    rule = entry.rule
    if match is not None and match.base is not None and _forward_differs(entry.module, match.base):
        scale = _measure_scale(entry.module, match.base, calls[0])
        if scale is None:
            logger.info(
                "hf_dp: `%s` (%s) overrides forward; using the fallback", entry.name, type(entry.module).__name__
            )
            return FALLBACK_RULE
        if abs(scale - 1.0) > 1e-12:
            rule = ScaledRule(rule, scale)
    first = next((c for c in calls if closed_form_layout(rule, c, layouts) is not None), None)
    if first is None:
        return rule  # its uses are covered by an enclosing module (decided per use below)
    problem = rule_disagreement(entry, rule, first, closed_form_layout(rule, first, layouts))
    if problem is None:
        return rule
    if match is not None and match.exact:
        raise SelfCheckError(
            f"The rule {type(rule).__name__} registered for {type(entry.module).__name__} disagrees with autograd on "
            f"module `{entry.name}`: {problem}. Fix the rule, or remove it so that the torch.func fallback is used."
        )
    logger.warning(
        "hf_dp: rule %s does not hold for `%s` (%s): %s; using the torch.func fallback.",
        type(rule).__name__,
        entry.name,
        type(entry.module).__name__,
        problem,
    )
    return FALLBACK_RULE


def build_plan(
    static: list[HookedModule],
    one: ProbeRun,
    two: ProbeRun,
    names: dict[int, str],
    param_names: dict[nn.Parameter, str],
    *,
    allow_fallback: bool,
    three: ProbeRun | None = None,
) -> Plan:
    """The plan for the probed forward pass (steps 1-3 of the module docstring; the caller runs step 4).

    ``one``, ``two``, ``three``: probe runs on examples ``[0]``, ``[1, 0]`` and (optionally) ``[1, 1, 0]``.
    """
    layouts = _Layouts(one, two, three)
    calls_of: dict[int, list[CallRecord]] = {}
    for call in one.calls:
        calls_of.setdefault(id(call.module), []).append(call)

    # 2. rules
    entries: list[HookedModule] = []
    for entry in static:
        rule = _choose_rule(entry, calls_of.get(id(entry.module), []), layouts)
        entries.append(HookedModule(entry.name, entry.module, rule, list(entry.params), entry.match))
    owner: dict[tuple[int, nn.Parameter], HookedModule] = {}
    for entry in entries:
        for p in entry.params:
            owner[(id(entry.module), p)] = entry

    def provable(entry: HookedModule, call: CallRecord) -> bool:
        if entry.is_fallback:
            return fallback_layout(call, layouts) is not None
        return closed_form_layout(entry.rule, call, layouts) is not None

    # 3. coverage
    chosen: dict[nn.Parameter, set[int]] = {}
    promoted: dict[int, HookedModule] = {}
    for p, where in one.uses.items():
        for index in where:
            coverer = None
            call: CallRecord | None = one.calls[index]
            while call is not None:
                entry = owner.get((id(call.module), p))
                # a closed-form rule models its module's own use only; a fallback, every use inside its forward
                if entry is not None and (entry.is_fallback or call.index == index) and provable(entry, call):
                    coverer = entry
                    break
                if (
                    allow_fallback
                    and any(q is p for q in call.module.parameters())
                    and fallback_layout(call, layouts) is not None
                ):
                    coverer = promoted.get(id(call.module))
                    if coverer is None:
                        name = names.get(id(call.module), type(call.module).__name__)
                        coverer = HookedModule(name, call.module, FALLBACK_RULE, [])
                        promoted[id(call.module)] = coverer
                    if not any(q is p for q in coverer.params):
                        coverer.params.append(p)
                    break
                call = one.calls[call.parent] if call.parent is not None else None
            if coverer is None:
                raise _uncovered(p, one.calls[index], owner, layouts, names, param_names, allow_fallback)
            chosen.setdefault(p, set()).add(id(coverer))

    # entries keep the parameters they were chosen for (and those no probe call used)
    final: list[HookedModule] = []
    for entry in entries:
        entry.params = [p for p in entry.params if p not in chosen or id(entry) in chosen[p]]
        extra = promoted.pop(id(entry.module), None)
        if extra is not None and entry.is_fallback:
            own = {id(q) for q in entry.params}
            entry.params += [p for p in extra.params if id(p) not in own]
            entry.promoted = frozenset(extra.params)
            for p in extra.params:
                chosen[p] = (chosen[p] - {id(extra)}) | {id(entry)}
        elif extra is not None:
            final.append(extra)
            extra.promoted = frozenset(extra.params)
        if entry.params:
            final.append(entry)
    for extra in promoted.values():
        extra.promoted = frozenset(extra.params)
        final.append(extra)
    for extra in final:
        if extra.promoted and extra.match is None:
            logger.warning(
                "hf_dp: `%s` (%s) uses %s inside its forward beyond what any rule sees; covering them with the "
                "torch.func fallback on `%s`.",
                extra.name,
                type(extra.module).__name__,
                sorted(param_names.get(p, "?") for p in extra.promoted),
                extra.name,
            )

    rows = set()
    for call in one.calls:
        leaves = call.in_leaves + call.out_leaves
        for leaf, layout in zip(leaves, layouts.inputs[call.index] + layouts.outputs[call.index], strict=False):
            batched = isinstance(layout, Layout) and layout.dim == 0 and not layout.broadcast
            if batched and isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] > 1:
                rows.add(leaf.shape[0])
    plan = Plan(hooked=final, calls={}, repeats=(1, *sorted(rows)))
    for entry in final:
        for call in calls_of.get(id(entry.module), []):
            if entry.is_fallback:
                layout = fallback_layout(call, layouts)
            else:
                out = closed_form_layout(entry.rule, call, layouts)
                layout = None if out is None else CallLayout(outputs=[out], expand=(0,) if out.broadcast else ())
            if layout is not None:
                plan.calls[(id(entry), call.ordinal)] = layout

    # a fallback covers every use of its parameters inside its forward: it shadows the other coverers there
    coverers: dict[nn.Parameter, list[HookedModule]] = {}
    for entry in final:
        for p in entry.params:
            coverers.setdefault(p, []).append(entry)
    for p, group in coverers.items():
        if len(group) > 1 and any(e.is_fallback for e in group):
            for e in group:
                plan.shadowed.setdefault(id(e), set()).add(p)
                if e.is_fallback:
                    plan.shadowing.setdefault(id(e), set()).add(p)
    return plan


def _uncovered(
    p: nn.Parameter,
    call: CallRecord,
    owner: dict,
    layouts: _Layouts,
    names: dict[int, str],
    param_names: dict[nn.Parameter, str],
    allow_fallback: bool,
) -> UnsupportedModuleError:
    where = names.get(id(call.module), type(call.module).__name__)
    entry = owner.get((id(call.module), p))
    if entry is not None and not entry.is_fallback:
        outs = layouts.outputs[call.index]
        why = f"the output of `{where}` cannot be split per example: {describe_layout(outs[0] if outs else None)}"
    elif entry is not None:
        why = f"an input or output of `{where}` cannot be split per example"
    else:
        why = f"`{where}` ({type(call.module).__name__}) uses it in its forward pass, where no rule sees it"
    if not allow_fallback:
        fix = "allow the torch.func fallback (`allow_fallback=True`) or freeze it (`requires_grad_(False)`)"
    else:
        fix = (
            "no enclosing module has inputs and outputs that carry the examples; freeze it (`requires_grad_(False)`) "
            "or use it inside a module that takes and returns batched tensors"
        )
    return UnsupportedModuleError(
        f"Trainable parameter `{param_names.get(p, '?')}` has no exact per-example gradient: {why}. To fix: {fix}."
    )


def expansion_changes_output(reference, expanded) -> bool:
    """Whether the run with broadcast outputs expanded returned something else than the plain run."""
    from .probe import flatten_output

    a, b = flatten_output(reference), flatten_output(expanded)
    if len(a) != len(b):
        return True
    for x, y in zip(a, b, strict=True):
        if isinstance(x, Tensor) != isinstance(y, Tensor):
            return True
        if isinstance(x, Tensor) and not same_values(y, x):
            return True
    return False
