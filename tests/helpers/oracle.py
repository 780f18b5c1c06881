"""Float64 oracle: per-example gradients by a loop of autograd calls on an untouched copy of the model.

Independent of hf_dp's rules: it differentiates each example's loss with plain autograd. A rule test is shapes plus
one call of :func:`check_clipper`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hf_dp import BookKeepingClipper

LossFn = Callable[[nn.Module, dict], torch.Tensor]


def oracle_per_example(model: nn.Module, batch: dict, loss_fn: LossFn):
    """``(names, [B] list of flat per-example gradients)`` by one autograd call per example."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    params = [p for _, p in named]
    loss = loss_fn(model, batch)
    assert loss.dim() == 1
    grads = []
    for i in range(loss.shape[0]):
        g = torch.autograd.grad(loss[i], params, retain_graph=True, allow_unused=True)
        grads.append([torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, params, strict=True)])
    return names, grads


def clip_factors(norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """The oracle's per-example clip factors ``min(1, C / (||g_i|| + 1e-6))``."""
    return (max_grad_norm / (norms + 1e-6)).clamp(max=1.0)


def clipped_unit_mean(row_grads: Sequence[list], units: Sequence) -> tuple[list, float, torch.Tensor]:
    """A user-level step's oracle: each unit's gradient ``sum_{i in u} g_i`` (``row_grads[i]``: row ``i``'s
    per-parameter gradients, ``units[i]``: its unit) clipped at C, the median unit norm (some units clipped, some not),
    then the mean over the units. Returns ``(mean per parameter, C, unit norms)``."""
    order = list(dict.fromkeys(units))
    sums = [
        [sum(g[k] for g, u in zip(row_grads, units, strict=True) if u == unit) for k in range(len(row_grads[0]))]
        for unit in order
    ]
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gs)) for gs in sums])
    clip = float(norms.median())
    assert (norms > clip).any() and (norms < clip).any()
    coef = clip_factors(norms, clip)
    mean = [sum(coef[u] * sums[u][k] for u in range(len(order))) / len(order) for k in range(len(row_grads[0]))]
    return mean, clip, norms


def oracle_clipped(model: nn.Module, batches: Sequence[dict], loss_fn: LossFn, max_grad_norm: float | None):
    """Norms per batch and the accumulated clipped sum per parameter name (``max_grad_norm=None``: median)."""
    ref = copy.deepcopy(model)
    norms_per_batch, total = [], None
    for batch in batches:
        names, grads = oracle_per_example(ref, batch, loss_fn)
        norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
        if max_grad_norm is None:  # clip some examples and not others
            max_grad_norm = float(norms.median())
        coef = clip_factors(norms, max_grad_norm)
        summed = [sum(coef[i] * grads[i][k] for i in range(len(grads))) for k in range(len(names))]
        total = summed if total is None else [a + b for a, b in zip(total, summed, strict=True)]
        norms_per_batch.append(norms)
    return names, norms_per_batch, dict(zip(names, total, strict=True)), max_grad_norm


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str, scale: float = 0.0) -> None:
    """``||actual - expected|| <= rel * ||expected||``, with a float64 round-off floor ``1e-12 * scale`` for
    gradients that are exactly zero in theory (e.g. attention key biases, which softmax cancels)."""
    err = float((actual - expected).norm())
    bound = rel * float(expected.norm()) + 1e-12 * scale
    assert err <= bound, f"{what}: error {err:.3e} > {bound:.3e} (||expected|| = {float(expected.norm()):.3e})"


def check_clipper(
    model: nn.Module,
    batches: Sequence[dict],
    loss_fn: LossFn,
    *,
    mode: str,
    max_grad_norm: float | None = None,
    rel: float = 1e-6,
) -> BookKeepingClipper:
    """Compare BookKeepingClipper's norms and accumulated clipped sums with the oracle, in float64."""
    model = model.double()
    names, norms_expected, sum_expected, c = oracle_clipped(model, batches, loss_fn, max_grad_norm)
    clipped = [(norms > c).sum().item() for norms in norms_expected]
    assert sum(clipped) > 0 or max_grad_norm is not None, "the test must clip some examples"
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode=mode)
    for batch, norms in zip(batches, norms_expected, strict=True):
        loss = loss_fn(model, batch)
        clipper.backward(loss)
        torch.testing.assert_close(clipper.per_example_norms, norms, rtol=rel, atol=0)
    params = dict(model.named_parameters())
    scale = float(torch.sqrt(sum((g**2).sum() for g in sum_expected.values())))
    for name in names:
        grad = params[name].grad
        assert grad is not None, f"{name} got no gradient"
        assert_rel_close(grad, sum_expected[name], rel, name, scale)
    clipper.rules_used = dict(clipper.hooked_modules)  # module name -> rule, recorded before remove()
    clipper.remove()
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    return clipper
