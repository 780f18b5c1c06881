"""The norms a rule check compares, read all at once for several checks (``_batched_norms``), are the ones the
comparison in order computes one by one: ``||autograd||``, ``||rule[0] - autograd||`` and the square root of the
rule's ghost norm."""

from __future__ import annotations

import math

import torch
from torch import nn

from hf_dp.engine.rule_check import _batched_norms, _Check, _compare_in_order, _worst_margin
from hf_dp.layers.grads import FactoredGrad, IndexFactor, InstantiatedGrad, instantiate, norm_sq


def _one_by_one(named, ref, grads):
    out = {}
    for p in named.values():
        expected = ref[p].double()
        got = grads.get(p)
        if got is None:
            out[p] = (float(expected.norm()), None, None)
            continue
        dense = instantiate(got, torch.float64).value[0].double()
        norm = float(norm_sq(got, torch.float64)[0].sqrt())
        out[p] = (float(expected.norm()), float((dense - expected).norm()), norm)
    return out


def _comparison_norms(named, ref, grads):
    return _batched_norms([_Check(named, grads, [], [], ref=ref)])[0]


def test_norms_at_once_equal_the_norms_one_by_one():
    torch.manual_seed(0)
    w, b, e, u = (nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in ((4, 3), (4,), (7, 3), (5,)))
    named = {"w": w, "b": b, "e": e, "u": u}
    ref = {p: torch.randn_like(p) for p in named.values()}
    grads = {
        w: FactoredGrad(
            left=torch.randn(1, 6, 4, dtype=torch.float64),
            right=torch.randn(1, 6, 3, dtype=torch.float64),
            shape=w.shape,
        ),
        b: InstantiatedGrad(torch.randn(1, 4, dtype=torch.float64)),
        e: FactoredGrad(
            left=IndexFactor(torch.tensor([[2, 5, 2, -1]]), 7),
            right=torch.randn(1, 4, 3, dtype=torch.float64),
            shape=e.shape,
        ),
    }  # `u`: no rule gradient
    fast, slow = _comparison_norms(named, ref, grads), _one_by_one(named, ref, grads)
    for p in named.values():
        for x, y in zip(fast[p], slow[p], strict=True):
            assert (x is None and y is None) or math.isclose(x, y, rel_tol=1e-14, abs_tol=1e-300)
    # the same verdict both ways: a wrong gradient and a missing one
    assert _worst_margin(named, fast, [torch.float64])[0] == _compare_in_order(named, ref, grads, [torch.float64])
    exact = {p: InstantiatedGrad(ref[p].unsqueeze(0).clone()) for p in named.values()}
    problem, margin = _worst_margin(named, _comparison_norms(named, ref, exact), [torch.float64])
    assert problem is None and margin < 1e-8
    assert _compare_in_order(named, ref, exact, [torch.float64]) is None


def test_checks_read_together_get_each_its_own_norms():
    """Three checks in one read (one whose gradient cannot be compared at once: two examples) get what each gets
    alone."""
    torch.manual_seed(1)
    checks = []
    for shape, examples in (((3, 2), 1), ((5,), 2), ((2, 2), 1)):
        p = nn.Parameter(torch.randn(*shape, dtype=torch.float64))
        ref = {p: torch.randn_like(p)}
        grads = {p: InstantiatedGrad(torch.randn(examples, *shape, dtype=torch.float64))}
        checks.append(_Check({"p": p}, grads, [], [], ref=ref))
    together = _batched_norms(checks)
    assert together[1] is None  # compared in order, as it comes
    for c, found in zip(checks, together, strict=True):
        alone = _batched_norms([c])[0]
        assert found == alone
        if found is not None:
            slow = _one_by_one(c.named, c.ref, c.grads)
            for x, y in zip(found[next(iter(c.named.values()))], slow[next(iter(c.named.values()))], strict=True):
                assert math.isclose(x, y, rel_tol=1e-14)
