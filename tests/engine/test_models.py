"""Whole tiny HF models: norms and accumulated clipped sums against the float64 per-example oracle, in every
clipping mode, with micro-batch != and == sequence length."""

import copy

import pytest
import torch
from helpers.models import MODEL_MATRIX, MODEL_MATRIX_B_EQ_T
from helpers.oracle import assert_rel_close, oracle_clipped

from hf_dp import BookKeepingClipper

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]
CASES = {**MODEL_MATRIX, **{f"{name}-b-eq-t": spec for name, spec in MODEL_MATRIX_B_EQ_T.items()}}
_REFERENCES: dict = {}


def reference(name):
    """The model (float64, eval mode: no dropout), its batches and the oracle's answer, once per session."""
    if name not in _REFERENCES:
        factory, batches, loss_fn = CASES[name]
        torch.manual_seed(0)
        model = factory().double().eval()
        data = batches()
        names, norms, sums, c = oracle_clipped(model, data, loss_fn, None)
        assert any(bool((n > c).any()) for n in norms), "the test must clip some examples"
        _REFERENCES[name] = (model, data, loss_fn, names, norms, sums, c)
    return _REFERENCES[name]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_model_matches_oracle(float64, name, mode):
    model, batches, loss_fn, names, norms, sums, c = reference(name)
    model = copy.deepcopy(model)
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode=mode)
    for batch, expected in zip(batches, norms, strict=True):
        clipper.backward(loss_fn(model, batch))
        torch.testing.assert_close(clipper.per_example_norms, expected, rtol=1e-6, atol=0)
    params = dict(model.named_parameters())
    scale = float(torch.sqrt(sum((g**2).sum() for g in sums.values())))
    for n in names:
        grad = params[n].grad
        assert grad is not None, f"{n} got no gradient"
        assert not grad.requires_grad and grad.grad_fn is None, f"{n}: p.grad carries an autograd graph"
        assert_rel_close(grad, sums[n], 1e-6, n, scale)
    clipper.remove()
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before


EXPECTED_RULES = {
    # BART's scaled word embeddings (tied with lm_head): the embedding rule times sqrt(d), not the fallback
    ("bart-tied", "model.encoder.embed_tokens"): "ScaledRule",
    ("bart-tied", "lm_head"): "LinearRule",
    # OPT's fc1/fc2 run on [B*T, d]: still the closed-form linear rule (k = T rows per example)
    ("opt", "model.decoder.layers.0.fc1"): "LinearRule",
    # T5's relative bias ([q, k] ids, no batch dimension): the fallback on the attention that adds it to the scores
    ("t5", "encoder.block.0.layer.0.SelfAttention"): "FallbackRule",
    ("t5", "encoder.block.0.layer.0.SelfAttention.q"): "LinearRule",
    ("beit", "beit.layers.0.relative_position_bias"): "FallbackRule",
}


@pytest.mark.parametrize(("name", "module"), sorted(EXPECTED_RULES))
def test_plan_uses_closed_forms_where_they_hold(float64, name, module):
    model, batches, loss_fn, *_ = reference(name)
    model = copy.deepcopy(model)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk")
    clipper.backward(loss_fn(model, batches[0]))
    assert dict(clipper.hooked_modules).get(module) == EXPECTED_RULES[(name, module)]
    clipper.remove()
