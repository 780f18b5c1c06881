"""The autograd check of a rule that covers parameters its module does not own (step 2 of :mod:`.planner`).

SpecAugment's mask embedding belongs to the model, and is written by the model's masking method, which runs as the
call of a child module (:mod:`hf_dp.layers.spec_augment`): :func:`~.rule_check.rule_disagreement`, which re-runs a
module with its own parameters swapped for leaves, has none to swap there. Here the call is re-run with the covered
parameters themselves in autograd (their flags restored after), on a copy of its first input (the call writes into
it), and the rule's per-example gradient of that re-run is compared with autograd's vector-Jacobian product for a
random output gradient. numpy's and Python's random streams are left as they were (a training-like probe draws
masks).
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from torch import Tensor

from ..layers import LayerRule, Layout
from ..layers.base import autocast_like
from ..layers.grads import compute_dtype, instantiate, norm_sq
from .coverage import HookedModule
from .probe import CallRecord, tolerance
from .rows import closed_form_grads

__all__ = ["foreign_disagreement"]


def foreign_disagreement(entry: HookedModule, rule: LayerRule, call: CallRecord, layout: Layout) -> str | None:
    """Compare ``rule`` with autograd on a re-run of the probe's one-example ``call``; the mismatch, or ``None``."""
    params = list(entry.params)
    args = (call.args[0].clone(), *call.args[1:])
    rerun = _rerun(entry, call, args)
    if isinstance(rerun, str):
        return rerun
    out, g, ref = rerun
    with torch.no_grad():
        captured = rule.capture(entry.module, args, call.kwargs, out)
        grads = closed_form_grads(rule, entry.module, captured, g, layout, 1, set(params))
        for p, r in zip(params, ref, strict=True):
            expected = (torch.zeros_like(p) if r is None else r).double()
            got = grads.get(p)
            if got is None:
                return "it gives no gradient for a parameter it covers"
            dense = instantiate(got, compute_dtype(p.dtype)).value[0].double()
            scale = float(expected.norm())
            tol = max(tolerance(p.dtype), tolerance(out.dtype)) * max(scale, 1e-12)
            err = float((dense - expected).norm())
            if not math.isfinite(scale):  # autograd's own gradient overflowed: nothing to compare with
                return "autograd's own gradient on the probe's example is not finite, so the rule cannot be checked"
            # (`not x <= tol`: a NaN in the rule's gradient or norm is a mismatch, not a pass)
            if not err <= tol:
                return f"its gradient is off by {err:.3e} (autograd's norm {scale:.3e})"
            if not abs(float(norm_sq(got, torch.float64)[0].sqrt()) - scale) <= tol:
                return "its per-example norm differs from autograd's"
    return None


def _rerun(entry: HookedModule, call: CallRecord, args: tuple) -> tuple[Tensor, Tensor, list] | str:
    """``(output, random output gradient, autograd's gradient of each covered parameter or None)`` of the call re-run
    on ``args`` with the covered parameters in autograd, or what is wrong with its output."""
    params = list(entry.params)
    flags = [p.requires_grad for p in params]
    host = (np.random.get_state(), random.getstate())
    try:
        with torch.enable_grad(), autocast_like(call.autocast):
            for p in params:
                p.requires_grad_(True)
            out = entry.module(*args, **call.kwargs)
            if not isinstance(out, Tensor) or out.shape != call.output.shape:
                return f"its forward returned {type(out).__name__} when re-run"
            seeded = torch.Generator(device=out.device).manual_seed(17)
            g = torch.randn(out.shape, generator=seeded, device=out.device).to(out.dtype)
            ref = torch.autograd.grad(out, params, g, allow_unused=True) if out.requires_grad else [None] * len(params)
    finally:
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
        np.random.set_state(host[0])
        random.setstate(host[1])
    return out, g, list(ref)
