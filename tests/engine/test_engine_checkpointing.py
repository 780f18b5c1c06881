"""Activation checkpointing: inputs book-kept from the recomputation, norms and clipped sums exact (float64 oracle).

The oracle runs on a copy of the model without checkpointing (checkpointing does not change the math). HF models use
``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` (non-reentrant, the transformers default, or
reentrant with ``use_reentrant=True``); plain models call ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` themselves. (Reentrant specifics: tests/engine/test_engine_reentrant.py.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import (
    MODEL_MATRIX,
    beit,
    causal_batches,
    causal_loss,
    gpt2,
    image_batches,
    image_loss,
    seq2seq_batches,
    seq2seq_loss,
    t5,
)
from helpers.oracle import assert_rel_close, oracle_clipped
from test_engine_policies import POLICY_MODELS, check_policy, policy_case
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_dp import BookKeepingClipper, UnsupportedModuleError

MODES = ["bk", "bk-mixopt", "per-sample"]


def hf_checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def hf_reentrant_checkpointing(model):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


ENABLE = {"non-reentrant": hf_checkpointing, "reentrant": hf_reentrant_checkpointing}


def hf_activation_checkpointing(model):
    model.activation_checkpointing_enable()  # transformers 5: non-reentrant by default


@pytest.mark.parametrize("kind", sorted(ENABLE))
@pytest.mark.parametrize("style", ["all-layer", "layer-wise"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["gpt2-tied", "llama", "bert-classifier"])
def test_hf_checkpointing_matches_oracle(float64, name, mode, style, kind):
    model, batches, loss_fn = policy_case(name)
    check_policy(model, batches, loss_fn, mode=mode, style=style, fn="abadi", checkpointing=ENABLE[kind])


@pytest.mark.parametrize(("style", "fn"), [("param-wise", "automatic"), ("groups", "abadi")])
def test_hf_activation_checkpointing_with_other_policies(float64, style, fn):
    model, batches, loss_fn = policy_case("llama-lora")
    style = POLICY_MODELS["llama-lora"][3] if style == "groups" else style
    check_policy(
        model, batches, loss_fn, mode="bk-mixopt", style=style, fn=fn, checkpointing=hf_activation_checkpointing
    )


def check_checkpointed(model, batches, loss_fn, *, mode, enable):
    """The oracle on ``model`` as it is (no checkpointing); the clipper on a copy with ``enable(copy)`` applied."""
    model = model.double()
    names, norms, sums, c = oracle_clipped(model, batches, loss_fn, None)
    model = copy.deepcopy(model)
    enable(model)
    model.train()  # checkpointing runs in training; the models have no dropout
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode=mode)
    for batch, expected in zip(batches, norms, strict=True):
        clipper.backward(loss_fn(model, batch))
        torch.testing.assert_close(clipper.per_example_norms, expected, rtol=1e-6, atol=0)
    params = dict(model.named_parameters())
    scale = float(torch.sqrt(sum((g**2).sum() for g in sums.values())))
    for name in names:
        assert_rel_close(params[name].grad, sums[name], 1e-6, name, scale)
    assert clipper._pass is None and all(p.requires_grad for p in model.parameters())
    clipper.remove()


@pytest.mark.parametrize("kind", sorted(ENABLE))
@pytest.mark.parametrize("name", ["t5", "bart-tied", "opt", "beit"])
def test_checkpointed_layouts_and_fallbacks(float64, name, kind):
    """T5: the fallback on the attention that adds the relative bias runs inside the checkpointed block; BART:
    broadcast position embeddings; OPT: flattened [B*T, d] rows; BEiT: the fallback on each (checkpointed) layer
    for its layer scales, whose hooks run outside the checkpoint (reentrant: its per-example re-run runs the layer
    without checkpointing)."""
    factory, batches, loss_fn = MODEL_MATRIX[name]
    torch.manual_seed(0)
    check_checkpointed(factory().eval(), batches(), loss_fn, mode="bk-mixopt", enable=ENABLE[kind])


class Block(nn.Module):
    def __init__(self, d=4):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)
        self.gru = nn.GRU(d, d, batch_first=True)  # the torch.func fallback

    def forward(self, x):
        h, _ = self.gru(torch.tanh(self.fc(self.norm(x))))
        return x + h


class Stack(nn.Module):
    """Each block checkpointed with plain torch.utils.checkpoint; the head outside."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 3)
        self.checkpointing = False

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return self.head(x)


def _enable_stack(model):
    model.checkpointing = True


def _project(y):
    g = torch.Generator().manual_seed(1)
    r = torch.randn(y.shape[1:], generator=g, dtype=y.dtype)
    return (y * r).flatten(1).sum(1) + 0.5 * (y**2).flatten(1).sum(1)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "per-sample"])
def test_plain_torch_checkpoint_per_block(float64, mode):
    torch.manual_seed(0)
    batches = [{"x": torch.randn(5, 5, 4)}, {"x": torch.randn(3, 5, 4)}]
    check_checkpointed(Stack(), batches, lambda m, b: _project(m(b["x"])), mode=mode, enable=_enable_stack)


@pytest.mark.parametrize("mode", MODES)
def test_whole_model_checkpointed(float64, mode):
    """The root model itself inside ``checkpoint``: its recomputation re-enters the root's hooks."""
    torch.manual_seed(0)
    batches = [{"x": torch.randn(4, 4, 4)}, {"x": torch.randn(4, 4, 4)}]

    def loss_fn(m, b):
        if getattr(m, "whole", False):
            return _project(checkpoint(m, b["x"], use_reentrant=False))
        return _project(m(b["x"]))

    def enable(model):
        model.whole = True

    check_checkpointed(Stack(), batches, loss_fn, mode=mode, enable=enable)


def test_inputs_come_from_the_recomputation(float64):
    """No input of a checkpointed call is kept in the forward pass; all of them are book-kept in the backward pass,
    including calls whose output gradient arrives before their region is recomputed."""
    model, batches, loss_fn = policy_case("gpt2-tied")
    model = copy.deepcopy(model)
    hf_checkpointing(model)
    model.train()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk")
    clipper.backward(loss_fn(model, batches[0]))  # the first batch also proves the plan and checks the layouts
    loss = loss_fn(model, batches[1])
    state = clipper._pass
    deferred = [use for use in state.uses if use.region is not None]
    assert len(state.regions) == len(model.transformer.h)
    assert len(deferred) == 2 * 6, "ln_1, c_attn, attn.c_proj, ln_2, c_fc, mlp.c_proj in each block"
    assert all(use.captured is None for use in deferred), "the forward pass keeps no checkpointed input"
    early = []
    on_grad = clipper._on_grad

    def spy(use, grad):
        if use.region is not None and use.captured is None and state.phase == "record":
            early.append(use.entry.name)
        return on_grad(use, grad)

    clipper._on_grad = spy
    clipper.prepare(loss, loss_scale=1.0)
    loss.sum().backward()
    assert all(use.processed for use in deferred)
    assert early, "some output gradient arrived before its region was recomputed (and waited for it)"
    clipper.finish()
    assert all(p.requires_grad for p in model.parameters())
    clipper.remove()


@pytest.mark.parametrize("kind", sorted(ENABLE))
def test_dropout_inside_checkpointed_fallback_is_replayed(float64, kind):
    """T5 with dropout: the fallback on the attention that adds the relative bias records its dropout masks in the
    recomputation, which draws what the forward pass drew: the same result as without checkpointing."""
    results = []
    for use_checkpointing in (False, True):
        torch.manual_seed(0)
        model = t5(dropout=0.2).double().train()
        if use_checkpointing:
            ENABLE[kind](model)
        batch = seq2seq_batches()[0]
        clipper = BookKeepingClipper(model, max_grad_norm=0.5, mode="bk-mixopt")
        torch.manual_seed(1)
        clipper.backward(seq2seq_loss(model, batch))
        torch.manual_seed(2)
        clipper.backward(seq2seq_loss(model, seq2seq_batches()[1]))
        results.append((clipper.per_example_norms, {n: p.grad for n, p in model.named_parameters()}))
        clipper.remove()
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-9, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-9, atol=1e-15, msg=name)


@pytest.mark.parametrize("kind", sorted(ENABLE))
def test_random_draws_under_an_enclosing_fallback_are_refused(kind):
    model = beit(dropout=0.2).train()
    ENABLE[kind](model)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match="drop-path probabilities to 0"):
        clipper.backward(image_loss(model, image_batches()[0]))
    clipper.remove()


def test_reentrant_checkpointing_is_refused():
    """Reentrant checkpointing is exact (tests/engine/test_engine_reentrant.py) except where a region has no graph: none
    of its tensor inputs requires grad (torch would leave its parameters without a gradient), e.g. plain
    ``checkpoint(block, x, use_reentrant=True)`` on the model's raw input. (A `torch.no_grad()` block: like
    autograd, no gradient from it: tests/engine/test_engine_uses.py.)"""
    stack = Stack().double()
    stack.forward = lambda x: stack.head(checkpoint(stack.blocks[0], x, use_reentrant=True))
    clipper = BookKeepingClipper(stack, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match="enable_input_require_grads"):
        stack(torch.randn(3, 5, 4, dtype=torch.float64))
    clipper.remove()
    assert all(p.requires_grad for p in stack.parameters())


@pytest.mark.parametrize("kind", sorted(ENABLE))
def test_ghost_mode_refuses_checkpointing(kind):
    model = gpt2().train()
    ENABLE[kind](model)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="ghost")
    with pytest.raises(UnsupportedModuleError, match="not supported in `ghost` mode"):
        causal_loss(model, causal_batches()[0])
    clipper.remove()


@pytest.mark.parametrize("kind", sorted(ENABLE))
def test_parameter_used_in_the_loss_is_refused_under_checkpointing(float64, kind):
    """The parameters stay out of autograd during the backward pass: the loss's graph is searched instead."""
    model = gpt2().double().train()
    ENABLE[kind](model)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    batch = causal_batches()[0]
    clipper.backward(causal_loss(model, batch))
    loss = causal_loss(model, batch) + (model.transformer.ln_f.weight**2).sum()
    with pytest.raises(UnsupportedModuleError, match="ln_f.weight"):
        clipper.backward(loss)
    clipper.remove()


@pytest.mark.parametrize("kind", sorted(ENABLE))
@pytest.mark.parametrize("mode", MODES)
def test_path_first_taken_inside_a_checkpointed_region(float64, mode, kind):
    """T5's encoder mask appears only on the second batch, inside a checkpointed block: its layouts are proven again
    in the middle of the region's forward pass (the probe's own autograd work kept out of the checkpoint)."""
    from test_engine_paths import _batch

    torch.manual_seed(0)
    batches = [
        _batch([6, 6, 6, 6], [3, 3, 2, 3], 6, 3, seed=0),
        _batch([6, 6, 4, 3], [3, 2, 3, 3], 6, 3, seed=1),
    ]
    check_checkpointed(t5().eval(), batches, seq2seq_loss, mode=mode, enable=ENABLE[kind])
