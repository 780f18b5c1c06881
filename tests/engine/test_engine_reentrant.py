"""Reentrant activation checkpointing (``use_reentrant=True``): book-keeping follows each region's recomputation in
the backward pass and its nested backward pass.

Norms and clipped sums are exact against the float64 oracle, which runs on a copy of the model without checkpointing
(the HF models in every clipping style: tests/engine/test_engine_checkpointing.py); what cannot be made exact is
refused.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers.models import bert_classifier, causal_batches, causal_loss, gpt2, gpt2_lora
from helpers.trainer import ToyDataset, check_exact_update, one_example_loss, pad_collate
from test_engine_checkpointing import Block, _project, check_checkpointed, hf_reentrant_checkpointing
from test_engine_policies import check_policy, policy_case
from torch import nn
from torch.utils.checkpoint import checkpoint

from hf_dp import BookKeepingClipper, UnsupportedModuleError
from hf_dp.engine.checkpointing import backward_keeping_grads

MODES = ["bk", "bk-mixopt"]


class Stack(nn.Module):
    """A trainable input layer (so that the regions' inputs require grad), blocks with a GRU (torch.func fallback)
    each in its own reentrant region, a head outside."""

    def __init__(self, block=Block):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([block(), block()])
        self.head = nn.Linear(4, 3)
        self.checkpointing = False

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if self.checkpointing else block(x)
        return self.head(x)


def _enable(model):
    model.checkpointing = True


def _stack_batches():
    torch.manual_seed(0)
    return [{"x": torch.randn(5, 5, 4)}, {"x": torch.randn(3, 5, 4)}]


def _stack_loss(model, batch):
    return _project(model(batch["x"]))


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt", "per-sample"])
def test_plain_torch_reentrant_checkpoint_per_block(float64, mode):
    """Closed-form rules and the torch.func fallback (GRU) inside each region, inputs book-kept in the
    recomputation."""
    torch.manual_seed(0)
    check_checkpointed(Stack(), _stack_batches(), _stack_loss, mode=mode, enable=_enable)


@pytest.mark.parametrize("mode", MODES)
def test_frozen_embeddings_before_trainable_layers(float64, mode):
    """GPT-2 LoRA: the embeddings are frozen, so the first region's input requires grad only through transformers'
    ``enable_input_require_grads`` (which ``gradient_checkpointing_enable`` calls for models fed ``input_ids``);
    without it the region would have no graph, which is refused."""
    torch.manual_seed(0)
    model = gpt2_lora().double().eval()
    for name, p in model.named_parameters():  # LoRA B starts at zero; move it so every factor is exercised
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    assert not model.base_model.model.transformer.wte.weight.requires_grad
    batches = causal_batches()
    for style in ("all-layer", "layer-wise"):
        check_policy(
            model, batches, causal_loss, mode=mode, style=style, fn="abadi", checkpointing=hf_reentrant_checkpointing
        )
    model = copy.deepcopy(model).train()
    hf_reentrant_checkpointing(model)
    model.disable_input_require_grads()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
    with pytest.raises(UnsupportedModuleError, match="enable_input_require_grads"):
        causal_loss(model, batches[0])
    clipper.remove()


def test_inputs_and_output_hooks_come_from_the_recomputation(float64):
    """The forward pass keeps no input of a checkpointed call and hooks no output (it has no graph); the
    recomputation book-keeps the inputs and hooks the recomputed outputs, whose gradients the nested backward pass
    delivers; autograd never writes ``p.grad`` (the parameters are out of autograd in the recomputation)."""
    model, batches, loss_fn = policy_case("gpt2-tied")
    model = copy.deepcopy(model)
    hf_reentrant_checkpointing(model)
    model.train()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk")
    clipper.backward(loss_fn(model, batches[0]))  # the first batch also proves the plan and checks the layouts
    loss = loss_fn(model, batches[1])
    state = clipper._pass
    regions = list(state.regions.values())
    assert len(regions) == len(model.transformer.h) and all(r.reentrant for r in regions)
    deferred = [use for use in state.uses if use.region is not None]
    assert len(deferred) == 2 * 6 and all(use.reentrant for use in deferred)
    assert all(use.captured is None for use in deferred), "the forward pass keeps no checkpointed input"
    written = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda q, name=name: written.append(name))
        for name, p in model.named_parameters()
    ]
    tasks = set()
    on_grad = clipper._on_grad

    def spy(use, grad):
        if use.reentrant:
            assert use.captured is not None, "inputs book-kept before the nested backward pass"
            tasks.add(torch._C._current_graph_task_id())
        return on_grad(use, grad)

    clipper._on_grad = spy
    clipper.prepare(loss, loss_scale=1.0)
    loss.sum().backward()
    assert not written, f"autograd wrote p.grad of {written[:3]}"
    assert all(use.processed for use in deferred)
    assert len(tasks) == len(regions), "each region's output gradients come from its own nested backward pass"
    assert all(p.requires_grad is False for p in model.parameters()), "out of autograd until finish()"
    clipper.finish()
    assert not state.recomputing and all(p.requires_grad for p in model.parameters())
    for handle in handles:
        handle.remove()
    clipper.remove()


def test_backward_without_prepare_writes_no_gradient(float64):
    """The parameters are out of autograd in every recomputation, also of a graph no ``prepare()`` covers: no
    unclipped gradient reaches ``p.grad``; they are back in autograd at the next forward pass."""
    model = Stack().double().train()
    _enable(model)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    batch = _stack_batches()[0]
    clipper.backward(_stack_loss(model, batch))
    model.zero_grad(set_to_none=True)
    _stack_loss(model, batch).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    loss = _stack_loss(model, batch)
    assert all(p.requires_grad for p in model.parameters())
    clipper.backward(loss)
    assert all(p.grad is not None for p in model.parameters())
    clipper.remove()
    assert all(p.requires_grad for p in model.parameters())


def test_dropout_draws_what_the_forward_drew(float64):
    """GPT-2 with dropout: the recomputation draws the forward's masks (torch restores the random state), so the
    result is that of the model without checkpointing."""
    results = []
    batches = causal_batches()
    for use_checkpointing in (False, True):
        torch.manual_seed(0)
        model = gpt2().double().train()
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.2
        if use_checkpointing:
            hf_reentrant_checkpointing(model)
        clipper = BookKeepingClipper(model, max_grad_norm=0.5, mode="bk-mixopt")
        norms = []
        for seed, batch in enumerate(batches):
            torch.manual_seed(seed + 1)
            clipper.backward(causal_loss(model, batch))
            norms.append(clipper.per_example_norms)
        results.append((norms, {n: p.grad for n, p in model.named_parameters()}))
        clipper.remove()
    for got, expected in zip(results[1][0], results[0][0], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-9, atol=1e-15, msg=name)


def test_support_check_runs_through_reentrant_regions():
    """The first-batch check that loss ``j`` depends on example ``j`` alone cannot use ``torch.autograd.grad``
    through a reentrant region: it runs plain backward passes (restoring every leaf's ``.grad``) and still refuses a
    loss that couples examples."""
    model = Stack().double()
    _enable(model)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    out = _project(model(torch.randn(4, 3, 4, dtype=torch.float64)))
    with pytest.raises(UnsupportedModuleError, match="couples examples"):
        clipper.backward(out / out.sum().detach() + out.mean())
    clipper.remove()
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


def test_own_backward_pass_leaves_every_grad_as_it_was():
    """The engine's own backward passes through reentrant regions (no ``torch.autograd.grad`` there) leave the
    ``.grad`` of the graph's leaves as it was, also where autograd would accumulate in place."""
    x = torch.randn(3, 4, requires_grad=True)
    x.grad = kept = torch.ones(3, 4)
    y = checkpoint(nn.Linear(4, 4), x, use_reentrant=True).sum()
    backward_keeping_grads(y, retain_graph=True)
    assert x.grad is kept and torch.equal(kept, torch.ones(3, 4))
    y.backward()  # the graph was retained
    assert not torch.equal(x.grad, torch.ones(3, 4))


# ---------------------------------------------------------------------------------------------------- refusals
class CrossBlock(Block):
    """A block that reads a context tensor (a keyword argument)."""

    def forward(self, x, context=None):
        return super().forward(x) + context


def _run(model, forward, x=None):
    model.forward = forward
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    try:
        x = torch.randn(3, 5, 4, dtype=torch.float64) if x is None else x
        clipper.backward(_project(model(x)))
    finally:
        clipper.remove()
    return clipper


def test_keyword_tensor_that_requires_grad_is_refused():
    """Bound by ``functools.partial`` (as transformers binds a layer's keyword arguments): the nested backward pass
    would run part of the outer graph."""
    model = Stack(CrossBlock).double()

    def forward(x):
        x = model.inp(x)
        context = torch.tanh(x)
        x = checkpoint(functools.partial(model.blocks[0], context=context), x, use_reentrant=True)
        return model.head(x)

    with pytest.raises(UnsupportedModuleError, match="other than as a positional input"):
        _run(model, forward)


def test_hidden_captured_tensor_is_refused_in_the_backward_pass():
    """A tensor that requires grad reached through an object the region's function holds is not visible in the
    forward; the output hook it reaches in the nested backward pass (another graph task) refuses it."""
    model = Stack(CrossBlock).double()
    holder = type("Holder", (), {})()

    def forward(x):
        x = model.inp(x)
        holder.context = model.blocks[1].fc(x)  # a hooked output, used inside the region below
        x = checkpoint(lambda h: model.blocks[0](h, context=holder.context), x, use_reentrant=True)
        return model.head(x)

    with pytest.raises(UnsupportedModuleError, match="second backward pass"):
        _run(model, forward)


def test_nested_reentrant_regions_are_refused():
    model = Stack().double()

    def forward(x):
        x = model.inp(x)
        x = checkpoint(lambda h: checkpoint(model.blocks[0], h, use_reentrant=True), x, use_reentrant=True)
        return model.head(x)

    with pytest.raises(UnsupportedModuleError, match="nested"):
        _run(model, forward)


def test_whole_model_inside_reentrant_checkpointing_is_refused():
    model = Stack().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    x = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(UnsupportedModuleError, match="Checkpoint the model's layers"):
        checkpoint(model, x, use_reentrant=True)
    clipper.remove()


class Flaky(Block):
    """Calls ``fc`` once more without gradients (in the probes and in a reentrant region's forward) than with them (in
    its recomputation): first, or last."""

    last = False

    def forward(self, x):
        if not torch.is_grad_enabled() and not self.last:
            x = self.fc(x)
        x = x + self.fc(self.norm(x))
        if not torch.is_grad_enabled() and self.last:
            x = self.fc(x)
        return x


@pytest.mark.parametrize("last", [False, True])
def test_region_that_recomputes_differently_is_refused(last):
    """Another call than the forward's (``last=False``), or fewer calls: the uses not recomputed would get no output
    hook, a silent zero."""
    model = Stack(Flaky).double()
    model.blocks[0].last = last

    def forward(x):
        return model.head(checkpoint(model.blocks[0], model.inp(x), use_reentrant=True))

    with pytest.raises(UnsupportedModuleError, match="did not call" if last else "not deterministic"):
        _run(model, forward)


class OwnScale(nn.Module):
    """A module with its own parameter (the torch.func fallback) that checkpoints its inner layer reentrantly."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return checkpoint(lambda h: self.fc(h) * self.scale, x, use_reentrant=True)


def test_reentrant_region_inside_a_fallback_module_is_refused():
    """The fallback re-runs the module per example on inputs that need no gradient: the reentrant region there would
    pass no gradient to ``scale`` (transformers' own checkpointing is switched off for the re-run instead: BEiT)."""
    model = nn.Sequential(nn.Linear(4, 4), OwnScale()).double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match="torch.func fallback"):
        clipper.backward(_project(model(torch.randn(3, 5, 4, dtype=torch.float64))))
    clipper.remove()


class TrainOnlyUse(Block):
    """In training only, reads ``fc.bias`` outside ``fc`` (a path planning, in eval mode, does not see)."""

    def forward(self, x):
        if self.training:
            x = x + self.fc.bias
        return super().forward(x)


def test_uncovered_use_inside_a_reentrant_region_is_refused():
    """The verification of the first training forward pass also checks the uses in a reentrant region's forward,
    which runs without gradients."""
    model = Stack(TrainOnlyUse).double().train()
    _enable(model)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match="fc.bias"):
        model(torch.randn(3, 5, 4, dtype=torch.float64))
    clipper.remove()


# ---------------------------------------------------------------------------------------------------- Trainer
@pytest.mark.parametrize(
    ("kind", "field"),
    [
        ("gpt2", "gradient_checkpointing"),
        ("gpt2", "activation_checkpointing"),
        ("bert-classifier", "gradient_checkpointing"),
    ],
)
def test_trainer_with_reentrant_checkpointing_is_exact(float64, tmp_dir, kind, field):
    """sigma = 0, q = 1, SGD lr = 1, one step: the update is -(1/N) sum_i clip(g_i) (tests/trainers/test_trainer.py)."""
    torch.manual_seed(0)
    classification = kind == "bert-classifier"
    model = (bert_classifier() if classification else gpt2()).double()
    dataset = ToyDataset(8, classification=classification, trim=True)
    overrides = {field: True, f"{field}_kwargs": {"use_reentrant": True}}
    trainer = check_exact_update(model, dataset, one_example_loss, tmp_dir, data_collator=pad_collate, **overrides)
    assert trainer.args.activation_checkpointing
    assert trainer.args.activation_checkpointing_kwargs == {"use_reentrant": True}
