"""Engine contract: one backward without parameter gradients, remove(), errors, dtypes, non-finite examples."""

import pytest
import torch
from helpers.models import causal_batches, causal_loss, gpt2
from torch import nn

from hf_dp import BookKeepingClipper, UnsupportedModuleError


def _hook_counts(model):
    return [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]


def test_ghost_differentiation_computes_no_parameter_gradient_in_autograd():
    torch.manual_seed(0)
    model = gpt2()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk")
    loss = causal_loss(model, causal_batches()[0])
    # spies registered after the forward pass (the engine refuses post-accumulate-grad hooks when it plans)
    accumulated = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: accumulated.append(p)) for p in model.parameters()]
    clipper.backward(loss)
    for h in handles:
        h.remove()
    assert accumulated == []  # autograd never accumulated a (non-private) parameter gradient
    assert all(p.grad is not None for p in model.parameters())


def test_one_backward_pass():
    """One backward per micro-batch; the first batch of a plan adds two, to check that loss j depends on example j
    alone (for the first and the last example)."""
    model = gpt2()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    counts = []
    for batch in causal_batches():
        loss = causal_loss(model, batch)
        calls = []
        loss.grad_fn.register_hook(lambda *a, calls=calls: calls.append(1))
        clipper.backward(loss)
        counts.append(len(calls))
    assert counts == [3, 1]


def test_remove_restores_the_model():
    model = gpt2()
    model.transformer.h[0].ln_1.weight.requires_grad_(False)
    before_hooks = _hook_counts(model)
    before_flags = {n: p.requires_grad for n, p in model.named_parameters()}
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    assert _hook_counts(model) != before_hooks
    clipper.backward(causal_loss(model, causal_batches()[0]))
    clipper.remove()
    assert _hook_counts(model) == before_hooks
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before_flags
    # the model trains normally afterwards
    model.zero_grad()
    causal_loss(model, causal_batches()[0]).sum().backward()
    assert model.lm_head.weight.grad is not None


def test_requires_grad_visible_outside_forward():
    """Optimizers and the Trainer see the trainable parameters while the clipper is installed."""
    model = gpt2()
    BookKeepingClipper(model, max_grad_norm=1.0)
    model(input_ids=torch.ones(2, 3, dtype=torch.long))
    assert all(p.requires_grad for p in model.parameters())


def test_batchnorm_is_rejected_with_its_name():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model[1].requires_grad_(False)
    with pytest.raises(UnsupportedModuleError, match="`1`.*BatchNorm"):
        BookKeepingClipper(model, max_grad_norm=1.0)


def test_newly_trainable_parameter_is_checked_again():
    class Custom(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

        def forward(self, x):
            return self.fc(x) * self.scale

    model = Custom()
    BookKeepingClipper(model, max_grad_norm=1.0, allow_fallback=False)
    model.scale.requires_grad_(True)
    with pytest.raises(UnsupportedModuleError, match="scale"):
        model(torch.randn(2, 3))


def test_bad_arguments():
    with pytest.raises(ValueError, match="clipping mode"):
        BookKeepingClipper(nn.Linear(2, 2), max_grad_norm=1.0, mode="fast")
    with pytest.raises(ValueError, match="max_grad_norm"):
        BookKeepingClipper(nn.Linear(2, 2), max_grad_norm=0.0)
    clipper = BookKeepingClipper(nn.Linear(2, 2), max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        clipper.backward(torch.ones(()))


def test_norms_in_float32_for_bfloat16_models():
    torch.manual_seed(0)
    model = gpt2().to(torch.bfloat16)
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    clipper.backward(causal_loss(model, causal_batches()[0]))
    assert clipper.per_example_norms.dtype == torch.float32
    assert model.lm_head.weight.grad.dtype == torch.bfloat16


def test_non_finite_example_gets_weight_zero(float64):
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    x = torch.randn(3, 3)
    x[1, 0] = float("inf")
    coef = clipper.backward((model(x) ** 2).sum(1))
    assert coef[1] == 0 and (coef[[0, 2]] > 0).all()
    assert torch.isfinite(model.weight.grad).all() and torch.isfinite(model.bias.grad).all()


def test_empty_batch_is_a_no_op():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2))
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    clipper.backward(model(torch.zeros(0, 4, dtype=torch.long)).sum((1, 2)))
    assert clipper.per_example_norms.shape == (0,)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt"])
def test_loss_scaled_backward_clips_at_k_times_c(float64, mode):
    """fp16 loss scaling (Li et al. 2022, App. T): a backward of K * sum(loss) with finish(loss_scale=K) gives
    K times the clipped sum of the unscaled run, with the same (true) per-example norms."""
    torch.manual_seed(0)
    batch = causal_batches()[0]
    k = 1024.0
    plain, scaled = gpt2().double(), gpt2().double()
    scaled.load_state_dict(plain.state_dict())
    clip_plain = BookKeepingClipper(plain, max_grad_norm=0.3, mode=mode)
    clip_plain.backward(causal_loss(plain, batch))
    clip_scaled = BookKeepingClipper(scaled, max_grad_norm=0.3, mode=mode)
    loss = causal_loss(scaled, batch)
    clip_scaled.prepare(loss)
    (k * loss.sum()).backward()
    clip_scaled.finish(loss_scale=k)
    torch.testing.assert_close(clip_scaled.per_example_norms, clip_plain.per_example_norms, rtol=1e-10, atol=0)
    assert (clip_plain.per_example_norms > 0.3).any()
    for p, q in zip(plain.parameters(), scaled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, k * p.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["bk", "bk-mixopt"])
def test_clipped_sum_over_chunks_of_examples(float64, monkeypatch, mode):
    """A factor over the chunk size (the lm_head's [B, T, V] output gradient at scale) is masked and summed over
    chunks of examples: the same clipped sums as the float64 oracle, and a non-finite example still gets weight 0."""
    from helpers.oracle import check_clipper

    from hf_dp.engine import clipping

    calls = []
    examples = clipping._examples
    monkeypatch.setattr(clipping, "CHUNK_BYTES", 256)  # every dense factor of the tiny model is over it
    monkeypatch.setattr(clipping, "_examples", lambda g, a, b: calls.append((a, b)) or examples(g, a, b))
    torch.manual_seed(0)
    check_clipper(gpt2(), causal_batches(), causal_loss, mode=mode)
    assert calls and any(b - a < 3 for a, b in calls)  # chunks of fewer examples than the batch were summed
    model = nn.Linear(64, 2).double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    x = torch.randn(5, 3, 64)
    x[1, 0, 0] = float("inf")
    coef = clipper.backward((model(x) ** 2).sum((1, 2)))
    assert coef[1] == 0 and (coef[[0, 2, 3, 4]] > 0).all()
    assert torch.isfinite(model.weight.grad).all() and torch.isfinite(model.bias.grad).all()
