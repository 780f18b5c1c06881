"""Rule checks shared between identical modules (:class:`RuleChecks`): the layers of a repeated block are checked
once (step 2 of :mod:`.planner`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..layers import LayerRule, Layout, ScaledRule
from .coverage import HookedModule
from .probe import CallRecord
from .rule_check import measure_disagreements

__all__ = ["SHARE_MARGIN", "RuleChecks"]


#: ``nn.Module`` attributes that hold hooks and bookkeeping, not state that its ``forward`` reads.
_MODULE_INTERNALS = frozenset(
    {
        "_parameters",
        "_buffers",
        "_modules",
        "_non_persistent_buffers_set",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    }
)
#: How far inside its tolerance a rule check must pass for identical modules to share it (:class:`RuleChecks`):
#: float64 round-off is ~1e-10 of the float64 threshold, a lower internal precision ~1e-1.
SHARE_MARGIN = 1e-2
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})


class _NotComparable(Exception):
    pass


def _signature(x, values: list, *, float_values: bool):
    """A hashable description of ``x`` for :class:`RuleChecks`: containers walked, scalars by value, tensors by type,
    shape, strides, dtype and device, with their values appended to ``values`` (integer and boolean tensors always,
    floating-point ones if ``float_values``) and compared there; any other object by identity."""
    kind = type(x)
    if kind in _SCALARS:
        return (kind, x)
    if isinstance(x, Tensor):
        if float_values or not (x.is_floating_point() or x.is_complex()):
            values.append(x)
        return (kind, tuple(x.shape), x.stride() if x.layout == torch.strided else None, x.dtype, x.device, x.layout)
    if kind is tuple or kind is list or kind is torch.Size:
        return (kind, tuple([_signature(y, values, float_values=float_values) for y in x]))
    if kind is dict:
        for k in x:
            if type(k) not in _SCALARS:
                raise _NotComparable
        return (kind, tuple([(k, _signature(v, values, float_values=float_values)) for k, v in x.items()]))
    values.append(x)  # a configuration, a cache, a function: the same object only
    return ("object", id(x))


def _all_same(seen: list, values: list) -> bool:
    """Every value the same: tensors equal in value, other objects the same object."""
    if len(seen) != len(values):
        return False
    for a, b in zip(seen, values, strict=True):
        if isinstance(a, Tensor):
            if not (isinstance(b, Tensor) and torch.equal(a, b)):
                return False
        elif a is not b:
            return False
    return True


class RuleChecks:
    """The rule checks of one plan (:func:`~.rule_check.rule_disagreement`), shared between identical modules.

    Only a rule registered for the module's exact type (whose ``forward`` is the class's: a torch layer such as
    ``nn.Linear``, whose closed form is hf_dp's own) is shared, and only a check that passed far inside its
    tolerance (every difference under :data:`SHARE_MARGIN` of its threshold: agreement to round-off in the dtype the
    module computes in). A guessed rule (a class name, a base class) is checked on every module: its forward is the
    model's code, which may branch on values or compute in another precision than its inputs (where the check passes
    or fails by the values it meets), and a check that came close to its tolerance is not a function's property.

    Two checks are the same test when everything the rule and the module's ``forward`` compute from, other than the
    values of the parameters and of the floating-point inputs, is the same: the rule, the module's type (no
    ``forward`` of its own, no submodules, no hooks), every other attribute (scalars equal, tensors and buffers equal
    in value, other objects the same object), the parameters' names, shapes, dtypes and which of them the rule covers,
    the call's structure (scalars equal; tensors of the same shape, strides, dtype and device; integer and boolean
    tensors such as token ids equal in value), its output's shape, the autocast state and the proven layout. The
    second module of a repeated block (the layers of a transformer) then gets the first one's answer: the same closed
    form against autograd of the same function, with the same random output gradient, at another point of a function
    the torch layer computes without branching on the floating-point values. Anything else is checked on its own."""

    def __init__(self) -> None:
        self._done: dict[tuple, list[list]] = {}  # the checks that passed far inside: key -> their values
        self._noise: dict = {}  # the random output gradients, by shape, dtype and device
        self.evaluated = 0
        self.shared = 0

    def key(self, entry: HookedModule, rule: LayerRule, call: CallRecord, layout: Layout) -> tuple[tuple, list] | None:
        module = entry.module
        if entry.match is None or not entry.match.exact or rule is not entry.match.rule:
            return None
        attrs = vars(module)
        if module._modules or "forward" in attrs:
            return None
        for h in _HOOK_DICTS:
            if getattr(module, h, None):
                return None
        values: list = []
        try:
            state = [
                (k, _signature(v, values, float_values=True)) for k, v in attrs.items() if k not in _MODULE_INTERNALS
            ]
            covered = {id(p) for p in entry.params}
            params = [
                (n, None if p is None else (tuple(p.shape), p.dtype, p.device, p.requires_grad, id(p) in covered))
                for n, p in module._parameters.items()
            ]
            buffers = [(n, _signature(b, values, float_values=True)) for n, b in module._buffers.items()]
            inputs = _signature((call.args, call.kwargs), values, float_values=False)
            output = _signature(call.output, [], float_values=False)
        except _NotComparable:
            return None
        scale = rule.scale if isinstance(rule, ScaledRule) else None
        base = id(rule.base) if isinstance(rule, ScaledRule) else id(rule)
        key = (type(rule), base, scale, type(module), tuple(state), tuple(params), tuple(buffers), inputs, output)
        key += (call.autocast, layout)
        try:
            hash(key)
        except TypeError:
            return None
        return key, values

    def disagreements(self, checks: list[tuple[HookedModule, LayerRule, CallRecord, Layout]]) -> list:
        """:func:`~.rule_check.rule_disagreement` of each check, or the answer of an identical check of this plan (a
        mismatch, ``None``, or the exception its rule or re-run raised, for the caller to raise in its turn), measured
        together (:func:`~.rule_check.measure_disagreements`): first
        every check that no identical check answers, then those whose identical check of this call did not pass far
        inside its tolerance (each on its own: as strict as checking in order, where a later identical check could
        have answered them)."""
        keys = [self.key(*check) for check in checks]
        answers: list = [None] * len(checks)
        leaders: dict[int, int] = {}  # a check to be answered by an identical one of this call: index -> its index
        pending: dict[tuple, list[tuple[int, list]]] = {}
        first = []
        for i, found in enumerate(keys):
            if found is not None:
                key, values = found
                if any(_all_same(seen, values) for seen in self._done.get(key, ())):
                    self.shared += 1
                    continue
                leader = next((j for j, seen in pending.get(key, ()) if _all_same(seen, values)), None)
                if leader is not None:
                    leaders[i] = leader
                    continue
                pending.setdefault(key, []).append((i, values))
            first.append(i)
        passed = self._measure(checks, first, keys, answers)
        self._measure(checks, [i for i, j in leaders.items() if j not in passed], keys, answers)
        self.shared += sum(j in passed for j in leaders.values())
        return answers

    def _measure(self, checks: list, which: list[int], keys: list, answers: list) -> set[int]:
        """Measure the checks ``which`` into ``answers``, and keep those that passed far inside their tolerance for
        identical checks to share; their indices."""
        passed = set()
        for i, found in zip(which, measure_disagreements([checks[i] for i in which], self._noise), strict=True):
            self.evaluated += 1
            if isinstance(found, BaseException):
                answers[i] = found
                continue
            answers[i], closeness = found
            if answers[i] is None and closeness <= SHARE_MARGIN:
                passed.add(i)
                if keys[i] is not None:
                    key, values = keys[i]
                    self._done.setdefault(key, []).append(values)
        return passed
