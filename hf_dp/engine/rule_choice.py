"""Step 2 of :mod:`.planner`: the rule each hooked module gets, checked against autograd on the probe.

A rule registered for the module's exact type must agree with autograd (:func:`~.rule_check.rule_disagreement`) or
the plan is refused; a guessed rule (a predicate such as a class name, a registered base class) that disagrees is
replaced by the torch.func fallback. A subclass whose ``forward`` differs from its base's is first tried as the
base's output times a measured constant (:class:`~hf_dp.layers.ScaledRule`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..layers import FALLBACK_RULE, LayerRule, ScaledRule
from ..layers.base import autocast_like, own_named_parameters
from .coverage import HookedModule
from .foreign_check import foreign_disagreement
from .layouts import Layouts, closed_form_layout, is_float
from .probe import CallRecord, tolerance
from .self_check import SelfCheckError
from .shared_checks import RuleChecks

#: The planner's logger (these messages are the plan's).
logger = logging.getLogger("hf_dp.engine.planner")

__all__ = ["choose_rules"]


def choose_rules(
    static: list[HookedModule], calls_of: dict[int, list[CallRecord]], layouts: Layouts
) -> list[HookedModule]:
    """``static`` with the rule each module gets on the probed calls (``calls_of``: by ``id(module)``), the checks
    measured together and shared between identical modules (:class:`~.shared_checks.RuleChecks`)."""
    candidates = [_candidate(entry, calls_of.get(id(entry.module), []), layouts) for entry in static]
    checked = [c for c in candidates if isinstance(c, _Candidate) and c.problem is _UNCHECKED]
    for c, problem in zip(checked, RuleChecks().disagreements([c.check for c in checked]), strict=True):
        c.problem = problem
    entries: list[HookedModule] = []
    for entry, c in zip(static, candidates, strict=True):
        rule = _decide(entry, c) if isinstance(c, _Candidate) else c
        entries.append(HookedModule(entry.name, entry.module, rule, list(entry.params), entry.match))
    return entries


#: A candidate's problem before its check against autograd ran.
_UNCHECKED = object()


@dataclass
class _Candidate:
    """A rule that holds only if its check on the probed ``call`` passes (``problem``: the check's answer, an
    exception it raised, or :data:`_UNCHECKED`)."""

    rule: LayerRule
    check: tuple
    problem: object = _UNCHECKED


def _candidate(entry: HookedModule, calls: list[CallRecord], layouts: Layouts) -> LayerRule | _Candidate:
    """The rule ``entry`` gets without a check against autograd, or the candidate to check."""
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
    for call in calls:
        layout = closed_form_layout(rule, call, layouts)
        if layout is not None:
            candidate = _Candidate(rule, (entry, rule, call, layout))
            if _covers_foreign(entry):
                candidate.problem = foreign_disagreement(entry, rule, call, layout)
            return candidate
    return rule  # its uses are covered by an enclosing module (decided per use: :mod:`.use_coverage`)


def _decide(entry: HookedModule, candidate: _Candidate) -> LayerRule:
    """The candidate's rule if its check passed; else the fallback for a guessed rule, a refusal for a registered
    one."""
    problem, rule, match = candidate.problem, candidate.rule, entry.match
    if isinstance(problem, BaseException):
        raise problem
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


def _covers_foreign(entry: HookedModule) -> bool:
    """Whether ``entry``'s rule covers parameters its module does not own (SpecAugment's mask embedding)."""
    own = {id(p) for _, p in own_named_parameters(entry.module)}
    for p in entry.params:
        if id(p) not in own:
            return True
    return False


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
