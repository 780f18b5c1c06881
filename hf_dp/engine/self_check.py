"""First-step self-check: the engine's per-example gradient norms against plain per-example autograd.

The engine proves layouts and checks every rule against autograd on the first batch, but the whole chain (the
per-example loss, the model's wiring, cross terms of shared weights) is only checked end to end here: on a few
examples of a real micro-batch, in eval mode, the engine's per-parameter per-example norms are compared with those of
an ordinary backward pass on each example alone (DESIGN §4.17).

Tolerance (``SELF_CHECK_TOLERANCE``), relative to the example's total gradient norm: float64 ``1e-6``; float32
``1e-3`` (the batched and the one-example forward round differently); bfloat16 and float16 ``5e-2`` (their forward
passes differ by a few units of an 8- or 11-bit mantissa). The lowest precision among the trainable parameters sets
it, or the autocast dtype when autocast is on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..layers import UnsupportedModuleError
from .batch import root_batch, slice_batch
from .probe import frozen_rng

__all__ = ["SELF_CHECK_TOLERANCE", "SelfCheckError", "self_check"]

#: Relative tolerance of the self-check per parameter dtype (see the module docstring).
SELF_CHECK_TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-6,
    torch.float32: 1e-3,
    torch.bfloat16: 5e-2,
    torch.float16: 5e-2,
}


class SelfCheckError(UnsupportedModuleError):
    """The engine's per-example gradients disagree with plain autograd: a layer rule is wrong for this model."""


def _tolerance(params: list[nn.Parameter]) -> float:
    dtypes = {p.dtype for p in params}
    for device in {p.device.type for p in params}:
        if torch.is_autocast_enabled(device):  # the forward computes in the autocast dtype
            dtypes.add(torch.get_autocast_dtype(device))
    return max((SELF_CHECK_TOLERANCE.get(d, 5e-2) for d in dtypes), default=1e-6)


def self_check(
    clipper,
    inputs: dict,
    per_example_loss: Callable[[nn.Module, dict], Tensor],
    *,
    num_examples: int = 3,
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
    with frozen_rng(devices):
        model.eval()
        try:
            engine = clipper._parameter_norms(inputs, per_example_loss)
            batch = root_batch(model, (), inputs)
            count = min(num_examples, batch.size)
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
                    reference.append(
                        {
                            p: (0.0 if g is None else float(g.double().norm()))
                            for p, g in zip(trainable, grads, strict=True)
                        }
                    )
        finally:
            for m, flag in flags:
                m.training = flag
    tol = _tolerance(trainable)
    worst, problems = 0.0, []
    for i, ref in enumerate(reference):
        total = sum(v * v for v in ref.values()) ** 0.5
        got_total = sum(float(engine[p][i]) ** 2 for p in trainable if p in engine) ** 0.5
        scale = max(total, 1e-30)
        worst = max(worst, abs(got_total - total) / scale)
        for p in trainable:
            got = float(engine[p][i]) if p in engine else 0.0
            err = abs(got - ref[p]) / scale
            worst = max(worst, err)
            if err > tol:
                problems.append((err, f"`{names[p]}` (example {i}: engine {got:.6g}, autograd {ref[p]:.6g})"))
    if problems:
        problems.sort(key=lambda x: -x[0])
        shown = "; ".join(text for _, text in problems[:5])
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise SelfCheckError(
            f"Self-check failed: the engine's per-example gradient norms differ from per-example autograd by up to "
            f"{problems[0][0]:.2e} of the example's norm (tolerance {tol:.0e}) for {shown}{more}. A layer rule is "
            "wrong for this model: register a correct rule with `hf_dp.layers.register_rule(..., override=True)` "
            "or remove the wrong one so the torch.func fallback is used, and report the model."
        )
    return worst
