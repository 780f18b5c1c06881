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
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from ..layers import FALLBACK_RULE, LayerRule, Layout, ScaledRule, UnsupportedModuleError
from ..layers.base import autocast_like
from ..layers.grads import compute_dtype, instantiate, norm_sq
from .coverage import HookedModule
from .layouts import (
    CallLayout,
    Layouts,
    closed_form_layout,
    describe_layout,
    fallback_layout,
    fits,
    is_float,
    leaf_shapes,
    needs_third_run,
    reruns_alone,
)
from .probe import CallRecord, ProbeRun, same_values, tolerance
from .rows import closed_form_grads
from .self_check import SelfCheckError

logger = logging.getLogger(__name__)

__all__ = ["CallLayout", "Plan", "build_plan", "expansion_changes_output", "fits", "needs_third_run"]


@dataclass
class Plan:
    """The hooked modules and the layouts of each of their calls, keyed by ``(id(entry), ordinal)``: one per
    structure the call was seen with (:func:`~.layouts.fits` picks the one a call has).

    ``shadowing`` maps a fallback entry to the parameters for which it shadows the modules called inside it;
    ``shadowed`` maps an entry to the parameters it must skip while such a fallback is running.
    """

    hooked: list[HookedModule]
    calls: dict[tuple[int, int], list[CallLayout]]  # the layouts proven for each call, one per path the model took
    shadowing: dict[int, set[nn.Parameter]] = field(default_factory=dict)
    shadowed: dict[int, set[nn.Parameter]] = field(default_factory=dict)
    repeats: tuple[int, ...] = (1,)  # rows per example seen along dimension 0: how far a broadcast may expand


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
    if not isinstance(out, Tensor) or not isinstance(ref, Tensor) or out.shape != ref.shape or not is_float(out):
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


def _choose_rule(entry: HookedModule, calls: list[CallRecord], layouts: Layouts) -> LayerRule:
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


def _merge_nested_fallbacks(
    one: ProbeRun,
    entries: list[HookedModule],
    promoted: dict[int, HookedModule],
    chosen: dict[nn.Parameter, set[int]],
    names: dict[int, str],
) -> None:
    """A fallback whose every call is made directly by another fallback's call (a wrapper around a wrapper), and
    whose call re-run alone gives another output than it gave inside that call, hands its parameters to the outermost
    fallback of the chain: its own re-run would miss what the enclosing call set up around it (peft's
    ``ParamWrapper`` on MoE experts patches the expert tensors that the wrapper inside it reads), while the outer
    re-run replays both calls."""
    fallback = {id(e.module): e for e in entries if e.is_fallback} | {k: e for k, e in promoted.items()}
    calls_of: dict[int, list[CallRecord]] = {}
    for call in one.calls:
        calls_of.setdefault(id(call.module), []).append(call)
    for key, inner in list(fallback.items()):
        outers = set()
        for call in calls_of.get(key, []):
            outer, parent = None, call.parent
            while parent is not None and id(one.calls[parent].module) in fallback:
                outer = id(one.calls[parent].module)
                parent = one.calls[parent].parent
            outers.add(outer)
        if len(outers) != 1 or None in outers or all(reruns_alone(c) for c in calls_of.get(key, [])[:1]):
            continue
        (outer_key,) = outers
        moved = [p for p, ids in chosen.items() if id(inner) in ids]
        if not moved:
            continue
        target = promoted.get(outer_key)
        if target is None:
            module = fallback[outer_key].module
            target = promoted[outer_key] = HookedModule(
                names.get(outer_key, type(module).__name__), module, FALLBACK_RULE, []
            )
        for p in moved:
            chosen[p] = (chosen[p] - {id(inner)}) | {id(target)}
            if not any(q is p for q in target.params):
                target.params.append(p)
        if promoted.get(key) is inner:
            inner.params = [p for p in inner.params if not any(p is q for q in moved)]
            if not inner.params:
                del promoted[key]


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
    layouts = Layouts(one, two, three, names)
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

    _merge_nested_fallbacks(one, entries, promoted, chosen, names)

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
            if layouts.partner[call.index] is None:
                continue
            ref = two.calls[layouts.partner[call.index]]  # the shapes the layouts hold for (see `fits`)
            if entry.is_fallback:
                layout = fallback_layout(call, layouts)
                if layout is not None:
                    layout = replace(layout, shapes=(leaf_shapes(ref.in_leaves), leaf_shapes(ref.out_leaves)))
            else:
                out = closed_form_layout(entry.rule, call, layouts)
                layout = None
                if out is not None:
                    layout = CallLayout(
                        outputs=[out], expand=(0,) if out.broadcast else (), shapes=([], leaf_shapes(ref.out_leaves))
                    )
            if layout is not None:
                plan.calls[(id(entry), call.ordinal)] = [layout]

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
    layouts: Layouts,
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
