"""The engine's contract with its caller: hooks come and go cleanly, p.grad is plain, misuse raises, nothing leaks."""

import copy
import gc
import io
import weakref

import pytest
import torch
from helpers.models import causal_batches, causal_loss, gpt2
from torch import nn

from hf_dp import BookKeepingClipper, UnsupportedModuleError

MODES = ["bk", "bk-mixopt", "per-sample", "ghost"]


def _hooks(model):
    return [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._forward_hooks_with_kwargs))
        for m in model.modules()
    ]


def _mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _loss(model, x):
    y = model(x) ** 2
    return y.reshape(y.shape[0], -1).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_remove_leaves_a_plain_model(mode):
    model = gpt2()
    model.transformer.h[0].ln_1.weight.requires_grad_(False)
    hooks, flags = _hooks(model), {n: p.requires_grad for n, p in model.named_parameters()}
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
    clipper.backward(causal_loss(model, causal_batches()[0]))
    clipper.remove()
    assert _hooks(model) == hooks
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert all(p.grad is None or p.grad.grad_fn is None for p in model.parameters())
    ref = weakref.ref(clipper)
    del clipper
    gc.collect()
    assert ref() is None, "the model keeps a reference to the clipper"
    copy.deepcopy(model)
    torch.save(model, io.BytesIO())
    model.zero_grad()
    causal_loss(model, causal_batches()[0]).sum().backward()  # plain autograd again
    assert model.lm_head.weight.grad is not None


def test_deepcopy_and_save_while_installed_give_a_plain_model():
    model = gpt2()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    clipper.backward(causal_loss(model, causal_batches()[0]))
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (twin, loaded):
        other.zero_grad()
        causal_loss(other, causal_batches()[0]).sum().backward()  # its hooks are inert: autograd fills p.grad
        assert all(p.grad is not None for p in other.parameters())
    clipper.backward(causal_loss(model, causal_batches()[1]))  # the original is still clipped
    clipper.remove()


@pytest.mark.parametrize("mode", MODES)
def test_p_grad_never_carries_a_graph(mode):
    model = gpt2()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
    for batch in causal_batches():  # accumulation: the second micro-batch adds to the first
        loss = causal_loss(model, batch)
        clipper.prepare(loss)
        (3.0 * loss.sum()).backward(retain_graph=mode == "ghost")
        clipper.finish(loss if mode == "ghost" else None, loss_scale=3.0)
    for p in model.parameters():
        assert p.grad is not None and not p.grad.requires_grad and p.grad.grad_fn is None
    clipper.remove()


def test_book_kept_activations_are_freed_after_finish():
    """Between micro-batches nothing keeps a micro-batch's activations alive (the old p.grad graph did)."""
    model = _mlp()
    seen = []
    model[2].register_forward_hook(lambda m, args, out: seen.append(weakref.ref(args[0])))
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk")
    clipper.backward(_loss(model, torch.randn(5, 7, 4, dtype=torch.float64)))
    gc.collect()
    assert seen and all(ref() is None for ref in seen)
    clipper.remove()


def test_misuse_raises_with_what_to_do():
    model = _mlp()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="without `prepare"):
        clipper.finish()
    with pytest.raises(ValueError, match="needs a forward pass"):
        clipper.prepare(torch.ones(3, dtype=torch.float64, requires_grad=True))
    loss = _loss(model, x)
    with pytest.raises(ValueError, match="3 examples"):
        clipper.prepare(loss[:2])
    clipper.prepare(loss)
    with pytest.raises(ValueError, match="twice"):
        clipper.prepare(loss)
    unrelated = torch.ones(3, dtype=torch.float64, requires_grad=True)
    (unrelated * 2).sum().backward()  # a backward that never reaches the model
    with pytest.raises(ValueError, match="No hooked module received an output gradient"):
        clipper.finish()
    assert all(p.grad is None for p in model.parameters()), "a failed finish must not touch p.grad"
    clipper.remove()


@pytest.mark.parametrize("mode", MODES)
def test_parameter_used_in_the_loss_is_refused(mode):
    """A parameter read after the forward returned (in the loss) would get an unclipped gradient."""
    model = _mlp()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode=mode)
    out = model(torch.randn(4, 3, 4, dtype=torch.float64))
    loss = (out @ model[2].weight).pow(2).sum((1, 2))
    with pytest.raises(UnsupportedModuleError, match="2.weight"):
        clipper.backward(loss)
    clipper.remove()


def test_loss_coupling_examples_is_refused():
    model = _mlp()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    out = model(torch.randn(4, 3, 4, dtype=torch.float64)).pow(2).sum((1, 2))
    with pytest.raises(UnsupportedModuleError, match="couples examples"):
        clipper.backward(out / out.sum().detach() + out.mean())  # the batch mean mixes the examples
    clipper.remove()


def test_batch_second_root_inputs_are_refused_even_when_t_equals_b():
    model = _mlp()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    x = torch.randn(4, 4, 4, dtype=torch.float64)  # [T, B, d] with T == B
    with pytest.raises(UnsupportedModuleError, match="dimension 0"):
        clipper.backward((model(x) ** 2).sum((0, 2)))  # loss i reads column i
    clipper.remove()


def test_requires_grad_change_is_planned_again(float64):
    model = _mlp()
    clipper = BookKeepingClipper(model, max_grad_norm=1e-3)
    clipper.backward(_loss(model, torch.randn(3, 4)))
    model[0].requires_grad_(False)
    model.zero_grad()
    clipper.backward(_loss(model, torch.randn(3, 4)))
    assert model[0].weight.grad is None and model[2].weight.grad is not None
    assert [name for name, _ in clipper.hooked_modules] == ["2"]
    clipper.remove()
