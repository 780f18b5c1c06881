"""The plan: from two probe runs, which module covers each use of each trainable parameter, and how to read it.

Steps (each is exact or raises; see DESIGN §4.12, §4.13):

1. **Layouts.** Every tensor entering or leaving a module call gets a :class:`~hf_dp.layers.Layout` from the runs on
   one and two examples (:func:`~.probe.infer_layout`), or is shared by every example, or is unprovable (worked out
   for the calls the plan reads, :class:`~.layouts.Layouts`).
2. **Rules** (:mod:`.rule_choice`). A rule registered for the module's exact type is checked against autograd on the
   one-example run (:mod:`.rule_check`; once for identical modules of a repeated block,
   :class:`~.shared_checks.RuleChecks`); a mismatch raises :class:`~.self_check.SelfCheckError`. A guessed rule (a
   predicate such as a class name, a registered base class) is checked the same way and replaced by the fallback
   when it disagrees; a subclass whose ``forward`` differs from its base's is first tried as the base's output times
   a measured constant (:class:`~hf_dp.layers.ScaledRule`).
3. **Coverage** (:mod:`.use_coverage`). For each use of each parameter (the innermost module call it happened in),
   the innermost module on the call path that can account for it: the parameter's owner if its rule applies to that
   call's layout, else the smallest enclosing module whose own inputs and outputs carry the examples, through the
   fallback (a position table indexed by ``[q, k]`` ids is covered by the attention module that adds it to the
   batch's scores; a weight read by a parent's functional call, by that parent). A fallback covers every use of its
   parameters inside its forward, so inside it no other module counts them.
4. **Broadcasts.** Outputs proven to be ``[1, ...]`` and shared (HF position embeddings of ``[1, T]`` ids) are
   expanded to the batch, so that their gradient is per example; a third run checks that the model's output is
   unchanged by the expansion.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import Tensor, nn

from .coverage import HookedModule
from .layouts import CallLayout, Layouts, closed_form_layout, fallback_layout, fits, leaf_shapes, needs_third_run
from .probe import CallRecord, ProbeRun, same_values
from .rule_choice import choose_rules
from .use_coverage import cover_uses

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


def build_plan(
    static: list[HookedModule],
    one: ProbeRun,
    two: ProbeRun,
    names: dict[int, str],
    param_names: dict[nn.Parameter, str],
    *,
    allow_fallback: bool,
    three: ProbeRun | Callable[[], ProbeRun] | None = None,
) -> Plan:
    """The plan for the probed forward pass (steps 1-3 of the module docstring; the caller runs step 4).

    ``one``, ``two``, ``three``: probe runs on examples ``[0]``, ``[1, 0]`` and (optionally) ``[1, 1, 0]``; ``three``
    may be the function that makes it, called if the plan reads a layout that needs it (:class:`~.layouts.Layouts`).
    """
    layouts = Layouts(one, two, three, names)
    calls_of: dict[int, list[CallRecord]] = {}
    for call in one.calls:
        calls_of.setdefault(id(call.module), []).append(call)
    entries = choose_rules(static, calls_of, layouts)
    hooked = cover_uses(one, calls_of, entries, layouts, names, param_names, allow_fallback=allow_fallback)
    plan = Plan(hooked=hooked, calls={}, repeats=(1, *sorted(layouts.batched_rows())))
    for entry in hooked:
        for call in calls_of.get(id(entry.module), []):
            layout = _call_layout(entry, call, layouts, two)
            if layout is not None:
                plan.calls[(id(entry), call.ordinal)] = [layout]
    _mark_shadowing(plan)
    return plan


def _call_layout(entry: HookedModule, call: CallRecord, layouts: Layouts, two: ProbeRun) -> CallLayout | None:
    """The layout ``entry`` reads ``call`` with (``None``: not proven, or no partner in the two-example run), with
    the shapes of the two-example run's call, which :func:`~.layouts.fits` compares a later call with."""
    if layouts.partner[call.index] is None:
        return None
    ref = two.calls[layouts.partner[call.index]]
    if entry.is_fallback:
        layout = fallback_layout(call, layouts)
        if layout is None:
            return None
        return replace(layout, shapes=(leaf_shapes(ref.in_leaves), leaf_shapes(ref.out_leaves)))
    out = closed_form_layout(entry.rule, call, layouts)
    if out is None:
        return None
    return CallLayout(outputs=[out], expand=(0,) if out.broadcast else (), shapes=([], leaf_shapes(ref.out_leaves)))


def _mark_shadowing(plan: Plan) -> None:
    """A fallback covers every use of its parameters inside its forward: it shadows the other coverers of those
    parameters there."""
    coverers: dict[nn.Parameter, list[HookedModule]] = {}
    for entry in plan.hooked:
        for p in entry.params:
            coverers.setdefault(p, []).append(entry)
    for p, group in coverers.items():
        if len(group) > 1 and any(e.is_fallback for e in group):
            for e in group:
                plan.shadowed.setdefault(id(e), set()).add(p)
                if e.is_fallback:
                    plan.shadowing.setdefault(id(e), set()).add(p)


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
