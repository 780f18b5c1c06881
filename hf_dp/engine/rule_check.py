"""A layer rule checked against autograd on the probe's one-example call (step 2 of :mod:`.planner`).

The rule's per-example gradient and ghost norm, for a random output gradient, are compared with the vector-Jacobian
product of the module's own forward with respect to each parameter the rule covers, within the tolerance of the
lowest precision the call computes in.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..layers import LayerRule, Layout
from ..layers.base import autocast_like, own_named_parameters
from ..layers.grads import compute_dtype, instantiate, norm_sq
from .coverage import HookedModule
from .probe import CallRecord, tolerance
from .rows import closed_form_grads

__all__ = ["measure_disagreements", "rule_disagreement"]

#: The mismatch reported when autograd's own gradient on the probe's example is not finite: nothing to compare with.
_NOT_FINITE = (
    "autograd's own gradient of the module on the probe's example is not finite (it overflows in this precision), so "
    "the rule cannot be checked against it"
)


def _random_like(t: Tensor, seed: int) -> Tensor:
    g = torch.Generator(device=t.device).manual_seed(seed)
    return torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).to(t.dtype)


def rule_disagreement(entry: HookedModule, rule: LayerRule, call: CallRecord, layout: Layout) -> str | None:
    """Compare ``rule`` with autograd on the probe's one-example call; a description of the mismatch, or ``None``.

    The rule's per-example gradient (and its ghost norm) for a random output gradient must match the vector-Jacobian
    product of the module's own forward with respect to each covered parameter.
    """
    found = measure_disagreements([(entry, rule, call, layout)])[0]
    if isinstance(found, BaseException):
        raise found
    return found[0]


#: Parameter entries whose checks are measured together at most (more are measured in turn, a check of a larger
#: module alone): the references, the rules' gradients and their differences in float64 are held for all of them.
CHECK_CHUNK = 1 << 22


def measure_disagreements(
    checks: list[tuple[HookedModule, LayerRule, CallRecord, Layout]], noise: dict | None = None
) -> list[tuple[str | None, float] | BaseException]:
    """:func:`rule_disagreement` of several checks, each as it would be alone, with how close each came to its
    tolerance (the largest of its compared differences over its threshold: above 1 is a mismatch; ``inf`` where the
    comparison could not be made at once). Every module is re-run on its own recorded call (its inputs detached, so
    one check's reference cannot reach another's parameters), the references of all come from one ``autograd.grad``
    (the gradient with respect to one check's parameter leaves is that check's vector-Jacobian product alone), the
    norms from one host read; up to :data:`CHECK_CHUNK` parameter entries at a time. A check whose rule or re-run
    raised gets its exception (for the caller to raise in its turn). ``noise``: the random output gradients drawn so
    far, by shape, dtype and device (the same seed draws the same tensor: drawn once)."""
    noise = {} if noise is None else noise
    out: list = []
    chunk: list = []
    size = 0
    for check in checks:
        n = sum(p.numel() for p in check[0].params)
        if chunk and size + n > CHECK_CHUNK:
            out += _measure_together(chunk, noise)
            chunk, size = [], 0
        chunk.append(check)
        size += n
    return out + _measure_together(chunk, noise) if chunk else out


def _measure_together(checks: list, noise: dict) -> list:
    """:func:`measure_disagreements` of checks measured at once."""
    prepared = []
    for entry, rule, call, layout in checks:
        try:
            prepared.append(_prepare(entry, rule, call, layout, noise))
        except Exception as err:  # noqa: BLE001  (raised by the caller when this check's turn comes)
            prepared.append(err)
    _references(prepared)
    out: list = []
    batch = [(i, item) for i, item in enumerate(prepared) if isinstance(item, _Check) and item.problem is None]
    values = _batched_norms([item for _, item in batch])
    by_index = dict(zip([i for i, _ in batch], values, strict=True))
    for i, item in enumerate(prepared):
        if not isinstance(item, _Check):
            out.append(item)
        elif item.problem is not None:
            out.append((item.problem, float("inf")))
        elif by_index[i] is None:  # a rule whose gradient cannot be compared at once: in order, as it comes
            out.append((_compare_in_order(item.named, item.ref, item.grads, item.computed), float("inf")))
        else:
            out.append(_worst_margin(item.named, by_index[i], item.computed))
    return out


@dataclass(eq=False)
class _Check:
    """One check between its re-run and its comparison."""

    named: dict[str, nn.Parameter]
    grads: dict
    computed: list
    leaves: list
    out: Tensor | None = None
    g: Tensor | None = None
    ref: dict | None = None
    problem: str | None = None


def _prepare(entry: HookedModule, rule: LayerRule, call: CallRecord, layout: Layout, noise: dict) -> _Check:
    """The rule's per-example gradients for a random output gradient, and the module re-run on the call with its
    covered parameters as fresh leaves (the graph the reference is read from)."""
    module, output = entry.module, call.output
    params = set(entry.params)
    g = _noise_like(output, noise)
    captured = rule.capture(module, call.args, call.kwargs, output)
    with torch.no_grad():
        grads = closed_form_grads(rule, module, captured, g.clone(), layout, 1, params)
    covered = {id(p) for p in entry.params}
    named = {n: p for n, p in _named_parameters(module) if id(p) in covered}
    # under autocast the call computes in a lower precision than its parameters: the lowest one sets the tolerance
    computed = [t.dtype for t in (output, *call.args) if isinstance(t, Tensor) and t.is_floating_point()]
    amp = autocast_like(call.autocast) if call.autocast else contextlib.nullcontext()
    with torch.enable_grad(), amp:
        leaves = {n: p.detach().requires_grad_(True) for n, p in named.items()}
        out = _call_with(module, leaves, call.args, call.kwargs)
        check = _Check(named, grads, computed, list(leaves.values()))
        if not isinstance(out, Tensor) or out.shape != call.output.shape:
            check.problem = f"its forward returned {type(out).__name__} when re-run"
        elif out.dtype == g.dtype:  # the gradient of `(out * g).sum()` with respect to `out` is `g`, exactly
            check.out, check.g = out, g
        else:
            check.out = (out * g).sum()
    return check


def _references(prepared: list) -> None:
    """Each check's reference, autograd's ``g^T d(output)/d(param)`` (zeros for a parameter its output does not
    reach), all from one ``autograd.grad``."""
    checks = [c for c in prepared if isinstance(c, _Check) and c.problem is None]
    reached = [c for c in checks if c.out.requires_grad and c.leaves]
    inputs = [leaf for c in reached for leaf in c.leaves]
    grads = (
        torch.autograd.grad(
            [c.out for c in reached],
            inputs,
            grad_outputs=[c.g if c.g is not None else torch.ones_like(c.out) for c in reached],
            allow_unused=True,
        )
        if reached
        else ()
    )
    found = dict(zip(map(id, inputs), grads, strict=True))
    for c in checks:
        c.ref = {
            p: (torch.zeros_like(p) if found.get(id(leaf)) is None else found[id(leaf)])
            for p, leaf in zip(c.named.values(), c.leaves, strict=True)
        }
        c.out = c.g = None
        c.leaves = []


def _named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module.named_parameters()``; for a module without submodules whose class lists them as ``nn.Module`` does,
    read from ``module._parameters`` (:func:`own_named_parameters`: the same pairs, in the same order)."""
    kind, base = type(module), nn.Module
    if (
        module._modules
        or kind.named_parameters is not base.named_parameters
        or kind._named_members is not base._named_members
        or kind.named_modules is not base.named_modules
    ):
        return list(module.named_parameters())
    return own_named_parameters(module)


def _worst_margin(named: dict, values: dict, computed: list) -> tuple[str | None, float]:
    """The first mismatch among the norms of :func:`_batched_norms` (with ``inf``), or ``None`` and the largest
    difference over its threshold."""
    total = 0.0
    for x, *_ in values.values():
        total += x * x
    scale = float(total**0.5) or 1.0
    floor = max([tolerance(dtype) for dtype in computed], default=0.0)
    if not math.isfinite(scale):
        return _NOT_FINITE, float("inf")
    worst = 0.0
    for name, p in named.items():
        tol = max(tolerance(p.dtype), floor)
        expected_norm, err, norm = values[p]
        if err is None:
            if not expected_norm <= tol * scale:
                return f"it gives no gradient for `{name}`", float("inf")
            worst = max(worst, expected_norm / (tol * scale))
            continue
        # (`not x <= t`: a NaN difference is a mismatch, not a pass)
        threshold = tol * max(expected_norm, 1e-3 * scale)
        if not err <= threshold:
            return f"its gradient of `{name}` is off by {err / max(expected_norm, 1e-30):.2e} (relative)", float("inf")
        if not abs(norm - expected_norm) <= threshold:
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
    present = [id(p) for p in own.values() if p is not None]
    direct = (
        not module._modules
        and not isinstance(module, torch.jit.ScriptModule)
        and own.keys() >= leaves.keys()
        and len(set(present)) == len(present)
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


def _batched_norms(checks: list[_Check]) -> list[dict | None]:
    """Per check, ``param -> (||autograd||, ||rule - autograd|| or None without a rule gradient, ||rule||)``, for all
    checks read on the host at once: the Euclidean norms in one ``_foreach_norm``, ``||rule||`` the square root of
    the ghost norm (IEEE ``sqrt`` in float64 on the host: the value ``Tensor.sqrt`` gives). ``None`` for a check
    whose gradients cannot be compared so (compared in order, as they come)."""
    dense: list[Tensor] = []
    ghost: list[Tensor] = []
    places: list[dict | None] = []
    for c in checks:
        try:
            d, gh, where = _comparison_terms(c.named, c.ref, c.grads)
        except Exception:  # noqa: BLE001  (a rule whose gradient cannot be compared at once)
            places.append(None)
            continue
        places.append({p: (len(dense) + i, None if j is None else len(ghost) + j) for p, (i, j) in where.items()})
        dense += d
        ghost += gh
    if not dense:
        return [None if w is None else {} for w in places]
    device = dense[0].device
    if len({t.device for t in (*dense, *ghost)}) > 1:  # parameters on several devices: compared on the first
        dense, ghost = [t.to(device=device) for t in dense], [t.to(device=device) for t in ghost]
    norms = torch.stack(torch._foreach_norm(dense))
    flat = torch.cat([norms, *ghost]).tolist() if ghost else norms.tolist()
    out: list[dict | None] = []
    for where in places:
        if where is None:
            out.append(None)
            continue
        out.append(
            {
                p: (flat[i], None, None) if j is None else (flat[i], flat[i + 1], math.sqrt(flat[len(dense) + j]))
                for p, (i, j) in where.items()
            }
        )
    return out


def _comparison_terms(named: dict, ref: dict, grads: dict) -> tuple[list[Tensor], list[Tensor], dict]:
    """The tensors :func:`_batched_norms` reads for one check: autograd's gradient and the rule's difference from it
    (by position in the first list), the rule's ghost norm (one entry each, in the second), and where each
    parameter's lie."""
    dense, ghost, where = [], [], {}
    for p in named.values():
        expected = ref[p].double()
        got = grads.get(p)
        where[p] = (len(dense), None if got is None else len(ghost))
        dense.append(expected)
        if got is not None:
            value = instantiate(got, compute_dtype(p.dtype)).value
            if value.shape[0] != 1:
                raise ValueError("a gradient of more than one example")  # compared in order, as it comes
            # `value - expected` holds the entries of `value[0] - expected` (a leading size-1 dimension broadcasts)
            dense.append(value.double() - expected)
            norm = norm_sq(got, torch.float64)
            if norm.numel() != 1:
                raise ValueError("a ghost norm of more than one example")  # compared in order, as it comes
            ghost.append(norm.reshape(1))
    return dense, ghost, where


def _compare_in_order(named: dict, ref: dict, grads: dict, computed: list) -> str | None:
    """The comparison of :func:`rule_disagreement`, one parameter after the other (a rule whose gradients could not
    be compared all at once: the first problem in order, or its error)."""
    scale = float(sum(r.double().pow(2).sum() for r in ref.values()) ** 0.5) or 1.0
    if not math.isfinite(scale):
        return _NOT_FINITE
    for name, p in named.items():
        tol = max(tolerance(dtype) for dtype in (p.dtype, *computed))
        expected = ref[p].double()
        got = grads.get(p)
        if got is None:
            if not float(expected.norm()) <= tol * scale:
                return f"it gives no gradient for `{name}`"
            continue
        dense = instantiate(got, compute_dtype(p.dtype)).value[0].double()
        err = float((dense - expected).norm())
        if not err <= tol * max(float(expected.norm()), 1e-3 * scale):
            return f"its gradient of `{name}` is off by {err / max(float(expected.norm()), 1e-30):.2e} (relative)"
        norm = float(norm_sq(got, torch.float64)[0].sqrt())
        if not abs(norm - float(expected.norm())) <= tol * max(float(expected.norm()), 1e-3 * scale):
            return f"its per-example norm of `{name}` is {norm:.6g}, autograd's {float(expected.norm()):.6g}"
    return None
