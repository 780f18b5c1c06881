"""The plan: from two probe runs, which module covers each use of each trainable parameter, and how to read it.

Steps (each is exact or raises; see DESIGN §4.12, §4.13):

1. **Layouts.** Every tensor entering or leaving a module call gets a :class:`~hf_dp.layers.Layout` from the runs on
   one and two examples (:func:`~.probe.infer_layout`), or is shared by every example, or is unprovable (worked out
   for the calls the plan reads, :class:`~.layouts.Layouts`).
2. **Rules.** A rule registered for the module's exact type is checked against autograd on the one-example run
   (once for identical modules of a repeated block, :class:`RuleChecks`); a mismatch raises
   :class:`~.self_check.SelfCheckError`. A guessed rule (a predicate such as a class name, a
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
from collections.abc import Callable
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
    return _disagreement(entry, rule, call, layout)[0]


def _disagreement(
    entry: HookedModule, rule: LayerRule, call: CallRecord, layout: Layout, noise: dict | None = None
) -> tuple[str | None, float]:
    """:func:`rule_disagreement`, and how close the comparison came to its tolerance: the largest of the compared
    differences over its threshold (above 1 is a mismatch; ``inf`` where the comparison could not be made at once).
    ``noise``: the random output gradients drawn so far, by shape, dtype and device (the same seed draws the same
    tensor: drawn once)."""
    module, output = entry.module, call.output
    params = set(entry.params)
    g = _noise_like(output, noise)
    captured = rule.capture(module, call.args, call.kwargs, output)
    with torch.no_grad():
        grads = closed_form_grads(rule, module, captured, g.clone(), layout, 1, params)
    named = {n: p for n, p in module.named_parameters() if p in params}
    with torch.enable_grad(), autocast_like(call.autocast):
        leaves = {n: p.detach().requires_grad_(True) for n, p in named.items()}
        out = _call_with(module, leaves, call.args, call.kwargs)
        if not isinstance(out, Tensor) or out.shape != output.shape:
            return f"its forward returned {type(out).__name__} when re-run", float("inf")
        if out.dtype == g.dtype:  # the gradient of `(out * g).sum()` with respect to `out` is `g`, exactly
            ref = torch.autograd.grad(out, list(leaves.values()), grad_outputs=g, allow_unused=True)
        else:
            ref = torch.autograd.grad((out * g).sum(), list(leaves.values()), allow_unused=True)
    ref = {named[n]: (torch.zeros_like(p) if r is None else r) for (n, p), r in zip(leaves.items(), ref, strict=True)}
    # under autocast the call computes in a lower precision than its parameters: the lowest one sets the tolerance
    computed = [t.dtype for t in (output, *call.args) if isinstance(t, Tensor) and t.is_floating_point()]
    try:
        values = _comparison_norms(named, ref, grads)
    except Exception:  # noqa: BLE001  (a rule whose gradient cannot be compared: in order below, as it comes)
        values = None
    if values is None:
        return _compare_in_order(named, ref, grads, computed), float("inf")
    scale = float(sum(x * x for x, *_ in values.values()) ** 0.5) or 1.0
    worst = 0.0
    for name, p in named.items():
        tol = max(tolerance(dtype) for dtype in (p.dtype, *computed))
        expected_norm, err, norm = values[p]
        if err is None:
            if expected_norm > tol * scale:
                return f"it gives no gradient for `{name}`", float("inf")
            worst = max(worst, expected_norm / (tol * scale))
            continue
        threshold = tol * max(expected_norm, 1e-3 * scale)
        if err > threshold:
            return f"its gradient of `{name}` is off by {err / max(expected_norm, 1e-30):.2e} (relative)", float("inf")
        if abs(norm - expected_norm) > threshold:
            return f"its per-example norm of `{name}` is {norm:.6g}, autograd's {expected_norm:.6g}", float("inf")
        worst = max(worst, err / threshold, abs(norm - expected_norm) / threshold)
    return None, worst


def _noise_like(output: Tensor, noise: dict | None) -> Tensor:
    if noise is None:
        return _random_like(output, seed=17)
    key = (tuple(output.shape), output.dtype, output.device)
    if key not in noise:
        noise[key] = _random_like(output, seed=17)
    return noise[key]


def _call_with(module: nn.Module, leaves: dict[str, Tensor], args: tuple, kwargs: dict):
    """``torch.func.functional_call(module, leaves, args, kwargs)``; for a module without submodules whose
    parameters are distinct tensors (nothing to untie), the same swap of ``module._parameters`` done directly."""
    own = module._parameters
    direct = (
        not module._modules
        and not isinstance(module, torch.jit.ScriptModule)
        and all(n in own for n in leaves)
        and len({id(p) for p in own.values() if p is not None}) == sum(p is not None for p in own.values())
    )
    if not direct:
        return torch.func.functional_call(module, leaves, args, kwargs)
    saved = {n: own[n] for n in leaves}
    try:
        for n, t in leaves.items():
            own[n] = t
        return module(*args, **kwargs)
    finally:
        for n, p in saved.items():
            own[n] = p


def _comparison_norms(named: dict, ref: dict, grads: dict) -> dict:
    """``param -> (||autograd||, ||rule - autograd|| or None without a rule gradient, ||rule||)``, read on the host
    at once (``Tensor.norm()`` is ``vector_norm(., 2)``; ``||rule||`` from the ghost norm)."""
    parts, where = [], {}
    for p in named.values():
        expected = ref[p].double()
        got = grads.get(p)
        row = [torch.linalg.vector_norm(expected)]
        if got is not None:
            dense = instantiate(got, compute_dtype(p.dtype)).value[0].double()
            row += [torch.linalg.vector_norm(dense - expected), norm_sq(got, torch.float64)[0].sqrt()]
        where[p] = (len(parts), len(row))
        parts += [x.to(dtype=torch.float64, device=parts[0].device if parts else x.device) for x in row]
    flat = torch.stack(parts).tolist() if parts else []
    out = {}
    for p, (start, n) in where.items():
        row = flat[start : start + n]
        out[p] = (row[0], row[1], row[2]) if n == 3 else (row[0], None, None)
    return out


def _compare_in_order(named: dict, ref: dict, grads: dict, computed: list) -> str | None:
    """The comparison of :func:`rule_disagreement`, one parameter after the other (a rule whose gradients could not
    be compared all at once: the first problem in order, or its error)."""
    scale = float(sum(r.double().pow(2).sum() for r in ref.values()) ** 0.5) or 1.0
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
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


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
        return (kind, tuple(_signature(y, values, float_values=float_values) for y in x))
    if kind is dict:
        if not all(type(k) in _SCALARS for k in x):
            raise _NotComparable
        return (kind, tuple((k, _signature(v, values, float_values=float_values)) for k, v in x.items()))
    values.append(x)  # a configuration, a cache, a function: the same object only
    return ("object", id(x))


def _same(a, b) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    return a is b


class RuleChecks:
    """The rule checks of one plan (:func:`rule_disagreement`), shared between identical modules.

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
        self._done: dict[tuple, list[tuple[list, str | None]]] = {}
        self._noise: dict = {}  # the random output gradients, by shape, dtype and device
        self.evaluated = 0
        self.shared = 0

    def key(self, entry: HookedModule, rule: LayerRule, call: CallRecord, layout: Layout) -> tuple[tuple, list] | None:
        module = entry.module
        if entry.match is None or not entry.match.exact or rule is not entry.match.rule:
            return None
        if module._modules or "forward" in vars(module) or any(getattr(module, h, None) for h in _HOOK_DICTS):
            return None
        values: list = []
        try:
            state = tuple(
                (k, _signature(v, values, float_values=True))
                for k, v in vars(module).items()
                if k not in _MODULE_INTERNALS
            )
            covered = {id(p) for p in entry.params}
            params = tuple(
                (n, None if p is None else (tuple(p.shape), p.dtype, p.device, p.requires_grad, id(p) in covered))
                for n, p in module._parameters.items()
            )
            buffers = tuple((n, _signature(b, values, float_values=True)) for n, b in module._buffers.items())
            inputs = _signature((call.args, call.kwargs), values, float_values=False)
            output = _signature(call.output, [], float_values=False)
        except _NotComparable:
            return None
        scale = rule.scale if isinstance(rule, ScaledRule) else None
        base = id(rule.base) if isinstance(rule, ScaledRule) else id(rule)
        key = (type(rule), base, scale, type(module), state, params, buffers, inputs, output, call.autocast, layout)
        try:
            hash(key)
        except TypeError:
            return None
        return key, values

    def disagreement(self, entry: HookedModule, rule: LayerRule, call: CallRecord, layout: Layout) -> str | None:
        """:func:`rule_disagreement`, or the answer of an identical check of this plan."""
        found = self.key(entry, rule, call, layout)
        if found is not None:
            key, values = found
            for seen, problem in self._done.get(key, ()):
                if len(seen) == len(values) and all(_same(a, b) for a, b in zip(seen, values, strict=True)):
                    self.shared += 1
                    return problem
        problem, closeness = _disagreement(entry, rule, call, layout, self._noise)
        self.evaluated += 1
        if found is not None and problem is None and closeness <= SHARE_MARGIN:
            self._done.setdefault(key, []).append((values, problem))
        return problem


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


def _choose_rule(
    entry: HookedModule, calls: list[CallRecord], layouts: Layouts, checks: RuleChecks | None = None
) -> LayerRule:
    """The rule to use for ``entry``: its own, a scaled version, or the fallback (guessed rules that disagree).
    ``checks``: the rule checks of this plan so far, shared between identical modules (:class:`RuleChecks`)."""
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
    layout = closed_form_layout(rule, first, layouts)
    problem = (
        rule_disagreement(entry, rule, first, layout)
        if checks is None
        else checks.disagreement(entry, rule, first, layout)
    )
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

    # 2. rules
    entries: list[HookedModule] = []
    checks = RuleChecks()
    for entry in static:
        rule = _choose_rule(entry, calls_of.get(id(entry.module), []), layouts, checks)
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

    rows = layouts.batched_rows()
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
