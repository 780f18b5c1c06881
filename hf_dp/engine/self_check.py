"""First-step self-check: the engine's per-example gradient norms against plain per-example autograd.

The engine proves layouts and checks every rule against autograd on the first batch, but the whole chain (the
per-example loss, the model's wiring, cross terms of shared weights) is only checked end to end here: on a few
examples of a real micro-batch, in eval mode, the engine's per-parameter per-example norms are compared with those of
an ordinary backward pass on each example alone (DESIGN §4.17). When training runs the model in training mode, the
check runs in that mode instead (dropout, SpecAugment, router jitter: paths eval mode never takes), with the engine's
pass and the reference's drawing the same random numbers; there the reference differentiates each example's loss of
the batched forward on its own. Eval mode is checked then only if those random draws cannot be replayed.

The check runs on the compared examples alone (the micro-batch cut to them): their norms do not depend on the other
examples' rows, which the support check proves on the whole micro-batch. That check and the verification of the
training-mode forward are left to the micro-batch itself (they run on its own forward and backward passes), so the
self-check costs a pass on a few examples, not several on the whole micro-batch (issue 40).

Every parameter is checked on its own (DESIGN §19): a parameter whose norm is a small share of the total (an MoE
router) can be 100% wrong while the total is within any tolerance. A parameter fails when its error exceeds
``SELF_CHECK_TOLERANCE`` of the example's total norm, or ``PARAMETER_TOLERANCE`` of the parameter's own norm (the
round-off of its own gradient) where that is above ``ROUNDOFF_FLOOR`` of the total (a gradient that is zero in theory,
e.g. an attention key bias, is round-off on both sides).

Tolerances, by the lowest precision among the trainable parameters (or the autocast dtype when autocast is on):
of the total, float64 ``1e-6``, float32 ``1e-3`` (the batched and the one-example forward round differently),
bfloat16 and float16 ``5e-2`` (a few units of an 8- or 11-bit mantissa); of the parameter's own norm, ``1e-6``,
``1e-2`` and ``2e-1``, floored at ``1e-9``, ``1e-5`` and ``1e-2`` of the total. A doubled or halved parameter is off by
50-100% of its own norm: it fails at any share of the total above the floor.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from ..layers import UnsupportedModuleError
from .batch import root_batch, slice_batch
from .checkpointing import graph_leaves
from .module_state import kept_state
from .probe import frozen_rng

logger = logging.getLogger("hf_dp")

__all__ = ["PARAMETER_TOLERANCE", "ROUNDOFF_FLOOR", "SELF_CHECK_TOLERANCE", "SelfCheckError", "self_check"]

#: Relative tolerance of the self-check per parameter dtype (see the module docstring).
SELF_CHECK_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.bfloat16: 5e-2,
    torch.float16: 5e-2,
}


#: Tolerance relative to the parameter's own norm (see the module docstring).
PARAMETER_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 1e-2,
    torch.bfloat16: 2e-1,
    torch.float16: 2e-1,
}
#: The floor of the per-parameter tolerance, relative to the example's total norm.
ROUNDOFF_FLOOR: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-2,
    torch.float16: 1e-2,
}


class SelfCheckError(UnsupportedModuleError):
    """The engine's per-example gradients disagree with plain autograd: a layer rule is wrong for this model."""


def _tolerances(params: list[nn.Parameter]) -> tuple[float, float, float]:
    """(of the total, of the parameter's own norm, the floor of the latter) for the lowest precision in use."""
    dtypes = {p.dtype for p in params}
    for device in {p.device.type for p in params}:
        if torch.is_autocast_enabled(device):  # the forward computes in the autocast dtype
            dtypes.add(torch.get_autocast_dtype(device))
    dtype = max(dtypes, key=lambda d: SELF_CHECK_TOLERANCE.get(d, 5e-2), default=torch.float64)
    return (
        SELF_CHECK_TOLERANCE.get(dtype, 5e-2),
        PARAMETER_TOLERANCE.get(dtype, 2e-1),
        ROUNDOFF_FLOOR.get(dtype, 1e-2),
    )


def self_check(
    clipper,
    inputs: dict,
    per_example_loss: Callable[[nn.Module, dict], Tensor],
    *,
    num_examples: int = 2,
) -> float:
    """Compare ``clipper``'s per-example norms with per-example autograd; see ``BookKeepingClipper.self_check``."""
    if num_examples < 1:
        raise ValueError(f"`num_examples` must be >= 1, got {num_examples}.")
    model: nn.Module = clipper.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return 0.0
    names = {p: n for n, p in model.named_parameters()}
    flags = [(m, m.training) for m in model.modules()]
    devices = sorted({p.device for p in model.parameters()}, key=str)
    inputs, count = _checked_rows(model, inputs, num_examples)
    # the checks of the whole micro-batch (each loss depends on its own example alone; every use of a parameter is
    # covered, in the mode training runs) are not taken from the checked examples: they run on the micro-batch's own
    # forward and backward passes (the support check here only to explain a failure)
    clipper._support_checked = True
    try:
        return _checks(clipper, inputs, per_example_loss, count, (trainable, names, flags, devices))
    except SelfCheckError:
        _explain(clipper, inputs, per_example_loss, flags, devices)
        raise
    finally:
        clipper._verified, clipper._support_checked = None, False


def _explain(clipper, inputs: dict, per_example_loss, flags: list, devices: list) -> None:
    """After a failed check: the support check's error instead, if a loss depends on another checked example (a loss
    that couples examples, or inputs that are not batch-first, rather than a wrong rule)."""
    clipper._support_checked = False
    with frozen_rng(devices), kept_state(clipper.model):
        clipper.model.eval()
        try:
            clipper._parameter_norms(inputs, per_example_loss)
        except UnsupportedModuleError as err:  # the support check's (anything else: the self-check's error stands)
            raise err from None
        except Exception:
            pass
        finally:
            for m, flag in flags:
                m.training = flag


def _checked_rows(model: nn.Module, inputs: dict, num_examples: int) -> tuple[dict, int]:
    """The micro-batch cut to the examples the check compares (their norms do not depend on the other examples'
    rows, which the support check proves on the whole micro-batch), and how many there are."""
    batch = root_batch(model, (), inputs)
    count = min(num_examples, batch.size)
    if count == batch.size:
        return inputs, count
    return slice_batch((), inputs, batch, list(range(count)))[1], count


def _checks(clipper, inputs: dict, per_example_loss, count: int, context: tuple) -> float:
    """The check in the mode training runs: in training mode if (part of) the model is in it and its random draws
    replay, else in eval mode (each example alone). Training never takes eval mode's paths when it runs in training
    mode, so the eval-mode check is left out there (issue 40: it was half the self-check's time)."""
    model: nn.Module = clipper.model
    trainable, names, flags, devices = context
    tolerances = _tolerances(trainable)
    if any(flag for _, flag in flags):  # training runs (part of) the model in training mode: check that mode
        with kept_state(model):
            trained = _training_mode_norms(clipper, inputs, per_example_loss, trainable, count, devices)
        if trained is not None:
            return _compare(*trained, trainable, names, tolerances, " in training mode")
    with frozen_rng(devices), kept_state(model):  # training then computes what it would without the check
        model.eval()
        try:
            engine = clipper._parameter_norms(inputs, per_example_loss)
            reference = _alone_norms(clipper, inputs, per_example_loss, trainable, count)
        finally:
            for m, flag in flags:
                m.training = flag
    return _compare(engine, reference, trainable, names, tolerances, "")


def _alone_norms(clipper, inputs: dict, per_example_loss, trainable: list, count: int) -> list[dict]:
    """Per-parameter gradient norms of each of the first ``count`` examples run alone (plain autograd)."""
    model: nn.Module = clipper.model
    batch = root_batch(model, (), inputs)
    reference: list[dict[nn.Parameter, float]] = []
    with clipper._inert():
        for i in range(count):
            _, one = slice_batch((), inputs, batch, [i])
            loss = per_example_loss(model, one)
            if loss.shape != (1,):
                raise ValueError(
                    f"`per_example_loss` returned shape {tuple(loss.shape)} for one example; expected (1,)."
                )
            grads = torch.autograd.grad(loss.sum(), trainable, allow_unused=True)
            reference.append(grad_norms(trainable, grads))
    return reference


def grad_norms(params: list[nn.Parameter], grads) -> dict[nn.Parameter, float]:
    """Each gradient's norm in float64 (0 where it is ``None``), read to the host once per device."""
    norms: dict[nn.Parameter, float] = {}
    by_device: dict[torch.device, list[tuple[nn.Parameter, Tensor]]] = {}
    for p, g in zip(params, grads, strict=True):
        if g is None:
            norms[p] = 0.0
        else:
            g = g.abs() if g.is_complex() else g
            by_device.setdefault(g.device, []).append((p, torch.linalg.vector_norm(g, dtype=torch.float64)))
    for pairs in by_device.values():
        values = torch.stack([n for _, n in pairs]).tolist()
        norms.update((p, v) for (p, _), v in zip(pairs, values, strict=True))
    return norms


def _rng_state(devices: list[torch.device]) -> tuple:
    cuda = [(d, torch.cuda.get_rng_state(d)) for d in devices if d.type == "cuda"]
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def _set_rng_state(state: tuple) -> None:
    cpu, cuda, numpy_state, python_state = state
    torch.set_rng_state(cpu)
    for d, s in cuda:
        torch.cuda.set_rng_state(s, d)
    np.random.set_state(numpy_state)
    random.setstate(python_state)


def _training_mode_norms(clipper, inputs, per_example_loss, trainable, count, devices):
    """``(engine, reference)`` per-parameter norms of the first ``count`` examples with the model in the mode training
    uses (dropout, SpecAugment's masks, router jitter), or ``None`` if the random draws could not be replayed.

    Both passes run the checked examples from the same random state (torch, NumPy and Python generators): the
    reference differentiates each example's loss of that batched forward on its own (plain autograd on the batch's
    graph, exact under any random draw, since the first batch showed that loss ``i`` depends on example ``i``
    alone), the engine book-keeps its own forward. The generators are restored afterwards, so training draws what it
    would have drawn without the check."""
    model: nn.Module = clipper.model
    start = _rng_state(devices)
    losses: dict[str, Tensor] = {}

    def recording_loss(m, batch):
        out = per_example_loss(m, batch)
        losses["engine"] = out.detach()
        return out

    try:
        # the engine's pass first: on a batch the model cannot take, its probe's error says what to pass
        engine = clipper._parameter_norms(inputs, recording_loss)
        _set_rng_state(start)
        with clipper._inert():
            loss = per_example_loss(model, inputs)
            losses["reference"] = loss.detach()
            # backward (not autograd.grad, which reentrant checkpointing refuses), every leaf's .grad kept as it was
            kept = {id(v): (v, v.grad) for v in [*trainable, *graph_leaves(loss)]}
            reference = []
            try:
                for i in range(count):
                    for v, _ in kept.values():
                        v.grad = None
                    torch.autograd.backward(loss[i], retain_graph=i + 1 < count)
                    reference.append(grad_norms(trainable, [p.grad for p in trainable]))
            finally:
                for v, grad in kept.values():
                    v.grad = grad
            del loss
    finally:
        _set_rng_state(start)
    ref, got = losses["reference"], losses.get("engine")
    if got is None or got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-5, atol=0, equal_nan=True):
        logger.info(
            "hf_dp self-check: the model's random draws in training mode could not be replayed for the engine's pass "
            "(its losses differ from the reference's): only the eval-mode check ran."
        )
        return None
    return engine, reference


def _compare(engine, reference, trainable, names, tolerances, where: str) -> float:
    """The worst relative error of the engine's per-parameter norms; :class:`SelfCheckError` past the tolerances."""
    tol, own_tol, floor = tolerances
    worst, problems = 0.0, []
    for i, ref in enumerate(reference):
        total = sum(v * v for v in ref.values()) ** 0.5
        got_total = sum(float(engine[p][i]) ** 2 for p in trainable if p in engine) ** 0.5
        scale = max(total, 1e-30)
        worst = max(worst, abs(got_total - total) / scale)
        for p in trainable:
            got = float(engine[p][i]) if p in engine else 0.0
            diff = abs(got - ref[p])
            worst = max(worst, diff / scale)
            # (`not diff <= bound`: an engine norm of NaN against a finite autograd norm is a failure, not a pass)
            if not diff <= min(tol * scale, max(own_tol * ref[p], floor * scale)) and math.isfinite(ref[p]):
                own = max(ref[p], floor * scale)
                problems.append((diff / own, f"`{names[p]}` (example {i}: engine {got:.6g}, autograd {ref[p]:.6g})"))
    if problems:
        problems.sort(key=lambda x: -x[0])
        shown = "; ".join(text for _, text in problems[:5])
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise SelfCheckError(
            f"Self-check failed{where}: the engine's per-example gradient norms differ from per-example autograd by up "
            f"to {problems[0][0]:.2e} of the parameter's own norm (tolerance {own_tol:.0e}, and {tol:.0e} of the "
            f"example's norm) for {shown}{more}. A layer rule is "
            "wrong for this model: register a correct rule with `hf_dp.layers.register_rule(..., override=True)` "
            "or remove the wrong one so the torch.func fallback is used, and report the model."
        )
    return worst
