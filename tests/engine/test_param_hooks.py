"""Gradient hooks on trainable parameters (DESIGN §24): applied to each example's gradient, or refused.

The gradient an example contributes is ``h(g_i)`` (what autograd gives for that example alone). The oracle here is
independent of hf_dp: per-example gradients by plain autograd on a copy of the model without the hooks
(:func:`helpers.oracle.oracle_per_example`), then the transform, written in this file from its definition, applied to
each example's gradient; ``BookKeepingClipper`` runs alone (no self-check) on the hooked model.
"""

import copy

import pytest
import torch
from helpers.models import (
    bert_classifier,
    causal_batches,
    causal_loss,
    classification_batches,
    classification_loss,
    gpt2,
    llama,
    seq2seq_batches,
    seq2seq_loss,
    t5,
)
from helpers.oracle import assert_rel_close, clip_factors, oracle_per_example
from torch import nn

from hf_dp import BookKeepingClipper, UnsupportedModuleError

MODES = ["bk", "bk-mixopt", "ghost", "per-sample"]


def hooked_oracle(model, batches, loss_fn, transforms):
    """Per-batch norms of ``h(g_i)``, the clipped sums ``sum_i c_i h(g_i)`` over the batches, ``C`` (the median norm
    of the first batch) and the largest relative change the transforms make to a per-example gradient."""
    ref = copy.deepcopy(model)
    hooked = [n for n, p in ref.named_parameters() if p._backward_hooks]
    assert not hooked, f"the oracle's copy must differentiate without the hooks: {hooked[:3]}"
    per_batch, change = [], 0.0
    for batch in batches:
        names, grads = oracle_per_example(ref, batch, loss_fn)
        for gi in grads:
            for k, name in enumerate(names):
                if name in transforms:
                    raw, gi[k] = gi[k], transforms[name](gi[k])
                    change = max(change, float((gi[k] - raw).norm() / raw.norm().clamp_min(1e-30)))
        per_batch.append((names, grads, torch.stack([torch.sqrt(sum((g**2).sum() for g in gi)) for gi in grads])))
    c = float(per_batch[0][2].median())
    sums = {}
    for names, grads, norms in per_batch:
        coef = clip_factors(norms, c)
        for k, name in enumerate(names):
            part = sum(coef[i] * grads[i][k] for i in range(len(grads)))
            sums[name] = part if name not in sums else sums[name] + part
    return [norms for *_, norms in per_batch], sums, c, change


def check_hooked(model, batches, loss_fn, transforms, mode, rel=1e-6):
    """``BookKeepingClipper`` alone on the hooked ``model`` against :func:`hooked_oracle`."""
    norms_expected, sums, c, change = hooked_oracle(model, batches, loss_fn, transforms)
    assert change > 1e-2, "the hooks must change the per-example gradients for the test to mean anything"
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode=mode)
    for batch, norms in zip(batches, norms_expected, strict=True):
        clipper.backward(loss_fn(model, batch))
        torch.testing.assert_close(clipper.per_example_norms, norms, rtol=rel, atol=0)
    params = dict(model.named_parameters())
    scale = float(torch.sqrt(sum((g**2).sum() for g in sums.values())))
    for name, expected in sums.items():
        assert params[name].grad is not None, f"{name} got no gradient"
        assert_rel_close(params[name].grad, expected, rel, name, scale)
    clipper.remove()
    assert all(params[name]._backward_hooks for name in transforms), "the user's hooks stay on the model"


# ---------------------------------------------------------------------------------------------------- peft OSF
def osf_model(base, target_modules=None):
    from peft import OSFConfig, get_peft_model

    torch.manual_seed(0)
    return get_peft_model(base().double(), OSFConfig(target_modules=target_modules))


def osf_transforms(model):
    """OSF's gradient projections from its definition (Nayak et al. 2025): the gradient of ``U_low`` loses its part
    in the frozen top singular subspace ``span(U_high)``, that of ``V_low`` its part in ``span(V_high^T)``. Where the
    factor is square the complement is ``span(U_low_init)`` (resp. ``V_low_init^T``) and peft keeps no ``U_high``."""
    transforms = {}
    for name, _ in model.named_parameters():
        if ".osf_svd_params." not in name or not name.endswith(("U_low", "V_low")):
            continue
        layer_name, rest = name.split(".osf_svd_params.")
        adapter, which = rest.split(".")
        layer = model.get_submodule(layer_name)
        if which == "U_low":
            if adapter in layer._osf_U_high:
                high = layer._osf_U_high[adapter]
                proj = torch.eye(high.shape[0], dtype=high.dtype) - high @ high.T
            else:
                low = layer._osf_U_low_init[adapter]
                proj = low @ low.T
            transforms[name] = lambda g, proj=proj: proj @ g
        else:
            if adapter in layer._osf_V_high:
                high = layer._osf_V_high[adapter]
                proj = torch.eye(high.shape[1], dtype=high.dtype) - high.T @ high
            else:
                low = layer._osf_V_low_init[adapter]
                proj = low.T @ low
            transforms[name] = lambda g, proj=proj: g @ proj
    return transforms


OSF_CASES = {
    # GPT-2's blocks are HF Conv1D, which OSF does not wrap: its nn.Linear is the (tied) lm_head
    "gpt2": (lambda: osf_model(gpt2, ["lm_head"]), causal_batches, causal_loss),
    "llama": (lambda: osf_model(llama), causal_batches, causal_loss),
    "bert": (lambda: osf_model(bert_classifier), classification_batches, classification_loss),
    "t5": (lambda: osf_model(t5), seq2seq_batches, seq2seq_loss),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(OSF_CASES))
def test_osf_projections_applied_per_example(case, mode):
    """peft's OSF projects the gradients of ``U_low`` / ``V_low`` in ``register_hook`` hooks: the engine's norms and
    clipped sums are those of the projected per-example gradients (before issue 38 the raw ones: 18-63% off)."""
    build, batches, loss_fn = OSF_CASES[case]
    model = build()
    transforms = osf_transforms(model)
    hooked = {n for n, p in model.named_parameters() if p._backward_hooks}
    assert transforms and set(transforms) == hooked
    check_hooked(model, batches(), loss_fn, transforms, mode)


def test_osf_self_check_passes():
    """The first-step self-check compares with plain autograd on each example alone, which runs the hooks: the
    engine's norms-only pass applies them too."""
    model = osf_model(llama)
    batch = causal_batches()[0]
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    clipper.backward(causal_loss(model, batch))
    assert clipper.self_check(batch, causal_loss) < 1e-6
    clipper.remove()


# ---------------------------------------------------------------------------------------------------- plain modules
class TwoLayers(nn.Module):
    """Sequence input ``[B, T, 6]``; ``square`` is called twice (its parameters used twice per example)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 5)
        self.square = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        h = torch.tanh(self.square(torch.tanh(self.square(h))))
        return self.head(h)


def plain_batches():
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(b, 4, 6, generator=g, dtype=torch.float64)} for b in (5, 3)]


def plain_loss(model, batch):
    return (model(batch["x"]) ** 2).sum((1, 2))


def plain_model_and_transforms():
    """Hand-written hooks: an orthogonal projection (idempotent), a linear map that is not (a second application
    would show), and non-linear ones (``h(sum_i g_i) != sum_i h(g_i)``), one on a parameter used twice."""
    torch.manual_seed(0)
    model = TwoLayers().double()
    basis = torch.linalg.qr(torch.randn(6, 3, dtype=torch.float64))[0]
    proj = basis @ basis.T  # onto a 3-dimensional subspace of the inputs
    mix = torch.randn(3, 3, dtype=torch.float64)
    transforms = {
        "first.weight": lambda g: g @ proj,
        "head.weight": lambda g: mix @ g,
        "head.bias": lambda g: torch.tanh(3 * g),
        "square.weight": lambda g: g * g.abs(),
    }
    for name, fn in transforms.items():
        model.get_parameter(name).register_hook(fn)
    return model, transforms


@pytest.mark.parametrize("mode", MODES)
def test_hand_written_hooks_exact(mode):
    model, transforms = plain_model_and_transforms()
    check_hooked(model, plain_batches(), plain_loss, transforms, mode)


def test_layer_wise_clipping_with_hooks():
    """With several clipping groups each group is clipped in the hook of its last use: the hooked gradients are what
    each group's norm and sum are made of (``C / sqrt(G)`` per group, checked against the oracle by group)."""
    model, transforms = plain_model_and_transforms()
    batch = plain_batches()[0]
    names, grads = oracle_per_example(copy.deepcopy(model), batch, plain_loss)
    grads = [[transforms[n](g) if n in transforms else g for n, g in zip(names, gi, strict=True)] for gi in grads]
    clipper = BookKeepingClipper(model, max_grad_norm=0.5, clipping_style="layer-wise", mode="bk")
    loss = plain_loss(model, batch)
    clipper.prepare(loss, loss_scale=1.0)
    loss.sum().backward()
    clipper.finish()
    groups = clipper.group_names
    c_g = 0.5 / len(groups) ** 0.5
    for row, group in enumerate(groups):
        index = [names.index(n) for n in group]
        norms = torch.stack([torch.sqrt(sum((gi[k] ** 2).sum() for k in index)) for gi in grads])
        torch.testing.assert_close(clipper.per_group_norms[row], norms, rtol=1e-10, atol=0)
        coef = clip_factors(norms, c_g)
        for k in index:
            expected = sum(coef[i] * grads[i][k] for i in range(len(grads)))
            assert_rel_close(model.get_parameter(names[k]).grad, expected, 1e-10, names[k])
    clipper.remove()


def test_hooks_that_write_in_place_or_only_look():
    """A hook that scales its argument in place and returns ``None``, and one that only looks at it, as autograd runs
    them (the looking one is called on every example's gradient)."""
    torch.manual_seed(0)
    model = TwoLayers().double()
    seen = []

    def triple_in_place(g):
        g.mul_(3)

    model.head.weight.register_hook(triple_in_place)
    model.first.bias.register_hook(lambda g: seen.append(1))
    check_hooked(model, plain_batches(), plain_loss, {"head.weight": lambda g: 3 * g}, "bk-mixopt")
    assert seen, "the looking hook was called"


def test_hooks_applied_to_each_privacy_unit():
    """With ``units`` the clipped quantity is a unit's gradient ``h(sum_{i in u} g_i)``: the hook runs on the unit's
    sum (what autograd gives for that user's rows alone), not on each row."""
    model, transforms = plain_model_and_transforms()
    batch, units = plain_batches()[0], [0, 0, 1, 2, 2]
    names, grads = oracle_per_example(copy.deepcopy(model), batch, plain_loss)
    sums = [[sum(grads[i][k] for i in range(len(units)) if units[i] == u) for k in range(len(names))] for u in range(3)]
    sums = [[transforms[n](g) if n in transforms else g for n, g in zip(names, gu, strict=True)] for gu in sums]
    norms = torch.stack([torch.sqrt(sum((g**2).sum() for g in gu)) for gu in sums])
    c = float(norms.median())
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode="bk")
    clipper.backward(plain_loss(model, batch), units=torch.tensor(units))
    torch.testing.assert_close(clipper.per_example_norms, norms, rtol=1e-10, atol=0)
    coef = clip_factors(norms, c)
    for k, name in enumerate(names):
        expected = sum(coef[u] * sums[u][k] for u in range(3))
        assert_rel_close(model.get_parameter(name).grad, expected, 1e-10, name)
    clipper.remove()


def test_hook_registered_after_construction_is_applied():
    torch.manual_seed(0)
    model = TwoLayers().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1e6, mode="bk")
    model.head.weight.register_hook(lambda g: 2 * g)
    batch = plain_batches()[0]
    names, grads = oracle_per_example(copy.deepcopy(model), batch, plain_loss)
    clipper.backward(plain_loss(model, batch))
    k = names.index("head.weight")
    assert_rel_close(model.head.weight.grad, 2 * sum(gi[k] for gi in grads), 1e-10, "head.weight")
    clipper.remove()


def test_hook_vmap_cannot_run_goes_example_by_example():
    """A hook with data-dependent control flow (``torch.func.vmap`` refuses it) runs on each example in a loop."""
    torch.manual_seed(0)
    model = TwoLayers().double()
    batch = plain_batches()[0]
    names, grads = oracle_per_example(copy.deepcopy(model), batch, plain_loss)
    k = names.index("head.weight")
    cut = float(torch.stack([gi[k].norm() for gi in grads]).median())  # halves some examples' gradients, not others
    hooked = [gi[k] / 2 if float(gi[k].norm()) > cut else gi[k] for gi in grads]
    calls = []

    def halve_large(g):
        calls.append(tuple(g.shape))
        return g / 2 if float(g.norm()) > cut else g

    model.head.weight.register_hook(halve_large)
    clipper = BookKeepingClipper(model, max_grad_norm=1e6, mode="bk-mixopt")
    calls.clear()
    clipper.backward(plain_loss(model, batch))
    assert_rel_close(model.head.weight.grad, sum(hooked), 1e-10, "head.weight")
    assert calls.count((3, 5)) >= len(grads), "the loop calls the hook once per example"
    clipper.remove()


# ---------------------------------------------------------------------------------------------------- refusals
def test_post_accumulate_grad_hook_refused_at_construction():
    model = TwoLayers()
    model.square.weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(UnsupportedModuleError, match=r"`square\.weight` has a post-accumulate-grad hook") as err:
        BookKeepingClipper(model, max_grad_norm=1.0)
    assert "Remove the hook" in str(err.value) and "freeze the parameter" in str(err.value)
    model.square.weight.requires_grad_(False)  # frozen: nothing to refuse
    BookKeepingClipper(model, max_grad_norm=1.0).remove()


def test_a_hook_that_logs_gradients_is_refused():
    """``wandb.watch(model, log="gradients")`` puts a ``lambda grad: ...`` defined in wandb's module on each parameter:
    run per example it would publish each example's un-clipped gradient, so it is refused (parameters-only watching
    puts no gradient hook on them). The lambda is compiled in a namespace named as wandb's, as wandb defines it."""
    namespace = {"__name__": "wandb.integration.torch.wandb_torch", "seen": []}
    exec("hook = lambda grad: seen.append(grad.norm())", namespace)
    model = TwoLayers()
    model.head.weight.register_hook(namespace["hook"])
    with pytest.raises(UnsupportedModuleError, match=r"`head\.weight` has a gradient hook that logs") as err:
        BookKeepingClipper(model, max_grad_norm=1.0)
    assert "log='parameters'" in str(err.value)
    model = TwoLayers().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    batch = plain_batches()[0]
    clipper.backward(plain_loss(model, batch))  # planned without the hook
    model.head.weight.register_hook(namespace["hook"])  # as WandbCallback does at on_train_begin
    model.zero_grad(set_to_none=True)
    with pytest.raises(UnsupportedModuleError, match="logs what it sees"):
        clipper.backward(plain_loss(model, batch))
    assert not namespace["seen"]
    clipper.remove()


def test_post_accumulate_grad_hook_added_later_refused_at_the_next_plan():
    model = TwoLayers()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    model.first.bias.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(UnsupportedModuleError, match=r"`first\.bias` has a post-accumulate-grad hook"):
        model(plain_batches()[0]["x"].float())
    clipper.remove()


def test_module_backward_hooks_refused():
    for register in ("register_full_backward_hook", "register_full_backward_pre_hook"):
        model = TwoLayers()
        handle = getattr(model.square, register)(lambda *args: None)
        with pytest.raises(UnsupportedModuleError, match=r"Module `square` \(Linear\) has a backward"):
            BookKeepingClipper(model, max_grad_norm=1.0)
        handle.remove()
        BookKeepingClipper(model, max_grad_norm=1.0).remove()


def test_global_backward_hook_refused():
    handle = nn.modules.module.register_module_full_backward_hook(lambda *args: None)
    try:
        with pytest.raises(UnsupportedModuleError, match="global module backward hook"):
            BookKeepingClipper(TwoLayers(), max_grad_norm=1.0)
    finally:
        handle.remove()


def test_hook_that_changes_the_shape_refused():
    torch.manual_seed(0)
    model = TwoLayers().double()
    model.head.weight.register_hook(lambda g: g.sum(0))
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="bk")
    with pytest.raises(UnsupportedModuleError, match=r"`head\.weight` changed the gradient's shape"):
        clipper.backward(plain_loss(model, plain_batches()[0]))
    assert model.head.weight.grad is None
    clipper.remove()
