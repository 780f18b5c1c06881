"""The float64 oracle of :mod:`helpers.oracle` for models that draw random numbers in training (dropout, peft's
LyCORIS ``module_dropout`` and ``rank_dropout``): the oracle's forward pass draws what the engine's drew.

Each batch's two forward passes (the oracle's, on an untouched copy of the model, and the engine's) start from the
same seed. A draw a module makes as is (``torch.rand(1)``, a rank-dropout mask) is then the same in both by the seed
alone. A dropout inside a module the engine re-runs per example is drawn by the engine as a kept mask
``bernoulli_(1 - p)`` on a tensor of the input's dtype (:mod:`hf_dp.layers.replay`), as torch's own dropout draws it
on CPU (its fused CUDA kernel draws otherwise); :class:`MaskedDropout` makes the oracle draw every dropout with
``p > 0`` so on any device: the masks are inputs of the forward pass, the gradients the oracle compares with are
plain autograd's, one example at a time.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from hf_dp import BookKeepingClipper

from .oracle import LossFn, assert_rel_close, clip_factors, oracle_per_example

__all__ = ["MaskedDropout", "check_clipper_seeded"]


class MaskedDropout(TorchFunctionMode):
    """``F.dropout(x, p)`` in training as ``x * mask / (1 - p)``, the mask drawn as the engine's recorder draws it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            x = args[0] if args else kwargs["input"]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p > 0:
                keep = torch.empty_like(x).bernoulli_(1 - p).bool()
                return x * keep.to(x.dtype) / (1 - p)
        return func(*args, **kwargs)


def _seed(k: int) -> None:
    torch.manual_seed(1000 + k)


def check_clipper_seeded(
    model: torch.nn.Module,
    batches: Sequence[dict],
    loss_fn: LossFn,
    *,
    mode: str,
    masked_dropout: bool = True,
    rel: float = 1e-6,
) -> BookKeepingClipper:
    """Norms and accumulated clipped sums of ``BookKeepingClipper`` against the per-example autograd oracle, in
    float64 and training mode, each batch's two forward passes drawing the same random numbers; C is the median norm
    of the first batch (some examples clipped, some not). Also checks that the engine's backward pass leaves torch's
    random stream where its forward pass left it (a re-run's draws are not training's)."""
    model = model.double().train()
    ref = copy.deepcopy(model)
    per_batch = []
    for k, batch in enumerate(batches):
        _seed(k)
        with MaskedDropout() if masked_dropout else contextlib.nullcontext():
            names, grads = oracle_per_example(ref, batch, loss_fn)
        norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])
        per_batch.append((norms, grads))
    c = float(per_batch[0][0].median())
    expected = {name: torch.zeros_like(p) for name, p in zip(names, per_batch[0][1][0], strict=True)}
    for norms, grads in per_batch:
        coef = clip_factors(norms, c)
        for j, name in enumerate(names):
            expected[name] = expected[name] + sum(coef[i] * grads[i][j] for i in range(len(grads)))
    assert (per_batch[0][0] > c).any() and (per_batch[0][0] < c).any(), "the test must clip some examples, not all"
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode=mode)
    for k, (batch, (norms, _)) in enumerate(zip(batches, per_batch, strict=True)):
        _seed(k)
        loss = loss_fn(model, batch)
        after_forward = torch.get_rng_state()
        clipper.backward(loss)
        assert torch.equal(torch.get_rng_state(), after_forward), "the backward pass moved torch's random stream"
        torch.testing.assert_close(clipper.per_example_norms, norms, rtol=rel, atol=0)
    params = dict(model.named_parameters())
    scale = float(torch.sqrt(sum((g**2).sum() for g in expected.values())))
    for name in names:
        grad = params[name].grad
        if grad is None:  # ghost mode's second backward leaves a parameter no forward pass used (adapter dropped)
            assert float(expected[name].norm()) == 0.0, f"{name} got no gradient"
            continue
        assert_rel_close(grad, expected[name], rel, name, scale)
    clipper.rules_used = dict(clipper.hooked_modules)
    clipper.remove()
    return clipper
