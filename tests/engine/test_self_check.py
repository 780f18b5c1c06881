"""``BookKeepingClipper.self_check``: the engine's per-example norms against plain per-example autograd."""

import copy

import pytest
import torch
from helpers.models import MODEL_MATRIX
from torch import nn
from torch.nn import functional as F

from hf_dp import BookKeepingClipper, UnsupportedModuleError
from hf_dp.engine import SelfCheckError, rule_check
from hf_dp.layers import RULES as LAYER_RULES
from hf_dp.layers import LayerRule, register_rule
from hf_dp.layers.grads import FactoredGrad, InstantiatedGrad
from hf_dp.layers.linear import LinearRule


@pytest.mark.parametrize("name", ["gpt2-tied", "bart-tied", "t5", "opt", "beit", "llama-lora-modules-to-save"])
def test_passes_on_the_model_matrix_and_changes_nothing(float64, name):
    factory, batches, loss_fn = MODEL_MATRIX[name]
    torch.manual_seed(0)
    model = factory().double().train()
    twin = copy.deepcopy(model)
    batch = batches()[0]
    clipper = BookKeepingClipper(model, max_grad_norm=0.5)
    rng = torch.get_rng_state()
    error = clipper.self_check(batch, loss_fn, num_examples=3)
    assert 0 <= error < 1e-6
    assert torch.equal(rng, torch.get_rng_state()), "the self-check changed the random stream"
    assert all(m.training for m in model.modules()), "training flags not restored"
    assert all(p.grad is None for p in model.parameters()), "the self-check touched p.grad"
    assert clipper.per_example_norms is None
    # training afterwards is what it would have been without the self-check
    clipper.backward(loss_fn(model, batch))
    reference = BookKeepingClipper(twin, max_grad_norm=0.5)
    reference.backward(loss_fn(twin, batch))
    torch.testing.assert_close(clipper.per_example_norms, reference.per_example_norms, rtol=1e-10, atol=0)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    clipper.remove()
    reference.remove()


def test_float32_within_its_tolerance():
    factory, batches, loss_fn = MODEL_MATRIX["gpt2-tied"]
    torch.manual_seed(0)
    model = factory()
    clipper = BookKeepingClipper(model, max_grad_norm=0.5)
    assert clipper.self_check(batches()[0], loss_fn) < 1e-3
    clipper.remove()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, ids):
        return self.out(torch.tanh(self.fc(self.embed(ids))))


def _net_loss(model, batch):
    return (model(batch["ids"]) ** 2).sum((1, 2))


def _batch():
    return {"ids": torch.randint(0, 11, (5, 4), generator=torch.Generator().manual_seed(0))}


@pytest.fixture
def broken_linear_rule():
    """Install a wrong rule for nn.Linear (with `override=True`) for one test, then restore the real one."""
    original = LAYER_RULES[nn.Linear]

    def install(rule_cls):
        register_rule(nn.Linear, override=True)(rule_cls)

    yield install
    LAYER_RULES[nn.Linear] = original
    assert isinstance(LAYER_RULES[nn.Linear], LinearRule)


def test_catches_a_rule_that_mixes_examples(float64, broken_linear_rule):
    """A rule right for one example but wrong for a batch (it rolls the output gradients across examples): the
    engine's one-example check cannot see it; the self-check does, and names the parameters."""

    class RolledLinearRule(LinearRule):
        def per_example_grads(self, module, captured, grad_output, trainable):
            return super().per_example_grads(module, captured, grad_output.roll(1, 0), trainable)

    broken_linear_rule(RolledLinearRule)
    torch.manual_seed(0)
    model = _Net().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(SelfCheckError, match=r"`fc\.weight`|`out\.weight`"):
        clipper.self_check(_batch(), _net_loss)
    clipper.remove()


def test_catches_a_rule_giving_nan_on_a_batch(float64, broken_linear_rule):
    """A rule right for one example (so its check when planning passes) whose per-example norms are NaN on a batch:
    the self-check's comparison with autograd must fail on the NaN, not pass it."""

    class NanOnBatchLinearRule(LinearRule):
        def per_example_grads(self, module, captured, grad_output, trainable):
            grads = super().per_example_grads(module, captured, grad_output, trainable)
            if grad_output.shape[0] > 1:
                grads[module.bias] = InstantiatedGrad(torch.full_like(grads[module.bias].value, float("nan")))
            return grads

    broken_linear_rule(NanOnBatchLinearRule)
    clipper = BookKeepingClipper(_Net().double(), max_grad_norm=1.0)
    with pytest.raises(SelfCheckError, match=r"`(fc|out)\.bias` \(example 0: engine nan"):
        clipper.self_check(_batch(), _net_loss)
    clipper.remove()
    # ghost mode's own check of the first batch (the engine's sum of per-example gradients against autograd's)
    model = _Net().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, mode="ghost")
    with pytest.raises(UnsupportedModuleError, match=r"`(fc|out)\.bias` gets a gradient"):
        clipper.backward(_net_loss(model, _batch()))
    clipper.remove()


def test_a_rule_wrong_for_one_example_is_caught_when_planning(float64, broken_linear_rule):
    class DoubledLinearRule(LayerRule):
        def per_example_grads(self, module, captured, grad_output, trainable):
            g, a = grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1]), captured.args[0]
            a = a.reshape(a.shape[0], -1, a.shape[-1])
            grads = {module.weight: FactoredGrad(left=2 * g, right=a, shape=module.weight.shape)}
            if module.bias is not None:
                grads[module.bias] = InstantiatedGrad(g.sum(1))
            return grads

    broken_linear_rule(DoubledLinearRule)
    model = _Net().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(SelfCheckError, match=r"DoubledLinearRule.*`fc`.*`weight`"):
        clipper.self_check(_batch(), _net_loss)
    clipper.remove()


@pytest.mark.parametrize("where", ["gradient", "norm"])
def test_a_rule_giving_nan_is_caught_when_planning(float64, broken_linear_rule, monkeypatch, where):
    """A NaN in a rule's gradient (or in its ghost norm alone) makes every comparison with autograd false: it must
    count as a mismatch, not as a pass (nor be shared with the other linear layers)."""

    class NanLinearRule(LinearRule):
        def per_example_grads(self, module, captured, grad_output, trainable):
            grads = super().per_example_grads(module, captured, grad_output, trainable)
            if where == "gradient":
                grads[module.bias] = InstantiatedGrad(torch.full_like(grads[module.bias].value, float("nan")))
            return grads

    broken_linear_rule(NanLinearRule)
    if where == "norm":  # the ghost norms of factored gradients are NaN (the embedding's first); their values are right
        real_norm_sq = rule_check.norm_sq

        def nan_norm_sq(g, dtype, **kwargs):
            out = real_norm_sq(g, dtype, **kwargs)
            return out * float("nan") if isinstance(g, FactoredGrad) else out

        monkeypatch.setattr(rule_check, "norm_sq", nan_norm_sq)
    clipper = BookKeepingClipper(_Net().double(), max_grad_norm=1.0)
    message = r"NanLinearRule.*`fc`.*`bias` is off by nan" if where == "gradient" else r"norm of `weight` is nan"
    with pytest.raises(SelfCheckError, match=message):
        clipper.self_check(_batch(), _net_loss)
    clipper.remove()


class _FunctionalHead(nn.Module):
    """The embedding's weight is also used by a functional call in the parent's forward (a tied output layer)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, ids):
        return F.linear(torch.tanh(self.norm(self.embed(ids))), self.embed.weight)


def test_catches_a_use_the_engine_does_not_see(float64, monkeypatch):
    """If the engine's use tracking missed the functional use (simulated by hiding `F.linear` from it), the use
    would silently contribute nothing: the self-check's comparison catches it and names the parameter."""
    import hf_dp.engine.probe as probe

    monkeypatch.setattr(probe, "_NOT_USES", probe._NOT_USES | {F.linear})
    model = _FunctionalHead().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    with pytest.raises(SelfCheckError, match=r"`embed\.weight`"):
        clipper.self_check(_batch(), _net_loss)
    clipper.remove()


def test_an_unhooked_use_is_refused_without_the_fallback(float64):
    model = _FunctionalHead().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0, allow_fallback=False)
    with pytest.raises(UnsupportedModuleError, match=r"`embed\.weight`.*allow_fallback"):
        clipper.self_check(_batch(), _net_loss)
    clipper.remove()


def _bert_lora():
    from helpers.models import bert_classifier
    from peft import LoraConfig, get_peft_model

    return get_peft_model(bert_classifier(), LoraConfig(r=2, lora_alpha=4, target_modules=["query", "value", "dense"]))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("name", ["gpt2-lora", "llama-lora", "bert-lora"])
def test_lora_with_gradient_checkpointing_passes_the_self_check(float64, name, reentrant):
    """LoRA with activation checkpointing (peft turns on `enable_input_require_grads`, so no hooked output needs the
    engine's origin): the self-check's norms-only pass backpropagates to the graph's own leaves (it found no origin
    and ran no backward at all: every LoRA parameter had norm 0), and the step is exact against the oracle (run on
    a copy without checkpointing: reentrant checkpointing refuses `autograd.grad`)."""
    from helpers.models import (
        causal_batches,
        causal_loss,
        classification_batches,
        classification_loss,
        gpt2_lora,
        llama_lora,
    )
    from helpers.oracle import assert_rel_close, oracle_clipped

    torch.manual_seed(0)
    build = {"gpt2-lora": gpt2_lora, "llama-lora": llama_lora, "bert-lora": _bert_lora}[name]
    model = build().double().train()
    for param_name, p in model.named_parameters():
        if p.requires_grad and "lora_B" in param_name:
            nn.init.normal_(p, std=0.2)  # peft starts B at 0: A's gradients would vanish
    reference = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if name == "bert-lora":
        model.enable_input_require_grads()  # peft does this for causal LMs; BERT's embeddings need it by hand
    batches, loss = (
        (classification_batches(), classification_loss) if name == "bert-lora" else (causal_batches(), causal_loss)
    )
    names, norms, expected, c = oracle_clipped(reference, batches, loss, None)
    clipper = BookKeepingClipper(model, max_grad_norm=c, mode="bk-mixopt")
    assert clipper.self_check(batches[0], loss) < 1e-6
    for batch, norm in zip(batches, norms, strict=True):
        clipper.backward(loss(model, batch))
        torch.testing.assert_close(clipper.per_example_norms, norm, rtol=1e-6, atol=0)
    params = dict(model.named_parameters())
    for param_name in names:
        assert_rel_close(params[param_name].grad, expected[param_name], 1e-6, param_name)
    clipper.remove()


class _TrainOnlyScale(nn.Linear):
    """A linear layer that scales its output by 3 in training mode only (a stand-in for any train-only path)."""

    def forward(self, x):
        return super().forward(x) * (3.0 if self.training else 1.0)


class _TrainOnlyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.drop = nn.Dropout(0.5)
        self.fc = _TrainOnlyScale(6, 5)

    def forward(self, ids):
        return self.fc(self.drop(torch.tanh(self.embed(ids))))


def test_a_rule_wrong_in_training_mode_only_is_caught(float64):
    """A rule that ignores a training-only factor (right in eval mode, 3x in training): the eval-mode check passes,
    the training-mode one (same dropout masks for the engine and the reference) names the parameter."""

    register_rule(_TrainOnlyScale)(type("EvalOnlyRule", (LinearRule,), {}))
    try:
        torch.manual_seed(0)
        model = _TrainOnlyNet().double()
        clipper = BookKeepingClipper(model, max_grad_norm=1.0)
        model.eval()
        assert clipper.self_check(_batch(), _net_loss) < 1e-9
        model.train()
        state = torch.get_rng_state()
        with pytest.raises(SelfCheckError, match=r"in training mode.*`fc\.weight`"):
            clipper.self_check(_batch(), _net_loss)
        assert torch.equal(torch.get_rng_state(), state)  # training draws what it would have drawn without the check
        clipper.remove()
    finally:
        LAYER_RULES.pop(_TrainOnlyScale, None)


def test_dropout_in_training_mode_passes(float64):
    """With dropout on, the training-mode check compares like with like (the same masks): it passes."""
    torch.manual_seed(0)
    model = _TrainOnlyNet().double()
    model.fc = nn.Linear(6, 5).double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    model.train()
    assert clipper.self_check(_batch(), _net_loss) < 1e-9
    clipper.remove()


def _coupled_beyond_three(model, batch):
    """Each example's own loss, and the last one also takes the losses of examples 3 and on: a coupling the first
    three examples alone do not show."""
    per = _net_loss(model, batch)
    if per.shape[0] <= 4:
        return per
    extra = torch.zeros_like(per)
    extra[-1] = per[3:-1].sum()
    return per + extra


def test_the_whole_micro_batch_is_still_support_checked(float64):
    """The self-check runs on its three examples; the check that each loss depends on its own example alone still
    runs on the whole micro-batch, at its own backward pass."""
    torch.manual_seed(0)
    model = _Net().double()
    batch = {"ids": torch.randint(0, 11, (6, 4), generator=torch.Generator().manual_seed(0))}
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)
    assert clipper.self_check(batch, _coupled_beyond_three) < 1e-9
    with pytest.raises(UnsupportedModuleError, match="couples examples"):
        clipper.backward(_coupled_beyond_three(model, batch))
    assert all(p.grad is None for p in model.parameters())
    clipper.remove()


def test_a_loss_that_couples_the_checked_examples_is_named_as_such(float64):
    """A batch-mean in the loss: the self-check's comparison fails, and the error says the loss couples examples (the
    support check's), not that a rule is wrong."""
    torch.manual_seed(0)
    model = _Net().double()
    clipper = BookKeepingClipper(model, max_grad_norm=1.0)

    def centred(m, b):
        per = _net_loss(m, b)
        return per - per.mean()

    with pytest.raises(UnsupportedModuleError, match="couples examples") as caught:
        clipper.self_check(_batch(), centred)
    assert not isinstance(caught.value, SelfCheckError)
    clipper.remove()
