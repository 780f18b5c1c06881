"""Step 3 of :mod:`.planner`: which hooked module covers each use of each trainable parameter.

For each use (the innermost module call it happened in), the innermost module on the call path that can account for
it: the parameter's owner if its rule applies to that call's layout, else the smallest enclosing module whose own
inputs and outputs carry the examples, through the fallback (a position table indexed by ``[q, k]`` ids is covered by
the attention module that adds it to the batch's scores; a weight read by a parent's functional call, by that
parent). A fallback covers every use of its parameters inside its forward, so inside it no other module counts them.
"""

from __future__ import annotations

import logging

from torch import nn

from ..layers import FALLBACK_RULE, UnsupportedModuleError
from ..layers.replay import ROWS_BY_VALUES
from .coverage import HookedModule
from .layouts import Layouts, closed_form_layout, describe_layout, fallback_layout, reruns_alone
from .probe import CallRecord, ProbeRun

#: The planner's logger (these messages are the plan's).
logger = logging.getLogger("hf_dp.engine.planner")

__all__ = ["cover_uses"]


def cover_uses(
    one: ProbeRun,
    calls_of: dict[int, list[CallRecord]],
    entries: list[HookedModule],
    layouts: Layouts,
    names: dict[int, str],
    param_names: dict[nn.Parameter, str],
    *,
    allow_fallback: bool,
) -> list[HookedModule]:
    """The hooked modules of the plan: ``entries`` (with their checked rules) keeping the parameters whose uses they
    cover, and the fallbacks promoted on enclosing modules for the uses no rule sees.

    ``calls_of``: the calls of the one-example run ``one``, by ``id(module)``.

    Raises:
        UnsupportedModuleError: a use that no module on its call path can account for.
    """
    owner: dict[tuple[int, nn.Parameter], HookedModule] = {}
    for entry in entries:
        for p in entry.params:
            owner[(id(entry.module), p)] = entry
    chosen: dict[nn.Parameter, set[int]] = {}  # the entries chosen for each parameter, by id
    promoted: dict[int, HookedModule] = {}  # the fallbacks promoted for uses no rule sees, by id(module)
    for p, where in one.uses.items():
        for index in where:
            coverer = _coverer(p, index, one, owner, promoted, layouts, names, allow_fallback)
            if coverer is None:
                raise _uncovered(p, one.calls[index], owner, layouts, names, param_names, allow_fallback)
            chosen.setdefault(p, set()).add(id(coverer))
    _mark_routed_holders(one, names)
    _claim_unprobed(one, entries, promoted, chosen)
    _merge_nested_fallbacks(one, calls_of, entries, promoted, chosen, names)
    final = _keep_chosen(entries, promoted, chosen)
    _warn_promoted(final, param_names)
    return final


def _coverer(
    p: nn.Parameter,
    index: int,
    one: ProbeRun,
    owner: dict[tuple[int, nn.Parameter], HookedModule],
    promoted: dict[int, HookedModule],
    layouts: Layouts,
    names: dict[int, str],
    allow_fallback: bool,
) -> HookedModule | None:
    """The innermost module on the call path of use ``index`` of ``p`` that can account for it (a fallback promoted
    on an enclosing module is made or extended here), or ``None``."""
    call: CallRecord | None = one.calls[index]
    while call is not None:
        entry = owner.get((id(call.module), p))
        # a closed-form rule models its module's own use only; a fallback, every use inside its forward
        if entry is not None and (entry.is_fallback or call.index == index) and _provable(entry, call, layouts):
            return entry
        if (
            allow_fallback
            and any(q is p for q in call.module.parameters())
            and fallback_layout(call, layouts) is not None
        ):
            coverer = _promoted_fallback(promoted, call.module, names)
            _add_param(coverer, p)
            return coverer
        call = one.calls[call.parent] if call.parent is not None else None
    return None


def _provable(entry: HookedModule, call: CallRecord, layouts: Layouts) -> bool:
    """Whether ``entry``'s rule has a proven layout for ``call``."""
    if entry.is_fallback:
        return fallback_layout(call, layouts) is not None
    return closed_form_layout(entry.rule, call, layouts) is not None


def _promoted_fallback(promoted: dict[int, HookedModule], module: nn.Module, names: dict[int, str]) -> HookedModule:
    """The fallback promoted on ``module`` to cover uses inside its forward (made, without parameters, on first
    need)."""
    entry = promoted.get(id(module))
    if entry is None:
        name = names.get(id(module), type(module).__name__)
        entry = promoted[id(module)] = HookedModule(name, module, FALLBACK_RULE, [])
    return entry


def _add_param(entry: HookedModule, p: nn.Parameter) -> None:
    if not any(q is p for q in entry.params):
        entry.params.append(p)


def _claim_unprobed(
    one: ProbeRun, entries: list[HookedModule], promoted: dict[int, HookedModule], chosen: dict[nn.Parameter, set[int]]
) -> None:
    """A parameter that no probe call used, inside a fallback promoted around routed calls (:mod:`.routing`: an
    expert module that no token of the probed examples picked), goes to the innermost such fallback: another batch
    may route tokens to it, inside that fallback's forward, which covers every use there. Left to its own rule, it
    would have no layout proven when it is called, and no sub-batch need take that path to prove one."""
    around = _routed_holders(one)
    fallbacks = {id(e.module): e for e in entries if e.is_fallback} | promoted
    holders = [e for key, e in fallbacks.items() if key in around]
    if not holders:
        return
    trainable = {id(p): p for e in entries for p in e.params if p not in one.uses and p not in chosen}
    for entry in sorted(holders, key=lambda e: -e.name.count(".")):  # the innermost first
        for p in entry.module.parameters():
            if trainable.pop(id(p), None) is not None:
                _add_param(entry, p)
                chosen[p] = {id(entry)}


def _routed_holders(one: ProbeRun) -> dict[int, nn.Module]:
    """The modules of the calls that are not routed but hold routed calls (:mod:`.routing`), by id."""
    around: dict[int, nn.Module] = {}
    for index in one.routed:
        parent = one.calls[index].parent
        if parent is not None and parent not in one.routed:
            around[id(one.calls[parent].module)] = one.calls[parent].module
    return around


def _mark_routed_holders(one: ProbeRun, names: dict[int, str]) -> None:
    """Tell the fallback which modules run submodules on routed rows: it refuses to replay random draws there."""
    for key, module in _routed_holders(one).items():
        ROWS_BY_VALUES[module] = names.get(key, type(module).__name__)


def _merge_nested_fallbacks(
    one: ProbeRun,
    calls_of: dict[int, list[CallRecord]],
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
    for key, inner in list(fallback.items()):
        calls = calls_of.get(key, [])
        outers = {_outermost_fallback(call, one, fallback) for call in calls}
        if len(outers) != 1 or None in outers or all(reruns_alone(c) for c in calls[:1]):
            continue
        (outer_key,) = outers
        moved = [p for p, ids in chosen.items() if id(inner) in ids]
        if not moved:
            continue
        target = _promoted_fallback(promoted, fallback[outer_key].module, names)
        for p in moved:
            chosen[p] = (chosen[p] - {id(inner)}) | {id(target)}
            _add_param(target, p)
        if promoted.get(key) is inner:
            inner.params = [p for p in inner.params if not any(p is q for q in moved)]
            if not inner.params:
                del promoted[key]


def _outermost_fallback(call: CallRecord, one: ProbeRun, fallback: dict[int, HookedModule]) -> int | None:
    """``id(module)`` of the outermost fallback of the unbroken chain of fallback calls that made ``call`` (``None``:
    its caller is no fallback)."""
    outer, parent = None, call.parent
    while parent is not None and id(one.calls[parent].module) in fallback:
        outer = id(one.calls[parent].module)
        parent = one.calls[parent].parent
    return outer


def _keep_chosen(
    entries: list[HookedModule], promoted: dict[int, HookedModule], chosen: dict[nn.Parameter, set[int]]
) -> list[HookedModule]:
    """The plan's hooked modules: entries keep the parameters they were chosen for (and those no probe call used); a
    fallback promoted on a module that already has a fallback entry is merged into it."""
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
    return final


def _warn_promoted(final: list[HookedModule], param_names: dict[nn.Parameter, str]) -> None:
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
    if call.index in layouts.one.routed:
        why = (
            f"the rows `{where}` runs on are chosen by the values of the data (an MoE's token rows of one expert), "
            "so no run on sub-batches proves which example each row belongs to"
        )
    elif entry is not None and not entry.is_fallback:
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
